"""PyTorch Lightning: one callback gives a ``Trainer`` our recovery (docs/lightning.md).

``Trainer(..., callbacks=[Resilience()])`` launched with ``slurm-resilience run``
(relaunch mode, warm spares) or ``submit``. Which extension point, and why:

- **Callback** (this): the only one that sees every step (``on_train_batch_end``,
  after the optimizer update) *and* runs after the process group exists and
  before the restore (``on_fit_start``) and before the first batch
  (``on_train_start``). A user already passes ``callbacks=[...]``.
- ClusterEnvironment: not needed. Under ``slurm-resilience run`` every rank has the
  srun task variables and ``MASTER_ADDR``/``MASTER_PORT`` (launch/rankenv.py), so
  Lightning's own ``SLURMEnvironment`` is detected and is right after a relaunch.
- Strategy: replacing ``strategy="ddp"`` would tie us to one strategy (DDP vs FSDP)
  and has no per-step end hook.
- CheckpointIO: only called for Lightning's own ``.ckpt`` saves and ``ckpt_path``
  loads; it cannot make the trainer restore when the user passed no path.

What the callback does, per rank:

  every ``every`` steps   local rank 0 of each node writes Lightning's full
                          checkpoint dict (model, optimizers, schedulers, fit-loop
                          progress, callbacks, datamodule) to a node-local directory
                          (atomic; newest ``keep`` kept); rank 0 appends
                          ``STEP UNIX_TIME`` to ``SR_PROGRESS_FILE``
  at fit start            Collective: every rank says the newest step its node holds;
                          the plan (``plan_restore``, pure) picks the newest and the
                          lowest rank holding it, which broadcasts it over the
                          process group: a spare that replaced a lost node gets the
                          state from a survivor, not from a shared ``.ckpt``
  before the first batch  on a mid-epoch restore, the sampler skips the samples of
                          the epoch's completed batches (no data is read for them)
  preemption (``run``)    Collective, after every step: rank 0 looks for the
                          supervisor's request (``JOBDIR/preempt.request``,
                          supervisor/relaunch_preempt.py) and broadcasts what it saw;
                          on a request rank 0 copies the step just completed to the
                          job directory (``JOBDIR/lightning/JOB``, durable) and every rank
                          exits (:class:`Persisted`). The requeued job restores the
                          newest of the nodes' snapshots and that copy.

DDP replicates the model and optimizer on every rank, so any survivor's copy is the
whole state: a node loss loses no snapshot unless every node is lost.
Uses three private Lightning attributes (``trainer._checkpoint_connector``,
``fit_loop._combined_loader``, ``fit_loop._data_fetcher``); tested with 2.6.
"""

from __future__ import annotations

import dataclasses
import getpass
import io
import os
import socket
import time
from pathlib import Path
from typing import Any, Iterator, Mapping, Sequence

import torch
import torch.distributed as dist
from pytorch_lightning import Callback, LightningModule, Trainer

from ..errors import ConfigError
from ..supervisor.relaunch_preempt import JOB_DIR_VAR, request_path

SNAPSHOT_PREFIX = "step-"


