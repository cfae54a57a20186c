"""The supervisor: one per job; watches, decides, acts."""
