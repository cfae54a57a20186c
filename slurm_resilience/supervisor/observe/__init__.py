"""Observe: sockets, the store and Slurm turned into observations for ``decide``."""
