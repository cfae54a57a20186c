"""Which generation this worker is in: await a plan, find its slot, fence, join.

A worker obeys the supervisor's plans (``plan/{g}`` in the store; whether the next one
is out it reads from its page, where the node's pulse writes the supervisor's notice,
``plan_watch.py``). For each plan it
decides purely (:func:`admit`) whether to join, keep waiting (a standby not chosen),
or end (fenced, stopped, aborted), and :class:`Membership` carries that out: it
builds the generation's process group and binds the checkpoint engine to it.
"""

from __future__ import annotations

import enum
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Callable, NoReturn

import torch.distributed as dist

from ..errors import JobEnded, StepAborted
from ..model import RankSlot, RankTable
from ..protocol import Plan, PlanAction, Role, WorkerEvent, WorkerEnv
from . import default_group
from .parking import ParkingLot
from .plan_watch import Look, PlanWatch
from .reconnect import Generation

if TYPE_CHECKING:
    from ..config import ReconnectConfig


__all__ = ["EXIT_OK", "EXIT_FENCED", "EXIT_ABORTED", "Admission", "admit", "torchrun_environ", "slot_of", "Membership", "NextClient"]


log = logging.getLogger(__name__)

EXIT_OK = 0  # stopped for a requeue, persisted, or a standby at the job's end
EXIT_FENCED = 0  # left out of a newer generation: not an error of this job
EXIT_ABORTED = 3  # recovery impossible; state persisted in the job directory


class Admission(enum.Enum):
    """What a worker does with a plan.

    JOIN: it has a slot: build the generation's group.
    WAIT: a standby without a slot keeps waiting for a later plan.
    FENCED: a rank (or a standby once adopted) left out of the plan: it must stop,
        so an old generation never carries on beside the new one.
    STOP: the job is being requeued: exit 0.
    ABORT: recovery is impossible: persist the state and exit non-zero.
    """

    JOIN = "join"
    WAIT = "wait"
    FENCED = "fenced"
    STOP = "stop"
    ABORT = "abort"


def admit(plan: Plan, worker_id: str, role: Role, has_joined: bool) -> Admission:
    """Pure: what ``worker_id`` does with ``plan`` (``has_joined``: it was in a generation)."""
    if plan.action is PlanAction.ABORT:
        return Admission.ABORT
    if plan.action is PlanAction.STOP:
        return Admission.STOP
    if slot_of(plan, worker_id) is None:
        return Admission.FENCED if role is Role.RANK or has_joined else Admission.WAIT
    return Admission.JOIN


def torchrun_environ(table: RankTable, rank: int) -> dict[str, str]:
    """Pure: torchrun's variables for ``rank`` of ``table`` (set in the rank's environment
    at every join, so library code that reads them sees this generation's values)."""
    slot = table.slots[rank]
    return {"RANK": str(rank), "WORLD_SIZE": str(table.world_size), "LOCAL_RANK": str(slot.local_rank),
            "LOCAL_WORLD_SIZE": str(table.tasks_per_node), "GROUP_RANK": str(table.group_rank(rank)),
            "SR_DEVICE": slot.device}


def slot_of(plan: Plan, worker_id: str) -> RankSlot | None:
    """Pure: the worker's slot in the plan's rank table, None when it has none."""
    return next((s for s in plan.table.slots if s.worker_id == worker_id), None)


