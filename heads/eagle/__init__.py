"""EAGLE heads of our older selfdraft layout (module), how every EAGLE head drafts (drafter), and EAGLE-1
checkpoints (convert)."""
