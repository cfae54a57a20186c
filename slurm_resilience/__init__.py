"""slurm_resilience — keep distributed training running on Slurm when nodes fail.

Vocabulary
----------
worker node
    A node of the allocation that runs one training rank.
spare
    A node of the allocation held in reserve. A *warm standby* process runs on it
    from the start (its own ``srun`` step): it has imported torch, built the model
    and connected to the store, so adopting a rank costs no process start-up.
supervisor
    One process per job (the batch step, on a node of its own) that hosts the
    rendezvous store, watches every rank and decides how to recover.
generation
    A numbered version of the job's membership. Every recovery publishes a new
    generation; process groups are rebuilt under a fresh store prefix per generation.
rank table
    The versioned map rank → (node, worker, local rank, device, address) of one
    generation. A replaced slot keeps its rank.
plan
    What the supervisor publishes for a generation: the rank table, which ranks are
    joining, and the action (run, abort).
safe point
    A step boundary: the state is that of a completed optimizer step and the data
    position is exact. Ranks stop only at safe points (or abandon the step in flight).
recovery level
    How much is rebuilt: online (survivors keep their processes), process restart in
    place, node replacement from a spare, fallback relaunch of every rank.
run
    One submission of a job, kept across its requeues and resubmissions; named by a
    random *run id* (a Slurm job id can repeat). A checkpoint belongs to the run that
    wrote it.

Guarantees
----------
* Bit-identical recovery: with deterministic training (data chosen by global sample
  index, SUM all-reduce, fixed threads), a run that suffers faults ends with the same
  bits as a fault-free one, because state is restored from a surviving peer's exact
  copy and the data position rolls back to the last completed step.
* At most one step lost on online recovery: the step in flight is redone.
* A rank left out of a newer plan stops (fencing), so an old generation never
  carries on beside a new one.
* A run restores only its own checkpoints: another run's are ignored, and said so.
"""

__version__ = "0.1.0"

__all__ = ["Session", "Step", "ResumableSampler", "ResumableLoader", "load_config", "ResilienceError", "ResilientExecutor",
           "shard_range", "JobEnded"]


def __getattr__(name):  # lazy: the supervisor CLI must not pay for torch on import
    if name in ("Session", "Step"):
        from .worker import session

        return getattr(session, name)
    if name == "ResumableSampler":
        from .data.sampler import ResumableSampler

        return ResumableSampler
    if name == "ResumableLoader":
        from .data.loader import ResumableLoader

        return ResumableLoader
    if name == "shard_range":
        from .worker.reshard import shard_range

        return shard_range
    if name == "load_config":
        from .config import load_config

        return load_config
    if name == "ResilienceError":
        from .errors import ResilienceError

        return ResilienceError
    if name == "JobEnded":
        from .errors import JobEnded

        return JobEnded
    if name == "ResilientExecutor":
        from .launch.submitter import ResilientExecutor

        return ResilientExecutor
    raise AttributeError(name)
