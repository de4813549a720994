"""The data half of training: sources rendered into chat-template token rows (rendering, dataset,
repetition), split by the corpora's held-out rule, prepared once per run folder (prepare), the target's
features cached (feature_cache), and the tools that make data with the target (distill, synthesize,
rowlog, vocab_coverage). The engine reads only what `prepare` built."""
