"""A stage's saveable state: checkpoints on disk."""
