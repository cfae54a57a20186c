"""Adapters: thin wrappers over Slurm steps, node states, zygotes and the store."""
