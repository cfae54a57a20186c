"""The safe point: what happens when a step completes, in this order.

1. step, data position and heartbeat advance (the state is that of a completed
   optimizer step, the rollback point moves);
2. the first step after a restore is reported (it ends the recovery's MTTR);
3. the checkpoint tiers due at this step are saved (every rank agrees on them);
4. a preemption signal received during the step becomes a persist request;
5. a newer plan means: stop here and re-form (fencing included).
"""

from __future__ import annotations

import signal
import threading

import torch
import torch.distributed as dist

from ..protocol import StoreKey, WorkerEvent
from . import replay
from .reconnect import Generation
from .statesync import TrainingState


__all__ = ["SafePoint"]


class SafePoint:
    """Completes steps for the training loop; ``complete`` says when to re-form."""

    def __init__(self, state: TrainingState, checkpoints, store: dist.Store, *, emit, heartbeat,
                 job_dir: str = "") -> None:
        self._state = state
        self._job_dir = job_dir
        self._checkpoints = checkpoints
        self._store = store
        self._emit = emit
        self._hb = heartbeat
        self._first_step_pending = False
        self._preempted = False  # set by the signal handler, read at the next safe point

    def install_preempt_handler(self, signum: signal.Signals | None) -> None:
        """A preemption signal sent to the job steps (submitit's --signal without B:) is
        turned into a checkpoint-and-requeue request at the next safe point. Only the
        main thread may install handlers; elsewhere (tests) this does nothing."""
        if signum is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signum, self._on_preempt)

    def _on_preempt(self, signum, frame) -> None:
        # A plain flag: a handler that took a lock could deadlock the interrupted thread.
        self._preempted = True

    def restored(self) -> None:
        """The state was (re)adopted: the next completed step is the first after a restore."""
        self._first_step_pending = True

    def complete(self, consumed: int, group: Generation, newer_plan) -> bool:
        """Collective: complete the step that consumed ``consumed`` samples (every rank
        agrees on the checkpoint tiers due when an interval is time-based).

        Returns True when a newer plan exists (``newer_plan()``): the caller stops here
        and joins it. Raises StepAborted when a fault interrupts the agreement; the
        step stays completed (its update was applied on every rank)."""
        st = self._state
        st.step += 1
        st.position += consumed
        self._hb.update(step=st.step)
        if st.step > st.high_water:  # a new step for the job (not a replay)
            st.high_water = st.step
            if group.rank == replay.logger_rank(group.world_size) and self._job_dir:
                replay.write_mark(self._job_dir, st.step)
        if self._first_step_pending:
            self._first_step_pending = False
            self._emit(WorkerEvent.FIRST_STEP, step=st.step)
        self._checkpoint(group)
        if self._preempted:  # ask the supervisor for a PERSIST generation (then requeue)
            self._preempted = False
            self._store.set(StoreKey.PERSIST_REQUEST.value, str(st.step))
        return newer_plan()

    def _checkpoint(self, group: Generation) -> None:
        """Save to the tiers due at this step (blocking only for L0)."""
        tiers = self._checkpoints.due(self._state.step)
        if self._checkpoints.needs_agreement:  # time/auto intervals: every rank must agree
            names = [s.name for s in self._checkpoints.specs]
            flags = torch.tensor([1 if n in tiers else 0 for n in names], dtype=torch.int64)
            group.all_reduce_sum(flags)
            tiers = [n for n, f in zip(names, flags.tolist()) if f]
        if tiers:
            self._checkpoints.save(self._state.step, self._state.state_dict(), tiers)
