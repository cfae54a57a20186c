"""How a rank's part in the job ends: finished, persisted (preemption) or aborted.

Finishing returns normally (the code after the ``with Session()`` block runs);
persisting and aborting raise :class:`~slurm_resilience.errors.JobEnded`, which
``Session.__exit__`` turns into the process's exit status.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import sys
from typing import Any, Callable, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from ..errors import JobEnded
from ..files import write_private
from ..protocol import Plan, StoreKey, WorkerEnv, WorkerEvent
from .membership import EXIT_ABORTED, EXIT_OK
from .reconnect import Generation
from .statesync import TrainingState


__all__ = ["Endings", "state_digest", "save_private"]


log = logging.getLogger(__name__)


class Endings:
    """The three ways out, sharing the state, the checkpoint engine and the event sink."""

    def __init__(self, env: WorkerEnv, state: TrainingState, checkpoints, store: dist.Store, *,
                 emit: Callable[..., None], drain_s: float) -> None:
        self._env = env
        self._state = state
        self._checkpoints = checkpoints
        self._store = store
        self._emit = emit
        self._drain_s = drain_s

    def finish(self, group: Generation) -> None:
        """Every rank passed the final barrier: report done first, then drain the writer.
        (Done first, because a peer that has already exited cannot take part in a
        checkpoint still in flight, and a fault seen while we drain must not start a
        recovery that needs that peer.)"""
        st = self._state
        state = st.state_dict()
        if group.rank == 0:
            save_private(state, os.path.join(self._env.job_dir, "final.pt"))
        self._store.set(StoreKey.DONE.of(group.rank), str(st.step))
        # every rank's final state is checkable, not only rank 0's (one digest per rank) over
        # what training produced: not Python's and NumPy's global RNGs, which user code seeds
        # (or not) as it likes — the toolkit restores them but cannot make them agree across runs
        trained = {k: state[k] for k in ("step", "position", "objects", "extras")}
        trained["torch_rng"] = state["rng"]["torch"]
        self._emit(WorkerEvent.DONE, step=st.step, digest=state_digest(trained))
        if not self._checkpoints.wait(timeout=self._drain_s):
            log.warning("rank %d: checkpoints still in flight at exit were abandoned", group.rank)

    def persist(self) -> NoReturn:
        """PERSIST generation: every rank now holds the same (newest) step; write every
        disk tier (collective, through the writer's transfer group) and end with exit 0."""
        st = self._state
        disk = [s.name for s in self._checkpoints.specs if s.storage != "memory"]
        self._checkpoints.wait()  # earlier writes finish or are abandoned (a newer plan exists)
        committed = False
        if disk:
            before = len(self._checkpoints.failures)
            self._checkpoints.save(st.step, st.state_dict(), disk)
            self._checkpoints.wait()
            committed = len(self._checkpoints.failures) == before
        self._emit(WorkerEvent.PERSISTED, step=st.step, position=st.position, tiers=disk, committed=committed)
        raise JobEnded(EXIT_OK, f"persisted step {st.step} for the requeued job")

    def abort(self, plan: Plan, rank: int | None) -> NoReturn:
        """Persist this rank's state durably in the job directory, then end with EXIT_ABORTED.

        ``rank``: this worker's rank in its last generation (None: it never had one)."""
        st = self._state
        where = None
        if st.live and st.objects and rank is not None:
            where = os.path.join(self._env.job_dir, "snapshots", f"rank{rank}-step{st.step:08d}.pt")
            save_private(st.state_dict(), where)
        self._emit(WorkerEvent.ABORTED, step=st.step, path=where)
        print(f"slurm_resilience: job aborted: {plan.reason}; state at step {st.step} kept in {where}",
              file=sys.stderr)
        raise JobEnded(EXIT_ABORTED, f"aborted: {plan.reason}")


def state_digest(state: Any) -> str:
    """SHA-256 over a state tree: tensors and arrays by dtype, shape and bytes (numpy's
    repr would elide a long RNG state); other values by repr; dict keys sorted. Equal
    digests mean bit-identical states."""
    h = hashlib.sha256()

    def walk(x: Any) -> None:
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")  # 0-dim too
        elif isinstance(x, np.ndarray):
            h.update(f"A{x.dtype}{x.shape}".encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    walk(state)
    return h.hexdigest()


def save_private(state: dict[str, Any], path: str) -> None:
    """torch.save to a file only this user can read (it holds the job's training state)."""
    buf = io.BytesIO()
    torch.save(state, buf)
    write_private(path, buf.getvalue())
