"""Data loading that resumes exactly: O(1)-memory shuffling (``permutation``), the
position-addressable sample order (``sampler``) and a DataLoader whose whole state is
(seed, position) (``loader``)."""
