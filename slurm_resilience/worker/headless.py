"""A rank that lost the batch host: persist the newest state, requeue the job.

In the single-allocation layout the batch step (``supervisor/executors/keeper.py``) hosts the
job's store and runs the supervisor. When its node is lost, Slurm (``--no-kill``)
keeps the job RUNNING and the worker steps training, headless, until the time limit.
The ranks notice it themselves: every request to the store fails (a closed or reset
connection). A rank whose store has been gone for ``detect.headless_timeout_s``

1. stops at its next store check (a safe point, a collective's wait slice, or a
   plan wait) — its state is that of its last completed step;
2. writes that state as its own shard of the shared tier (L2), ``step-S/rank-R.h5``,
   atomically, and commits the step with a manifest that lists only shards already
   renamed into place (:func:`manifest_ranks`): replicated state needs one complete
   replica, sharded state every rank's shard of the same step, so a half-written set
   is never committed. A step that already has a manifest (a regular checkpoint) is
   left alone;
3. marks itself persisted (``JOBDIR/headless/r{restarts}-rank{R}``) and waits for its
   turn to requeue (:func:`requeue_turn`): rank 0 once every rank has persisted or
   after ``SETTLE_S``; rank R > 0 only ``R × STAGGER_S`` later, in case rank 0 is gone;
4. the rank whose turn it is asks Slurm whether this run is still the one running
   (:func:`should_requeue`: not requeued already), marks the lost batch host DOWN
   (:func:`batch_host_mark`) and runs ``scontrol requeue``, excluding that host
   (``commands.requeue_excluding``). A het job's component 0 (the lost host's) is
   requeued by Slurm itself once the host is DOWN: the rank then only sets the
   exclusion on component 0 (:func:`requeue_step`, :func:`exclusion`).

The requeued job restores the newest valid checkpoint as any requeued job does
(``statesync``): a headless shard of step S is a replica like any other L2 shard.
No collective is used: the store (rendezvous, plans) is gone, and the ranks may sit
one step apart, so the decisions are per rank and pure (here); the files and the one
Slurm call are in ``headless_io.py``.
"""

from __future__ import annotations

import enum
import logging
import time
from typing import Any, Callable, Iterable

from ..errors import JobEnded
from ..slurm.parse import compress_hostlist, expand_hostlist


__all__ = [
    "SETTLE_S", "STAGGER_S", "REOPEN_S", "EXIT_HEADLESS", "HeadlessEnded", "headless_due", "manifest_ranks",
    "requeue_turn", "should_requeue", "RequeueStep", "requeue_step", "exclusion", "batch_host_mark", "StoreWatch",
    "GuardedStore"
]


log = logging.getLogger(__name__)

SETTLE_S = 5.0  # rank 0 waits this long at most for the other ranks' persisted marks
STAGGER_S = 2.0  # rank R's turn comes R x this after rank 0's (a fallback requeuer)
REOPEN_S = 1.0  # a fresh store connection (confirming a loss) gives up after this (torch tries twice)
EXIT_HEADLESS = 0  # the rank's part ends for the requeue (as a preemption's does)


class HeadlessEnded(JobEnded):
    """The store has been gone for ``detect.headless_timeout_s``: persist and requeue.

    Raised from a store check (never from a store write) on the training thread;
    ``Session.__exit__`` hands it to :func:`end_headless`."""


# ----------------------------------------------------------------- pure decisions


def headless_due(lost_since: float | None, now: float, timeout_s: float) -> bool:
    """Pure: the store has been unreachable since ``lost_since`` for ``timeout_s`` or
    longer (``timeout_s`` 0: never; ``lost_since`` None: the store answers)."""
    return timeout_s > 0 and lost_since is not None and now - lost_since >= timeout_s