@dataclasses.dataclass(frozen=True, kw_only=True)
class LightningEnv:
    """What the callback reads from the environment, once (``from_env``)."""

    job_id: str | None
    """``SLURM_JOB_ID``: keys the default snapshot directory; without it (and without
    ``directory``) no snapshots are kept: an old run's could be taken for this one's."""
    node: str
    """``SLURMD_NODENAME``, else the host name: the node-local directory's name."""
    progress_file: str | None
    """``SR_PROGRESS_FILE``: set by ``slurm-resilience run`` for each relaunch."""
    root: str | None
    """``SR_LIGHTNING_DIR``: the snapshot root instead of the default (one folder per
    node under it); lets a run without Slurm (torchrun, tests) keep snapshots."""
    user: str
    run_job_dir: str | None = None
    """``SR_RUN_JOB_DIR``: the job directory of a ``slurm-resilience run`` job: its
    preemption request and the durable copy (``JOBDIR/lightning/JOB``) live there."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> "LightningEnv":
        return cls(job_id=env.get("SLURM_JOB_ID") or None,
                   node=env.get("SLURMD_NODENAME") or socket.gethostname(),
                   progress_file=env.get("SR_PROGRESS_FILE") or None,
                   root=env.get("SR_LIGHTNING_DIR") or None,
                   user=getpass.getuser(), run_job_dir=env.get(JOB_DIR_VAR) or None)

    def default_dir(self) -> Path | None:
        if self.root is not None:
            return Path(self.root) / self.node
        if self.job_id is None:
            return None
        return Path(f"/tmp/slurm_resilience-{self.user}/lightning/{self.job_id}/{self.node}")


@dataclasses.dataclass(frozen=True)
class RestorePlan:
    """Where the state comes from: ``step`` -1 means a fresh start (no ``source``);
    ``durable``: rank 0 reads the job directory's copy (``source`` is 0)."""

    step: int
    source: int | None
    durable: bool = False


def plan_restore(newest: Sequence[int], durable: int = -1) -> RestorePlan:
    """Pure: the newest step any rank's node holds (-1: none) and the lowest rank holding
    it; the job directory's copy (``durable``) only when it is newer than every node's
    (a node's disk is the faster read)."""
    if not newest:
        raise ValueError("plan_restore needs one entry per rank")
    step = max(newest)
    if durable > step:
        return RestorePlan(durable, 0, durable=True)
    return RestorePlan(step, None if step < 0 else list(newest).index(step))


def resume_position(epoch: int, processed: int, num_batches: float) -> tuple[int, int]:
    """Pure: (sampler epoch, batches to skip) after a restore from ``on_train_batch_end``.

    ``epoch``/``processed``: the fit loop's epoch and the epoch's processed batches in
    the snapshot. A snapshot of an epoch's last batch resumes at the next epoch's start.
    """
    if processed >= num_batches:
        return epoch + 1, 0
    return epoch, processed


class NodeSnapshots:
    """Snapshots of one node in a directory: ``step-000000012.pt``, written atomically."""

    def __init__(self, directory: Path, keep: int = 2) -> None:
        self.directory = Path(directory)
        self.keep = keep

    def _path(self, step: int) -> Path:
        return self.directory / f"{SNAPSHOT_PREFIX}{step:09d}.pt"

    def steps(self) -> list[int]:
        if not self.directory.is_dir():
            return []
        found = []
        for p in self.directory.iterdir():
            stem = p.name[len(SNAPSHOT_PREFIX):-3]
            if p.name.startswith(SNAPSHOT_PREFIX) and p.name.endswith(".pt") and stem.isdigit():
                found.append(int(stem))
        return sorted(found)

    def newest(self) -> int:
        found = self.steps()
        return found[-1] if found else -1

    def write(self, step: int, state: Any) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self._path(step)
        tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
        torch.save(state, tmp)
        os.replace(tmp, final)
        for old in self.steps()[:-self.keep]:
            self._path(old).unlink(missing_ok=True)

    def read_bytes(self, step: int) -> bytes:
        return self._path(step).read_bytes()


class Persisted(SystemExit):
    """Raised on every rank after a preemption request was carried out: the step just
    completed is in the job directory, the process ends (status 0) and the code after
    ``fit()`` does not run; the requeued job resumes from that step."""


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


