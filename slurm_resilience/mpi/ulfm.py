"""A rank's side of an MPI job repaired in place (ULFM): the mpi4py counterpart of
the torch ``Session``.

Launched with ``mpirun --with-ft ulfm`` (``mpi/launch.py``), the world holds the
active ranks first and the spares last. The program trains on ``session.comm`` (the
working communicator, active ranks only); spares park. When an MPI call raises
``ERR_PROC_FAILED``/``ERR_REVOKED``, every surviving process repairs::

    Revoke (working comm and world) -> Shrink (world) -> allgather who is where
      -> plan_repair (pure: spares take the lost numbers, else scale-in)
      -> Split keyed by the new rank (survivors keep theirs)
      -> restore: survivors from their own copy, replacements from the buddy's copy,
         of the last step every survivor committed -> Agree (all made it)

A failure during any of that starts the repair again from the smaller world. No
process is started: the spare *is* the replacement. ``close()`` ends every process
with a barrier then ``os._exit``, because ``MPI_Finalize`` can hang after a repair
(open-mpi/ompi#11404).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from typing import Any, Callable, Mapping

import numpy as np

from ..files import makedirs_private
from .beat import BEAT_ENV, Beat, beat_path
from .errors import StateLostError, UlfmUnavailableError
from .lifecycle import Phase, transition
from .plan import SPARE, Member, RepairPlan, buddy, buddy_source, plan_repair
from .snapshot import Layout

__all__ = ["require_ulfm", "Session"]

TAG_PARK = 7101
TAG_BUDDY = 7102
TAG_RESTORE = 7103
_TRUE = {"1", "true", "yes", "on", "enabled"}


def require_ulfm(environ: Mapping[str, str], mpi: Any) -> None:
    """Raise UlfmUnavailableError unless this process can repair communicators.

    mpi4py degrades silently on an MPI without ULFM (Shrink becomes Dup, Agree an
    Allreduce), so the launcher's switch is checked, not the presence of the calls.
    """
    if not hasattr(mpi.Comm, "Shrink") or not hasattr(mpi, "ERR_PROC_FAILED"):
        raise UlfmUnavailableError("mpi4py has no ULFM calls (Comm.Shrink): install mpi4py>=4 "
                                   "(pip install 'slurm-resilience[ulfm]')")
    if environ.get("OMPI_MCA_mpi_ft_enable", "").strip().lower() not in _TRUE:
        raise UlfmUnavailableError("ULFM is not enabled in this process (OMPI_MCA_mpi_ft_enable "
                                   "unset): launch with the bundled `mpirun --with-ft ulfm` "
                                   "(docs/mpi-ulfm.md)")


class Session:
    """Collective (over ``COMM_WORLD``): a rank of a job whose communicator is repaired
    in place. Every process, spares included, constructs it with the same ``state``
    names, shapes and dtypes; a missing process blocks the constructor.

    Args:
        state: name -> numpy array or CPU torch tensor, updated in place by the
            program; copied at every step to the rank's buddy and restored in place.
        spares: how many of the world's last ranks park as spares; None: ``SR_ULFM_SPARES``
            (set by the launchers), else 0.
        per_node: ranks per node (buddy distance); default: Open MPI's local size of
            world rank 0.
        events: a directory where each process appends its events
            (``events-w{world rank}.jsonl``, 0600); None: ``SR_ULFM_EVENTS`` (set by
            ``run --mpi``), else no events.
        observer: called as ``observer(kind, record)`` for every event, after it is
            written (a program's own timeline, or a test's fault injector).

    Raises:
        UlfmUnavailableError: not launched with ``--with-ft ulfm`` or mpi4py < 4.
        ValueError: ``spares`` leaves no active rank.
    """

    def __init__(self, state: Mapping[str, Any], *, spares: int | None = None, per_node: int | None = None,
                 events: str | None = None, environ: Mapping[str, str] | None = None,
                 observer: Callable[[str, dict[str, Any]], None] | None = None) -> None:
        from mpi4py import MPI

        env = os.environ if environ is None else environ
        require_ulfm(env, MPI)
        if spares is None:
            spares = int(env.get("SR_ULFM_SPARES", "0") or 0)
        if events is None:
            events = env.get("SR_ULFM_EVENTS") or None
        self._MPI = MPI
        self._world = MPI.COMM_WORLD.Dup()
        self._world.Set_errhandler(MPI.ERRORS_RETURN)
        self.wid = self._world.Get_rank()
        wsize = self._world.Get_size()
        if not 0 <= spares < wsize:
            raise ValueError(f"spares={spares} leaves no active rank in a world of {wsize}")
        local = per_node if per_node is not None else int(env.get("OMPI_COMM_WORLD_LOCAL_SIZE", "1"))
        self.per_node = max(1, int(self._world.bcast(local, root=0)))
        self.size = wsize - spares
        self.rank = self.wid if self.wid < self.size else SPARE
        self._spare_ranks = list(range(self.size, wsize))  # parked spares' ranks in self._world
        self._layout = Layout(state)
        sigs = set(self._world.allgather(self._layout.signature()))
        if len(sigs) != 1:
            raise ValueError(f"the registered state differs between processes: {sorted(sigs)}")
        self.comm = self._world.Split(0 if self.rank != SPARE else MPI.UNDEFINED, key=self.wid)
        self.phase = Phase.PARKED if self.rank == SPARE else Phase.ACTIVE
        self.step = 0
        self.committed = -1
        self.repairs: list[dict[str, Any]] = []
        self._own: dict[int, np.ndarray] = {}
        self._held: dict[int, np.ndarray] = {}
        self._events = None
        self._beat: Beat | None = None
        self._observer = observer
        if events:
            makedirs_private(events)
            path = os.path.join(events, f"events-w{self.wid}.jsonl")
            self._events = open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600), "a")
        beat_s = float(env.get(BEAT_ENV, "0") or 0)  # set by run --mpi (mpi/beat.py)
        self._beat = Beat(beat_path(events, self.wid), beat_s) if events and beat_s > 0 else None
        self._fault_t: float | None = None
        self._plan_errors = 0
        self.event("start", rank=self.rank, size=self.size, spares=spares, pid=os.getpid(),
                   node=env.get("SLURMD_NODENAME") or MPI.Get_processor_name())

    # -- the program's loop ------------------------------------------------------------

    @property
    def is_spare(self) -> bool:
        """True while this process is a parked spare (it has no working communicator)."""
        return self.rank == SPARE

    def run(self, step_fn: Callable[[Any, int], None], steps: int) -> None:
        """Collective (over the world): run ``step_fn(comm, step)`` for steps
        ``self.step .. steps-1`` on the working communicator, repairing on faults.

        A spare parks here until it takes a lost rank (then it trains) or the job ends.
        ``step_fn`` must change nothing but the registered state (and what derives from
        it): after a fault the state and ``self.step`` are rolled back and the step is
        done again. Returns when every active rank completed ``steps``.
        """
        while True:
            try:
                if self.phase is Phase.PARKED:
                    if self._park():
                        break
                    continue
                if self.committed < self.step:
                    self._commit(self.step)
                if self.step >= steps:
                    self.comm.Barrier()  # every active rank is done: no step left to redo
                    self._release_spares()
                    break
                step_fn(self.comm, self.step)
                self._commit(self.step + 1)
                self.step += 1
                if self._fault_t is not None:
                    self.event("first_step", step=self.step, since_fault_s=time.time() - self._fault_t)
                    self._fault_t = None
            except self._MPI.Exception as exc:
                if not self._is_fault(exc):
                    self._abandon(exc)
                self._repair(exc)
            except Exception as exc:  # the program's own error, or state lost for good
                self._abandon(exc)
        self.phase = transition(self.phase, Phase.DONE)
        self.event("done", step=self.step)

    def _abandon(self, exc: BaseException) -> None:
        """End this process at once on an error the repair cannot mend: its traceback to
        stderr, the communicators revoked so the others learn of it, then ``os._exit(1)``
        (a normal exit runs MPI_Finalize, which waits for peers that never come)."""
        traceback.print_exception(exc)
        self.event("abandon", error=f"{type(exc).__name__}: {exc}")
        for c in (self.comm, self._world):
            if c != self._MPI.COMM_NULL:
                try:
                    c.Revoke()
                except self._MPI.Exception as again:
                    self.event("revoke_failed", error=str(again))
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)

    def close(self, code: int = 0) -> None:
        """Collective (over the world): a barrier, then end the process with ``code``
        (``os._exit``: ``MPI_Finalize`` may hang after a repair). A process that died
        meanwhile makes the barrier fail; the process then ends all the same."""
        try:
            self._world.Barrier()
        except self._MPI.Exception as exc:
            self.event("close_barrier_failed", error=str(exc))
        self.event("exit", code=code)
        if self._events is not None:
            self._events.close()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)

    def event(self, kind: str, **fields: Any) -> None:
        """Append one event (``{"t", "kind", "wid", "rank", ...}``) to this process's file."""
        rec = {"t": time.time(), "kind": kind, "wid": self.wid, "rank": self.rank, **fields}
        if self._events is not None:
            self._events.write(json.dumps(rec) + "\n")
            self._events.flush()
        if self._observer is not None:
            self._observer(kind, rec)

    # -- steps -------------------------------------------------------------------------

    def _is_fault(self, exc: Any) -> bool:
        MPI = self._MPI
        return exc.Get_error_class() in (MPI.ERR_PROC_FAILED, MPI.ERR_PROC_FAILED_PENDING,
                                         MPI.ERR_REVOKED)

    def _commit(self, step: int) -> None:
        """Collective (working comm): copy the state to the buddy, keep two steps."""
        buf = self._layout.pack()
        held = np.empty_like(buf)
        if self.size > 1:
            self.comm.Sendrecv(buf, dest=buddy(self.rank, self.size, self.per_node), sendtag=TAG_BUDDY,
                               recvbuf=held, source=buddy_source(self.rank, self.size, self.per_node),
                               recvtag=TAG_BUDDY)
        else:
            held[:] = buf
        self._own[step], self._held[step] = buf, held
        for d in (self._own, self._held):
            for s in [s for s in d if s < step - 1]:
                del d[s]
        self.committed = step

    def _park(self) -> bool:
        """A spare waits for the end (True) or a fault, which raises out of the receive."""
        msg = self._world.recv(source=self._MPI.ANY_SOURCE, tag=TAG_PARK)
        return msg == "done"

    def _release_spares(self) -> None:
        if self.rank != 0:
            return
        for r in self._spare_ranks:
            self._world.send("done", dest=r, tag=TAG_PARK)

    # -- repair ------------------------------------------------------------------------

    def _repair(self, exc: Any) -> None:
        """Collective (every surviving process): repair until one attempt completes."""
        t0 = time.time()
        if self._fault_t is None:
            self._fault_t = t0
        before = self.phase
        self.phase = transition(self.phase, Phase.REPAIRING)
        self.event("fault", error=exc.Get_error_string(), step=self.step, phase=before.name)
        attempt = 0
        while True:
            attempt += 1
            try:
                plan = self._repair_once()
                break
            except self._MPI.Exception as again:
                if not self._is_fault(again):
                    raise
                self.event("repair_restart", attempt=attempt, error=again.Get_error_string())
        ms = (time.time() - t0) * 1000
        record = {"attempts": attempt, "lost": list(plan.lost), "scaled_in": list(plan.scaled_in),
                  "promoted": {str(k): v for k, v in plan.promoted.items()}, "step": plan.step,
                  "size": plan.size, "ms": round(ms, 3)}
        self.repairs.append(record)
        self.event("repaired", **record)

    def _repair_once(self) -> RepairPlan:
        MPI = self._MPI
        for c in (self.comm, self._world):
            if c != MPI.COMM_NULL:
                c.Revoke()
        shrunk = self._world.Shrink()
        shrunk.Set_errhandler(MPI.ERRORS_RETURN)
        self._world = shrunk  # a failure from here on shrinks this one again
        self.event("shrunk", world=shrunk.Get_size())
        mine = np.array([self.wid, self.rank, self.committed], dtype=np.int64)
        gathered = np.empty((shrunk.Get_size(), 3), dtype=np.int64)
        shrunk.Allgather(mine, gathered)  # numbers, not pickles: a torn gather must not raise
        members = [Member(*(int(v) for v in row)) for row in gathered]
        self.event("gathered", members=len(members))
        try:
            plan = plan_repair(members, self.size, self.per_node)
        except (ValueError, StateLostError) as exc:
            # A peer lost during the gather can leave it torn (ULFM only promises the
            # Agree): restart on that; the same verdict twice in a row is the truth.
            self._plan_errors += 1
            if self._plan_errors >= 3:
                raise
            self.event("plan_error", error=str(exc))
            shrunk.Revoke()
            raise self._MPI.Exception(self._MPI.ERR_REVOKED) from exc
        self._plan_errors = 0
        new_rank = plan.rank_of(self.wid)
        comm = shrunk.Split(0 if new_rank != SPARE else MPI.UNDEFINED, key=max(new_rank, 0))
        if comm != MPI.COMM_NULL:
            comm.Set_errhandler(MPI.ERRORS_RETURN)
            restored = self._restore(comm, plan, new_rank)
        shrunk.Agree(1)  # raises on every process if one was lost during the repair
        self.comm, self.rank, self.size = comm, new_rank, plan.size
        # their ranks in the shrunk world (the gather's row order), not their first world ranks
        self._spare_ranks = [i for i, m in enumerate(members) if plan.rank_of(m.wid) == SPARE]
        if new_rank == SPARE:
            self.phase = transition(self.phase, Phase.PARKED)
            return plan
        self._layout.unpack_into(restored)
        self.step = max(plan.step, 0)
        self._own, self._held = {}, {}
        self.committed = -1  # the loop commits self.step again on the new communicator
        self.phase = transition(self.phase, Phase.ACTIVE)
        return plan

    def _restore(self, comm: Any, plan: RepairPlan, new_rank: int) -> np.ndarray:
        """Collective (new working comm): this rank's state of the rollback step, from its
        own copy or, for a promoted spare, from the buddy that holds the lost rank's."""
        step = plan.step
        if step < 0:  # nobody committed the first step: everyone holds the initial state
            return self._layout.pack()
        reqs = []
        for dst, src in sorted(plan.sources.items()):
            if src == new_rank:
                reqs.append(comm.Isend(self._held[step], dest=dst, tag=TAG_RESTORE))
        if new_rank in plan.sources:
            buf = np.empty(self._layout.nbytes, dtype=np.uint8)
            comm.Recv(buf, source=plan.sources[new_rank], tag=TAG_RESTORE)
        else:
            buf = self._own[step]
        self._MPI.Request.Waitall(reqs)
        return buf