def manifest_ranks(present: Iterable[int], world_size: int, sharded: bool) -> frozenset[int] | None:
    """Pure: the ranks a headless step's manifest may list, or None (do not commit).

    ``present``: ranks whose shard of the step is complete (renamed into place).
    Replicated state: any one complete replica restores every rank. Sharded state:
    only the full set of ``world_size`` shards."""
    ranks = frozenset(r for r in present if 0 <= r < world_size)
    if not ranks or (sharded and len(ranks) < world_size):
        return None
    return ranks


def requeue_turn(rank: int, persisted: Iterable[int], world_size: int, waited_s: float, *,
                 settle_s: float = SETTLE_S, stagger_s: float = STAGGER_S) -> bool:
    """Pure: is it ``rank``'s turn to requeue after waiting ``waited_s`` since it persisted?

    Rank 0 goes once every rank has persisted, or after ``settle_s``; rank R > 0 goes
    ``R × stagger_s`` after that, in case rank 0 (or its node) is gone too."""
    everyone = set(range(world_size)) <= set(persisted)
    first = 0.0 if everyone else settle_s
    return waited_s >= first + rank * stagger_s


def should_requeue(job: dict[str, str], restarts_seen: int) -> bool:
    """Pure: requeue only the run this rank belongs to, once. ``job``: ``scontrol show
    job``'s record; ``restarts_seen``: ``SLURM_RESTART_COUNT`` of this run."""
    state = job.get("JobState", "")
    try:
        restarts = int(job.get("Restarts", "0"))
    except ValueError:
        return False
    return state == "RUNNING" and restarts == restarts_seen


class RequeueStep(enum.Enum):
    """What the requeuing rank does once the lost batch host is marked (:func:`requeue_step`).

    REQUEUE: the run still RUNS: ``scontrol requeue``, then exclude the host.
    EXCLUDE: Slurm requeued this run itself (a het job's component 0 whose node went
    DOWN, ``--no-kill`` notwithstanding), or another rank did: only set the exclusion
    on the pending job.
    NOTHING: the job is past that (running again, ended): leave it alone."""

    REQUEUE = "requeue"
    EXCLUDE = "exclude"
    NOTHING = "nothing"


