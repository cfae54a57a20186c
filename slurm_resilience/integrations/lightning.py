"""PyTorch Lightning: one callback gives a ``Trainer`` our recovery (docs/lightning.md).

``Trainer(..., callbacks=[Resilience()])`` launched with ``slurm-resilience run``
(relaunch mode, warm spares) or ``submit``. Which extension point, and why:

- **Callback** (this): the only one that sees every step (``on_train_batch_end``,
  after the optimizer update) *and* runs after the process group exists and
  before the restore (``on_fit_start``) and before the first batch
  (``on_train_start``). A user already passes ``callbacks=[...]``.
- ClusterEnvironment: not needed. Under ``slurm-resilience run`` every rank has the
  srun task variables and ``MASTER_ADDR``/``MASTER_PORT`` (rankenv.py), so
  Lightning's own ``SLURMEnvironment`` is detected and is right after a relaunch.
- Strategy: replacing ``strategy="ddp"`` would tie us to one strategy (DDP vs FSDP)
  and has no per-step end hook.
- CheckpointIO: only called for Lightning's own ``.ckpt`` saves and ``ckpt_path``
  loads; it cannot make the trainer restore when the user passed no path.

What the callback does, per rank:

  every ``every`` steps   Collective: the ranks all-gather their generators (``rng.py``);
                          local rank 0 of each node writes Lightning's full
                          checkpoint dict (model, optimizers, schedulers, fit-loop
                          progress, callbacks, datamodule) with every rank's generators
                          to a node-local directory (atomic; newest ``keep`` kept);
                          rank 0 appends ``STEP UNIX_TIME`` to ``SR_PROGRESS_FILE``.
                          Optimizer steps only: with ``accumulate_grad_batches`` a
                          window's first micro-batches are not snapshots (their grads
                          are not in Lightning's dict); a restore replays the window
  at fit start            Collective: every rank says the newest step its node holds;
                          the plan (``plan_restore``, pure) picks the newest and the
                          lowest rank holding it, which broadcasts it over the
                          process group: a spare that replaced a lost node gets the
                          state from a survivor, not from a shared ``.ckpt``
  before the first batch  on a mid-epoch restore, the sampler skips the samples of
                          the epoch's completed batches (no data is read for them); the
                          loader iterator is remade from the generators as they were
                          before the epoch's iterator (its workers' base seed is the
                          fault-free run's), then each rank's generators are set to
                          its own entry of the snapshot
  preemption (``run``)    Collective, after every step: rank 0 looks for the
                          supervisor's request (``JOBDIR/preempt.request``,
                          supervisor/executors/relaunch_preempt.py) and broadcasts what it saw;
                          on a request rank 0 copies the step just completed to the
                          job directory (``JOBDIR/lightning/JOB``, durable) and every rank
                          exits (:class:`Persisted`). The requeued job restores the
                          newest of the nodes' snapshots and that copy.

DDP replicates the model and optimizer on every rank, so any survivor's copy is the
whole state: a node loss loses no snapshot unless every node is lost. Strategies that
shard it (FSDP, ModelParallel, DeepSpeed) are refused at ``setup`` (``check_strategy``).
Uses three private Lightning attributes (``trainer._checkpoint_connector``,
``fit_loop._combined_loader``, ``fit_loop._data_fetcher``); tested with 2.6.
"""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
from pytorch_lightning import Callback, LightningModule, Trainer

from ..errors import ConfigError
from . import rng
from .snapshots import (  # noqa: F401 (re-exported: the callback's pure parts)
    SNAPSHOT_PREFIX, NodeSnapshots, Persisted, RestorePlan, SnapshotEnv, check_counts, fetch_snapshot, gather_newest,
    plan_restore, preempt_requested, resume_position)


__all__ = ["LightningEnv", "check_strategy", "Resilience"]


class LightningEnv(SnapshotEnv):
    """The callback's environment: snapshots under ``.../lightning/JOB/NODE``, root
    ``SR_LIGHTNING_DIR``."""

    KIND = "lightning"


