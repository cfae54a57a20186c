"""Hugging Face Accelerate: job-level recovery for an ``Accelerator`` loop (docs/accelerate.md).

    res = Resilience(accelerator, model)   # after accelerator.prepare(...): the DDP model
    res.restore()                          # Collective: the newest snapshot, if any
    for epoch in res.epochs(num_epochs):
        for batch in res.batches(loader):  # the epoch set, the completed batches skipped
            ...; optimizer.step(); optimizer.zero_grad()
            res.step_done()                # Collective: snapshot, progress, preemption

launched with ``slurm-resilience run`` (relaunch mode, warm spares) or ``submit``.
Accelerate's own checkpoint is the snapshot's content, through its own hooks:

  every ``every`` steps   ``accelerator.save_state`` into a node-local staging folder
                          (``save_on_each_node``: the local main process of each node
                          writes model, optimizers, schedulers and the registered
                          objects, every rank its RNG file); the ranks all-gather their
                          RNG files, so that every node's snapshot holds every rank's
                          (``rng.py``); the node's local main packs
                          the folder into one file, ``step-000000012.pt`` (atomic,
                          newest ``keep`` kept, ``snapshots.NodeSnapshots``); rank 0
                          appends ``STEP UNIX_TIME`` to ``SR_PROGRESS_FILE``
  data position           a :class:`Position` (epoch, next batch, step) is registered
                          with ``accelerator.register_for_checkpointing``: it travels
                          in every snapshot; the resumed epoch skips its completed
                          batches with ``accelerator.skip_first_batches`` (index level)
  restore                 Collective: every rank says the newest step its node holds
                          (rank 0 also the job directory's durable copy); the newest
                          wins, its holder broadcasts the file over the process group,
                          every rank unpacks it into a private folder and calls
                          ``accelerator.load_state`` on it. A spare's ranks get the
                          state from a survivor, no shared file system needed
  preemption (``run``)    after every step rank 0 looks for the supervisor's request
                          and broadcasts what it saw; on a request rank 0 writes the
                          step to ``JOBDIR/accelerate/JOB`` and every rank exits
                          (``Persisted``); the requeued job restores it

Job level only: Accelerate builds its process group once per process
(``PartialState``, a singleton) and wraps the model in DDP on that group in
``prepare``; it has no supported way to abort a collective stuck on a dead peer and
re-form the group in a live process, so survivors are relaunched (warm zygotes) and
resume from the snapshot. DDP's bucket layout of the models handed to ``Resilience`` is
fixed from parameter order before the first backward (``worker/rebind.static_buckets``),
as for Lightning, so a relaunched step sums gradients in the fault-free run's order.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from accelerate import Accelerator
from accelerate.utils.constants import RNG_STATE_NAME

from ..errors import ConfigError
from . import rng
from .snapshots import (
    NodeSnapshots, Persisted, RestorePlan, SnapshotEnv, check_counts, fetch_snapshot, gather_newest,
    preempt_requested)


__all__ = ["EPOCH_RNG_NAME", "AccelerateEnv", "Position", "pack", "unpack", "Resilience"]


EPOCH_RNG_NAME = "slurm_resilience_epoch_rng.pkl"
"""The snapshot's entry with every rank's generators as they were before its epoch's loader
iterator (by global rank): a restore remakes the iterator from them."""


class AccelerateEnv(SnapshotEnv):
    """Snapshots under ``/tmp/slurm_resilience-USER/accelerate/JOB/NODE``, root ``SR_ACCELERATE_DIR``."""

    KIND = "accelerate"


class Position:
    """Where the data stands after the last completed step: ``epoch``, the epoch's next
    ``batch``, the optimizer ``step`` count. Saved and loaded by Accelerate with the state."""

    def __init__(self) -> None:
        self.epoch = self.batch = self.step = 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch": self.batch, "step": self.step}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch, self.step = int(state["epoch"]), int(state["batch"]), int(state["step"])

    def advance(self, num_batches: int) -> None:
        """Pure: one step done; past the epoch's last batch the next epoch starts."""
        self.step += 1
        self.batch += 1
        if self.batch >= num_batches:
            self.epoch, self.batch = self.epoch + 1, 0


