"""The single controller: data, rollout, training loop and checkpoints (imports torch and ray)."""