class Resilience(Callback):
    """Per-step node-local snapshots, peer restore and exact batch position for a Trainer.

    directory: node-local snapshot directory (default
    ``/tmp/slurm_resilience-USER/lightning/JOB/NODE`` under Slurm; none otherwise).
    every: snapshot every N optimizer steps (1: no completed step is ever redone).
    keep: snapshots kept per node. Raises ``ConfigError`` for every or keep below 1.
    """

    def __init__(self, *, directory: str | os.PathLike | None = None, every: int = 1, keep: int = 2) -> None:
        for name, value in (("every", every), ("keep", keep)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"Resilience({name}={value!r}): must be an integer >= 1")
        self.env = LightningEnv.from_env(os.environ)
        chosen = Path(directory) if directory is not None else self.env.default_dir()
        self.snapshots = NodeSnapshots(chosen, keep) if chosen is not None else None
        run_dir = self.env.run_job_dir
        # keyed by the job id too: a job directory used again by another job never restores this one's
        self.durable = (NodeSnapshots(Path(run_dir) / "lightning" / (self.env.job_id or "local"), keep)
                        if run_dir is not None else None)
        self.every = every
        self.restored: RestorePlan | None = None
        self._skip = 0

    # -- restore ---------------------------------------------------------------
    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Collective: every rank calls it (Lightning's hook); a rank missing hangs in gloo."""
        newest = self.snapshots.newest() if self.snapshots is not None else -1
        durable = self.durable.newest() if self.durable is not None and trainer.global_rank == 0 else -1
        if trainer.world_size > 1:
            gathered: list[Any] = [None] * trainer.world_size
            dist.all_gather_object(gathered, (newest, durable))
        else:
            gathered = [(newest, durable)]
        plan = plan_restore([int(s) for s, _ in gathered], durable=int(gathered[0][1]))
        self.restored = plan
        if plan.source is None:
            return
        mine = trainer.global_rank == plan.source
        blob = [(self.durable if plan.durable else self.snapshots).read_bytes(plan.step) if mine else None]
        if trainer.world_size > 1:
            dist.broadcast_object_list(blob, src=plan.source)
        checkpoint = torch.load(io.BytesIO(blob[0]), weights_only=False)
        connector = trainer._checkpoint_connector
        connector._loaded_checkpoint = checkpoint  # restore_training_state() takes loops/optimizers next
        connector.restore_model()
        connector.restore_datamodule()
        connector.restore_callbacks()
        if trainer.global_rank == 0:
            where = "the job directory (durable copy)" if plan.durable else f"rank {plan.source}'s node"
            print(f"slurm_resilience: restored step {plan.step} from {where} "
                  f"(gathered {[s for s, _ in gathered]}, durable {gathered[0][1]})", flush=True)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._static_buckets(trainer)
        if self.restored is None or self.restored.source is None or trainer.fit_loop._combined_loader is None:
            return
        loop = trainer.fit_loop
        epoch, skip = resume_position(loop.epoch_progress.current.processed,
                                      loop.epoch_loop.batch_progress.current.processed,
                                      trainer.num_training_batches)
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
        if self.snapshots is not None and step % self.every == 0 and trainer.local_rank == 0:
            self.snapshots.write(step, trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
        if trainer.global_rank == 0 and self.env.progress_file:
            with open(self.env.progress_file, "a") as f:
                f.write(f"{step} {time.time():.6f}\n")
        if self.durable is not None and self._preempt_requested(trainer):
            if trainer.global_rank == 0:
                self.durable.write(step, trainer._checkpoint_connector.dump_checkpoint(weights_only=False))
                print(f"slurm_resilience: preempted: step {step} persisted to {self.durable.directory}", flush=True)
            trainer.strategy.barrier("slurm_resilience.persisted")  # no rank ends before the copy is whole
            raise Persisted(0)

    def _preempt_requested(self, trainer: Trainer) -> bool:
        """Collective: rank 0's answer (does the supervisor's request exist?) on every rank, so
        that all stop after the same step. One stat and one 1-element broadcast per step."""
        asked = trainer.global_rank == 0 and os.path.exists(request_path(self.env.run_job_dir))
        if trainer.world_size > 1:
            flag = torch.tensor([int(asked)], device=trainer.strategy.root_device)
            dist.broadcast(flag, src=0)
            asked = bool(flag.item())
        return asked