_REQUEUED_STATES = frozenset({"PENDING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "COMPLETING"})


def requeue_step(job: dict[str, str], restarts_seen: int) -> RequeueStep:
    """Pure: :class:`RequeueStep` for ``job`` (``scontrol show job``'s record of the
    het-job leader or the plain job, read after the host was marked) and this run's
    ``SLURM_RESTART_COUNT``."""
    if should_requeue(job, restarts_seen):
        return RequeueStep.REQUEUE
    try:
        restarts = int(job.get("Restarts", "0"))
    except ValueError:
        return RequeueStep.NOTHING
    if restarts == restarts_seen + 1 and job.get("JobState", "") in _REQUEUED_STATES:
        return RequeueStep.EXCLUDE
    return RequeueStep.NOTHING


def exclusion(records: dict[str, dict[str, str]], job_id: str, host: str) -> tuple[str, str] | None:
    """Pure: the ``(JobId, ExcNodeList)`` update that keeps the lost batch ``host`` out of
    the job's batch component, its own exclusions kept; None when listed already.
    ``records``: ``scontrol -o show job JOB_ID`` parsed (a het job: one record per
    component, ``HetJobId`` = the leader). Measured on Slurm 22.05 right after the
    requeue of component 0: ``JobId=LEADER`` updates every component and is refused
    while component 1 still runs;
    ``JobId=LEADER+0`` updates component 0 alone."""
    own = records.get(job_id, {})
    target = f"{job_id}+0" if own.get("HetJobId") == job_id else job_id
    before = own.get("ExcNodeList", "(null)")
    kept = set() if before in ("", "(null)") else set(expand_hostlist(before))
    return None if host in kept else (target, compress_hostlist(sorted(kept | {host})))


def batch_host_mark(isolate_state: str, operator: bool, reachable: bool) -> str | None:
    """Pure: the Slurm state to give the lost batch host before the requeue, or None.

    Slurm completes a requeue only once every node of the job answers or is DOWN, so
    marking the lost node DOWN saves the wait for ``SlurmdTimeout``. Only a node whose
    slurmd does not answer (``reachable`` False) is marked, and only as
    ``recovery.isolate_state`` allows (``auto``: DOWN with operator rights, else
    untouched; ``none``: untouched; DOWN/DRAIN: that state)."""
    if reachable or isolate_state == "none" or (isolate_state == "auto" and not operator):
        return None
    return "DOWN" if isolate_state == "auto" else isolate_state


# ----------------------------------------------------------------- the store's watch


class StoreWatch:
    """Notes when the store stopped answering; shared by a rank's guarded clients."""

    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s
        self.lost_since: float | None = None
        self._clock = clock

    def lost(self, why: BaseException) -> None:
        if self.lost_since is None:
            self.lost_since = self._clock()
            log.warning("the job's store stopped answering (%s); persisting and requeueing "
                        "in %gs unless it answers", str(why).splitlines()[0][:120] if str(why) else why,
                        self.timeout_s)

    def found(self) -> None:
        """The store answers again (a fresh connection worked): not headless."""
        if self.lost_since is not None:
            log.warning("the job's store answers again")
        self.lost_since = None

    @property
    def is_lost(self) -> bool:
        return self.lost_since is not None

    def due(self) -> bool:
        return headless_due(self.lost_since, self._clock(), self.timeout_s)

    def wait_due(self, sleep: Callable[[float], None] = time.sleep) -> None:
        """Block until :meth:`due` (a rank that finished training while headless)."""
        while self.is_lost and self.timeout_s > 0 and not self.due():
            sleep(0.1)


class GuardedStore:
    """A store client whose failures mark the store lost instead of raising.

    A failed request is retried once on a fresh connection (``reopen``): a connection
    broken for another reason must not end a healthy job. When that fails too the store
    counts as lost and is not asked again until the watch is due, so nothing waits on a
    silent host at every step. Meanwhile ``check`` answers False (no newer plan: keep
    training) and ``set``/``add`` drop their write (nobody reads it). Once due, ``check``
    tries one fresh connection more: the store answering again clears the watch, else it
    raises :class:`HeadlessEnded`. Only the training thread's and the event sink's
    clients are guarded; a group's rendezvous uses a plain client (a ``dist.Store``).
    """

    def __init__(self, store: Any, watch: StoreWatch, *, reopen: Callable[[], Any] | None = None,
                 raises: bool = True) -> None:
        self._store = store
        self._watch = watch
        self._reopen = reopen
        self._raises = raises  # False for a client other threads use (events)

    def check(self, keys: list[str]) -> bool:
        if self._watch.is_lost:
            if not (self._raises and self._watch.due()):
                return False
            if not self._fresh():
                raise HeadlessEnded(EXIT_HEADLESS, f"the job's store has been gone for {self._watch.timeout_s:g}s")
            self._watch.found()
        out = self._call(lambda st: st.check(keys))
        return bool(out) if out is not None else self.check(keys)

    def set(self, key: str, value: Any) -> None:
        if not self._watch.is_lost:
            self._call(lambda st: st.set(key, value))

    def add(self, key: str, value: int) -> int:
        out = None if self._watch.is_lost else self._call(lambda st: st.add(key, value))
        return 0 if out is None else out

    def _call(self, op: Callable[[Any], Any]) -> Any:
        """``op`` on the client, retried once on a fresh one; None when the store is lost."""
        try:
            return op(self._store)
        except RuntimeError as exc:  # DistError, DistNetworkError: both RuntimeErrors
            if self._fresh():
                try:
                    return op(self._store)
                except RuntimeError as again:
                    exc = again
            self._watch.lost(exc)
            return None

    def _fresh(self) -> bool:
        """Replace the client by a new connection; False when none can be opened."""
        if self._reopen is None:
            return False
        try:
            self._store = self._reopen()
            return True
        except (RuntimeError, OSError):
            return False

    def __getattr__(self, name: str) -> Any:  # get, wait, ...: as the plain client
        return getattr(self._store, name)