class _SkipOnce(torch.utils.data.Sampler):
    """Wraps the epoch's sampler: its first iteration starts ``skip`` samples in."""

    def __init__(self, inner: Any, skip: int) -> None:
        self.inner, self.skip = inner, skip

    def __iter__(self) -> Iterator[int]:
        skip, self.skip = self.skip, 0
        for i, index in enumerate(self.inner):
            if i >= skip:
                yield index

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        if hasattr(self.inner, "set_epoch"):
            self.inner.set_epoch(epoch)


def check_strategy(strategy: Any) -> None:
    """Raises ``ConfigError`` (one line) for a strategy whose ranks do not each hold the whole
    state: a node's snapshot is one rank's ``dump_checkpoint``, complete only under DDP (or
    one device). FSDP/ModelParallel shard it, DeepSpeed (a ``DDPStrategy`` subclass) too."""
    from pytorch_lightning.strategies import DDPStrategy, DeepSpeedStrategy, SingleDeviceStrategy

    if isinstance(strategy, DeepSpeedStrategy) or not isinstance(strategy, (DDPStrategy, SingleDeviceStrategy)):
        raise ConfigError(f"Resilience(): strategy {type(strategy).__name__} is not supported: its ranks hold "
                          f"shards, a node's snapshot would miss the others; use strategy=\"ddp\"")


