"""Measuring selfdraft: `selfdraft bench` (run, report, plots), timing helpers, prompt sets, tree
tuning and the near-tie diagnostic for low-precision targets. Above inference, below training."""
