"""Slurm adapters: commands (argv + timeout) and pure parsing."""
