"""The trainer: turns packed rollouts into policy updates (backend, objective, packing, checkpoints)."""