class Resilience(Callback):
    """Per-step node-local snapshots, peer restore and exact batch position for a Trainer.

    directory: node-local snapshot directory (default
    ``/tmp/slurm_resilience-USER/lightning/JOB/NODE`` under Slurm; none otherwise).
    every: snapshot every N optimizer steps (1: no completed step is ever redone).
    keep: snapshots kept per node. Raises ``ConfigError`` for every or keep below 1.
    """

    def __init__(self, *, directory: str | os.PathLike | None = None, every: int = 1, keep: int = 2) -> None:
        check_counts("Resilience", every=every, keep=keep)
        self.env = LightningEnv.from_env(os.environ)
        chosen = Path(directory) if directory is not None else self.env.default_dir()
        self.snapshots = NodeSnapshots(chosen, keep) if chosen is not None else None
        durable = self.env.durable_dir()
        self.durable = NodeSnapshots(durable, keep) if durable is not None else None
        self.every = every
        self.restored: RestorePlan | None = None
        self._skip = 0
        self._epoch_rng: dict[str, Any] | None = None  # the generators before this epoch's loader iterator
        self._resume_rng: dict[str, Any] | None = None  # this rank's entry of the restored snapshot
        self._position = (0, 0)  # the restored snapshot's epoch and its completed batches
        self._stepped = 0  # the optimizer step last seen (a micro-batch of an accumulation window leaves it)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        check_strategy(trainer.strategy)

    # -- restore ---------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Collective: every rank calls it (Lightning's hook); a rank missing hangs in gloo."""
        where = dict(rank=trainer.global_rank, world_size=trainer.world_size)
        plan, steps, kept = gather_newest(self.snapshots, self.durable, **where)
        self.restored = plan
        if plan.source is None:
            self._epoch_rng = rng.capture()  # the first epoch's loader iterator draws its seed next
            return
        checkpoint = torch.load(io.BytesIO(fetch_snapshot(plan, self.snapshots, self.durable, **where)),
                                weights_only=False)
        self._resume_rng = rng.own(checkpoint.pop(rng.RNG_KEY, None), **where)
        fit = checkpoint["loops"]["fit_loop"]  # the position as the snapshot's step left it (Lightning's
        self._position = (fit["epoch_progress"]["current"]["processed"],  # reset() advances an epoch
                          fit["epoch_loop.batch_progress"]["current"]["processed"])  # whose last batch is done)
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = checkpoint  # restore_training_state() takes loops/optimizers next
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        if trainer.global_rank == 0:
            where = "the job directory (durable copy)" if plan.durable else f"rank {plan.source}'s node"
            print(f"slurm_resilience: restored step {plan.step} from {where} (gathered {steps}, durable {kept})",
                  flush=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._static_buckets(trainer)
        self._stepped = trainer.global_step
        if self.restored is None or self.restored.source is None or trainer.fit_loop._combined_loader is None:
            return
        loop = trainer.fit_loop
        epoch, skip = resume_position(*self._position, trainer.num_training_batches)
        saved = self._resume_rng
        if saved is not None:  # the iterator below draws its workers' seed as the epoch's first one did
            self._epoch_rng = saved["step"] if skip == 0 else saved["epoch"]
            rng.apply(self._epoch_rng)
        # The iterator Lightning made before the restore reads the epoch's start, in the
        # sampler's default epoch: remake it at the exact sample.
        for loader in loop._combined_loader.flattened:
            batches = loader.batch_sampler
            inner = batches.sampler
            if hasattr(inner, "set_epoch"):
                inner.set_epoch(epoch)
            batches.sampler = _SkipOnce(inner, skip * batches.batch_size)
        iter(loop._data_fetcher)
        self._skip = skip
        if saved is not None and skip:  # mid-epoch: as the snapshot's step left them (at an epoch's
            rng.apply(saved["step"])    # start the iterator's draw just made is the fault-free run's)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        loop = trainer.fit_loop
        if trainer.current_epoch > 0 and not loop.is_resuming and not loop.epoch_loop.restarting:
            self._epoch_rng = rng.capture()  # Lightning makes the epoch's loader iterator next

    @staticmethod
    def _static_buckets(trainer: Trainer) -> None:
        """DDP re-buckets after its first backward by gradient-ready order, and gloo's ring
        sums an element in an order set by its place in the bucket: a relaunched process
        would take its first step in the initial layout where the fault-free run had the
        rebuilt one (different last bits at 3+ ranks). Fixed from parameter order before
        the first backward, in every run, as ``session.ddp`` does (``worker/rebind.py``)."""
        from torch.nn.parallel import DistributedDataParallel

        from ..worker.rebind import static_buckets

        model = getattr(trainer.strategy, "model", None)
        if isinstance(model, DistributedDataParallel):
            static_buckets(model)

    # -- every step ------------------------------------------------------------
    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        step = trainer.global_step
        if step == self._stepped:
            return  # inside an accumulation window: no optimizer step yet, nothing to snapshot or report
        self._stepped = step
        state, taken = None, False  # ``_state`` is a collective: every rank takes it, or none
        if self.snapshots is not None and step % self.every == 0:
            state, taken = self._state(trainer), True
            if trainer.local_rank == 0:
                self.snapshots.write(step, state)
        if trainer.global_rank == 0 and self.env.progress_file:
            with open(self.env.progress_file, "a") as f:
                f.write(f"{step} {time.time():.6f}\n")
        if preempt_requested(self.env.run_job_dir, rank=trainer.global_rank, world_size=trainer.world_size,
                             device=trainer.strategy.root_device):
            if not taken:  # not ``state is None``: that is every rank but the local rank 0s
                state = self._state(trainer)
            if trainer.global_rank == 0:
                self.durable.write(step, state)
                print(f"slurm_resilience: preempted: step {step} persisted to {self.durable.directory}", flush=True)
            trainer.strategy.barrier("slurm_resilience.persisted")  # no rank ends before the copy is whole
            raise Persisted(0)

    def _state(self, trainer: Trainer) -> dict[str, Any] | None:
        """Collective: every rank's generators (now, and before this epoch's loader iterator),
        gathered; on local rank 0 Lightning's checkpoint dict with them (others None)."""
        states = rng.gather({"step": rng.capture(), "epoch": self._epoch_rng}, rank=trainer.global_rank,
                            world_size=trainer.world_size)
        if trainer.local_rank != 0:
            return None
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        checkpoint[rng.RNG_KEY] = states
        return checkpoint