class Membership:
    """This worker's plan and process group; ``group`` is None between generations.

    ``store`` is the training thread's client (plan checks); every group and the
    checkpoint writer get clients of their own from ``open_client``.
    """

    def __init__(self, env: WorkerEnv, cfg: ReconnectConfig, store: dist.Store, *,
                 open_client: Callable[[], dist.Store], emit: Callable[..., None], heartbeat,
                 checkpoints, parking: ParkingLot, progress: Callable[[], int],
                 on_abort: Callable[[Plan], NoReturn]) -> None:
        self._env = env
        self._cfg = cfg
        self._store = store
        self._open_client = open_client
        self._next_client = NextClient(open_client)
        self._emit = emit
        self._hb = heartbeat
        self._checkpoints = checkpoints
        self._parking = parking
        self._progress = progress
        self._on_abort = on_abort
        self._writer_checks: PlanWatch | None = None  # the writer thread's plan checks (own client)
        self._channel: Generation | None = None  # the writer thread's last checkpoint-channel group
        self._plans = PlanWatch(store, heartbeat.progress, heartbeat.period_s)  # the training thread's
        self.plan: Plan | None = None
        self.group: Generation | None = None
        self._leftovers: tuple = ()  # exchange keys of left generations (Generation.leftovers)

    def where(self) -> tuple[int | None, int | None]:
        """(generation, rank) for events: the last plan's, the rank only while in a group."""
        return (self.plan.generation if self.plan else None,
                self.group.rank if self.group else None)

    def newer_plan(self) -> bool:
        """A plan after the current one exists: stop at this safe point and re-form."""
        return self._plans.out(self.plan.generation + 1)

    def stepped(self) -> None:
        """A step of this generation completed: open the next generation's store client now,
        off the recovery's path (not at the join, where it would queue at the store with
        the restore's exchanges)."""
        self._next_client.prepare()

    def leave(self) -> None:
        """Detach from the current group; it is parked, never destroyed here (it may block)."""
        default_group.release(self._parking)  # library code can no longer use the broken group
        if self.group is not None:
            self._leftovers = self.group.leftovers()
            self._parking.park(self.group.close())
            self.group = None

    def enter(self, first: int) -> Plan:
        """Wait for the first plan at or after ``first`` that concerns this worker; join it.

        Raises JobEnded when the worker is fenced or stopped, when the job shuts down
        while a standby waits, and (through ``on_abort``) when the plan aborts the job.
        A fault while joining moves on to the next plan.
        """
        g = first
        while True:
            plan = self.await_plan(g)
            what = admit(plan, self._env.worker_id, self._env.role, self.plan is not None)
            if what is Admission.ABORT:
                self._on_abort(plan)
            if what is Admission.STOP:
                self._emit(WorkerEvent.STOPPED, step=self._progress(), reason=plan.reason)
                raise JobEnded(EXIT_OK, f"stopped: {plan.reason}")
            if what is Admission.FENCED:
                self._emit(WorkerEvent.FENCED, generation=plan.generation)
                print(f"slurm_resilience: worker {self._env.worker_id} left out of generation "
                      f"{plan.generation}; exiting", file=sys.stderr)
                raise JobEnded(EXIT_FENCED, f"left out of generation {plan.generation}")
            if what is Admission.WAIT:
                g += 1
                continue
            try:
                self._join(plan)
                return plan
            except (dist.DistError, StepAborted) as exc:  # another fault while joining
                log.warning("joining generation %d failed: %s", plan.generation, exc)
                g = plan.generation + 1

    def await_newer(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for a plan after the current one: True when it exists.
        Raises JobEnded when the job shuts down meanwhile."""
        g = self.plan.generation + 1
        poll = self._cfg.poll_interval_ms / 1000.0
        deadline = time.monotonic() + timeout_s
        while (seen := self._plans.seen(g, shutdown=True)) is not Look.OUT:
            if seen is Look.ENDED:
                raise JobEnded(EXIT_OK, "the job is over")
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll)
        return True

    def await_plan(self, g: int) -> Plan:
        """Poll for ``plan/{g}``; raises JobEnded when the job shuts down first."""
        poll = self._cfg.poll_interval_ms / 1000.0
        with self._hb.progress.waiting():  # a wait on the supervisor, not a hang (watchdog)
            while (seen := self._plans.seen(g, shutdown=True)) is not Look.OUT:
                if seen is Look.ENDED:
                    raise JobEnded(EXIT_OK, "the job is over")
                time.sleep(poll)
        return Plan.from_json(self._plans.text(g))

    def _join(self, plan: Plan) -> None:
        slot = slot_of(plan, self._env.worker_id)
        t0 = time.time()
        nxt = plan.generation + 1
        self.plan = plan
        # Each generation rendezvous through its own store client: an abandoned join
        # may still be blocked in a store wait, and a shared client would hold every
        # later request (plan checks included) behind it until its timeout.
        client = self._next_client.take()
        self.group = Generation(
            client, plan.table, slot.rank, backend=self._cfg.backend,
            timeout_s=self._cfg.pg_timeout_s, poll_ms=self._cfg.poll_interval_ms,
            interrupted=lambda: self._plans.out(nxt), waiting=self._hb.progress.waiting,
            stale=self._leftovers,
        )
        self._leftovers = ()  # the new group removes them, or hands them on
        # torch.distributed's default group wraps the same backend (default_group.py); its
        # store is the group's own plain client (the training thread's may be guarded)
        default_group.install(self.group, client, self._cfg.pg_timeout_s, self._parking)
        os.environ.update(torchrun_environ(plan.table, slot.rank))
        self._checkpoints.bind(rank=slot.rank, world_size=plan.table.world_size, nodes=plan.table.nodes,
                               transfer=self._transfer_factory(plan, slot.rank), park=self._parking.park)
        self._hb.update(generation=plan.generation, rank=slot.rank)
        self._emit(WorkerEvent.RECONNECTED, start=t0, joining=slot.rank in plan.joining)

    def _transfer_factory(self, plan: Plan, rank: int) -> Callable[[], Generation]:
        """The checkpoint writer's own gloo group for this generation (built lazily, in its thread)."""
        cfg = self._cfg

        def build() -> Generation:
            # Two clients: the group's rendezvous can block its client in a store wait for
            # the whole timeout (a peer died), and a check queued behind it on the same
            # client would hold the abandonment — and the writer, and training — as long.
            nxt = plan.generation + 1
            if self._writer_checks is None:  # used by the writer thread only
                self._writer_checks = PlanWatch(self._open_client(), self._hb.progress, self._hb.period_s)
            checks = self._writer_checks
            # The last channel group's exchange keys go after this one's first gather, as
            # the training groups' do: every rank's writer has moved on from it by then.
            stale = self._channel.leftovers() if self._channel is not None else ()
            self._channel = Generation(self._open_client(), plan.table, rank, backend="gloo",
                                       timeout_s=cfg.pg_timeout_s, poll_ms=cfg.poll_interval_ms,
                                       interrupted=lambda: checks.out(nxt), channel="ckpt/", stale=stale)
            return self._channel

        return build


class NextClient:
    """The next generation's store client, opened ahead in a thread once a generation steps.

    Every generation joins through a client of its own (an abandoned join may hold its
    client in a store wait). Opened at the join, that connection was on the recovery's
    critical path: in a 12-rank job on the lab, the survivors' connects, all at once to the
    one store at load ~15, took 5–43 ms each, and the slowest decided when the restore's
    gather could complete. A client that fails to open ahead is opened at the join, as
    before; one whose store has gone fails the join, and the next attempt opens afresh.
    """

    def __init__(self, open_client: Callable[[], dist.Store]) -> None:
        self._open = open_client
        self._lock = threading.Lock()
        self._ready: dist.Store | None = None
        self._filling: threading.Thread | None = None

    def take(self) -> dist.Store:
        """The client opened ahead, or a new one now."""
        with self._lock:
            client, self._ready = self._ready, None
        return client if client is not None else self._open()

    def prepare(self) -> None:
        """Open the next client in a thread, unless one is ready or being opened."""
        with self._lock:
            if self._ready is not None or (self._filling is not None and self._filling.is_alive()):
                return
            self._filling = threading.Thread(target=self._fill, name="sr-next-client", daemon=True)
            self._filling.start()

    def _fill(self) -> None:
        try:
            client = self._open()
        except (dist.DistError, RuntimeError, OSError) as exc:  # the join opens one itself
            log.debug("store client not opened ahead: %s", exc)
            return
        with self._lock:
            if self._ready is None:
                self._ready = client
