"""Prompt corpora that both the bench and training read: the raw sources (ShareGPT, the Python standard
library, user datasets), MT-bench and its decontamination guard, near-duplicate detection, and the
held-out split rule. A layer of its own just above the core, so `bench` (prompt sets) and `training`
(data splits) share one split rule without bench importing training."""
