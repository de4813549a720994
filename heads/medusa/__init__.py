"""Medusa heads: K parallel heads on the target's last feature (module), how they draft (drafter), and
Medusa-1 checkpoints (convert)."""
