"""Models of the toolkit at scales the development box cannot reach.

``goodput``
    A seeded discrete-event simulator of one long training job under a
    per-category Poisson failure model (default: Meta's Llama 3 pre-training
    run). It predicts the effective training time ratio (ETTR = productive
    time / wall time) of recovery strategies — the toolkit's online recovery
    onto warm spares, job-level requeue, in-job restart from a checkpoint —
    with the loss broken down into lost work, recovery time and checkpoint
    overhead, and compares a prediction with a measured run.

Nothing here imports torch or talks to Slurm; everything is pure and seeded.
"""