def pack(folder: Path) -> dict[str, bytes]:
    """A ``save_state`` folder as one picklable dict (relative path → bytes)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def unpack(files: dict[str, bytes], folder: Path) -> None:
    """Inverse of :func:`pack`. Raises ``ValueError`` for a path leaving ``folder``."""
    for name, data in files.items():
        target = (folder / name).resolve()
        if not target.is_relative_to(folder.resolve()):
            raise ValueError(f"snapshot entry {name!r} leaves its folder")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)


class Resilience:
    """Per-step node-local snapshots, peer restore and exact data position for an Accelerator.

    accelerator: the ``Accelerator``, after ``prepare``.
    models: the models ``prepare`` returned (DDP-wrapped): their bucket layout is fixed now.
    Accelerate keeps the unwrapped model (``accelerator._models`` on CPU), so the wrapper
    must be handed over; without it a relaunch ends a few ulps off the fault-free run.
    directory: node-local snapshot directory (default
    ``/tmp/slurm_resilience-USER/accelerate/JOB/NODE`` under Slurm; none otherwise).
    every: snapshot every N optimizer steps (1: no completed step is ever redone).
    keep: snapshots kept per node.

    Raises:
        ConfigError: every or keep below 1, ``accelerator`` not an ``Accelerator``, a
            model that is not a ``torch.nn.Module``.
    """

    def __init__(self, accelerator: Accelerator, *models: torch.nn.Module,
                 directory: str | os.PathLike | None = None, every: int = 1, keep: int = 2) -> None:
        check_counts("Resilience", every=every, keep=keep)
        if not isinstance(accelerator, Accelerator):
            raise ConfigError(f"Resilience(accelerator=…): needs an accelerate.Accelerator, got "
                              f"{type(accelerator).__name__}")
        for model in models:
            if not isinstance(model, torch.nn.Module):
                raise ConfigError(f"Resilience(accelerator, model): the model must be the torch.nn.Module that "
                                  f"accelerator.prepare returned, got {type(model).__name__}")
        self.acc, self.every = accelerator, every
        self.env = AccelerateEnv.from_env(os.environ)
        chosen = Path(directory) if directory is not None else self.env.default_dir()
        self.snapshots = NodeSnapshots(chosen, keep) if chosen is not None else None
        durable = self.env.durable_dir()
        self.durable = NodeSnapshots(durable, keep) if durable is not None else None
        accelerator.project_configuration.save_on_each_node = True  # each node's disk holds the whole state
        self.position = Position()
        accelerator.register_for_checkpointing(self.position)
        self.restored: RestorePlan | None = None
        self._num_batches = 0
        self._epoch_rng: dict[str, Any] | None = None  # the generators before this epoch's loader iterator
        self._resume: tuple[dict[str, Any], Any] | None = None  # restored (step, epoch) generators, this rank
        self._static_buckets(models)

    @staticmethod
    def _static_buckets(models) -> None:
        from torch.nn.parallel import DistributedDataParallel

        from ..worker.rebind import static_buckets

        for model in models:
            if isinstance(model, DistributedDataParallel):
                static_buckets(model)

    @property
    def _where(self) -> dict[str, int]:
        return {"rank": self.acc.process_index, "world_size": self.acc.num_processes}

    # -- restore ---------------------------------------------------------------
    def restore(self) -> int:
        """Collective: load the newest snapshot any node (or the job directory) holds;
        returns the step it restored (0: a fresh start). A rank missing hangs."""
        plan, steps, kept = gather_newest(self.snapshots, self.durable, **self._where)
        self.restored = plan
        if plan.source is None:
            return 0
        files = torch.load(io.BytesIO(fetch_snapshot(plan, self.snapshots, self.durable, **self._where)),
                           weights_only=False)
        with tempfile.TemporaryDirectory(prefix="sr-accelerate-") as folder:
            unpack(files, Path(folder))
            self.acc.load_state(folder)  # model, optimizers, schedulers, RNG (its own file), Position
            epochs = Path(folder) / EPOCH_RNG_NAME
            self._resume = (rng.capture(), rng.own(pickle.loads(epochs.read_bytes()) if epochs.exists() else None,
                                                   **self._where))
        if self.acc.is_main_process:
            where = "the job directory (durable copy)" if plan.durable else f"rank {plan.source}'s node"
            print(f"slurm_resilience: restored step {plan.step} from {where} (gathered {steps}, durable {kept}); "
                  f"epoch {self.position.epoch} batch {self.position.batch}", flush=True)
        return self.position.step

    # -- the loop --------------------------------------------------------------
    def epochs(self, total: int) -> Iterator[int]:
        """The epochs still to train: from the restored one to ``total - 1``."""
        for epoch in range(self.position.epoch, total):
            if self.position.epoch != epoch:  # a break or a missing step_done() left it behind
                self.position.epoch, self.position.batch = epoch, 0
            yield epoch

    def batches(self, loader: Iterable[Any]) -> Iterator[Any]:
        """The epoch's batches from the next one to train: the loader's epoch is set (its
        sampler reshuffles by seed and epoch) and the completed batches are skipped."""
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(self.position.epoch)
        self._num_batches = len(loader)
        skip = self.position.batch
        saved, self._resume = self._resume, None
        if saved is not None:  # the iterator draws its workers' seed as the epoch's first one did
            self._epoch_rng = saved[1] if skip and saved[1] is not None else saved[0]
            rng.apply(self._epoch_rng)
        else:
            self._epoch_rng = rng.capture()
        batches = iter(self.acc.skip_first_batches(loader, skip) if skip else loader)
        first = next(batches, None)  # the loader's iterator is made (and its seed drawn) here
        if saved is not None and skip:
            rng.apply(saved[0])  # mid-epoch: each rank's generators as the snapshot's step left them
        if first is None:
            return
        yield first
        yield from batches

    def step_done(self) -> None:
        """Collective, after the optimizer step: snapshot every ``every`` steps (a barrier),
        the progress line, and under ``run`` the preemption check (Raises ``Persisted``)."""
        self.position.advance(self._num_batches)
        step = self.position.step
        if not self.acc.sync_gradients:
            return  # inside an accumulation window (accelerator.accumulate): its grads are in no snapshot
        files = self._pack(step) if self.snapshots is not None and step % self.every == 0 else None
        if files is not None:
            self.snapshots.write(step, files)
        if self.acc.is_main_process and self.env.progress_file:
            with open(self.env.progress_file, "a") as f:
                f.write(f"{step} {time.time():.6f}\n")
        if preempt_requested(self.env.run_job_dir, device=self.acc.device, **self._where):
            files = files if files is not None else self._pack(step)
            if self.acc.is_main_process:
                self.durable.write(step, files)
                print(f"slurm_resilience: preempted: step {step} persisted to {self.durable.directory}", flush=True)
            self.acc.wait_for_everyone()  # no rank ends before the copy is whole
            raise Persisted(0)

    def _pack(self, step: int) -> dict[str, bytes] | None:
        """Collective: ``save_state`` into a staging folder on this node; the node's local
        main process gets the packed files (every other rank None)."""
        base = self.snapshots.directory if self.snapshots is not None else Path(tempfile.gettempdir())
        staging = base / f".staging-{step:09d}-{self.env.job_id or 'local'}"
        self.acc.save_state(str(staging))
        self.acc.wait_for_everyone()  # every rank's RNG file is in
        own = {p.name: p.read_bytes() for p in staging.glob(f"{RNG_STATE_NAME}_{self.acc.process_index}.pkl")}
        everyone = rng.gather((own, self._epoch_rng), **self._where)  # every node's snapshot: every rank's
        if not self.acc.is_local_main_process:
            return None
        files = pack(staging)
        for entry, _ in everyone:
            files.update(entry)
        files[EPOCH_RNG_NAME] = pickle.dumps([epoch for _, epoch in everyone])
        shutil.rmtree(staging, ignore_errors=True)
        return files
