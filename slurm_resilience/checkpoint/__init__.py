"""Multi-level checkpoints: tiers, on-disk format, manifests and redundancy.

A checkpoint is written to one of three tiers, fastest first: L0 keeps a copy in
host memory, L1 writes to node-local storage and protects it with PARTNER (a copy
on another node) or XOR (parity across a group of nodes) redundancy, and L2 writes
to the parallel filesystem. Each rank writes one HDF5 shard (``hdf5_format``) with
a CRC32 per dataset; every file is committed atomically (temporary name, fsync,
rename, fsync of the directory), so a killed writer never leaves a partial file
under a final name. A step's ``manifest.json`` is written only after every rank's
shard is durable, and the tier's ``latest`` pointer moves only after the manifest
(``manifest``), so ``latest`` never names a checkpoint that cannot be restored.
"""
