"""What goes into ``decide`` (observations) and what comes out of it (actions).

Observations are facts an executor gathered through its adapters (liveness socket,
job steps, heartbeats, Slurm node states, the workers' events); actions are what it
must carry out. Both are frozen values: ``decide`` neither reads a socket nor
writes a file, so every recovery decision is unit-tested without Slurm or torch.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, Mapping

from ...lifecycle import JobPhase
from ...protocol import EventKind, Plan, Role, WorkerEvent
from ...model import Fault, RankTable
from ...program_error import ProgramError


__all__ = [
    "Start", "Connected", "Suspect", "Suspects", "StepFaults", "WorkerMark", "WorkerMarks", "Published", "Tick",
    "AllDone", "Preempted", "NodeBack", "SpareChecked", "Straggler", "Verdict", "LivenessChange", "StepTrained",
    "Observation", "Launch", "Relaunch", "CheckSpare", "Kill", "Publish", "Isolate", "Emit", "Say", "Phase",
    "ShutDownStandbys", "Reap", "DrainEvents", "Requeue", "Exit", "Action", "emit"
]


# ---------------------------------------------------------------- observations

@dataclasses.dataclass(frozen=True)
class Start:
    """A fresh job: launch generation 0 and the standbys. ``info``: more ``job_start`` fields."""

    info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Connected:
    """A worker opened its liveness connection."""

    worker_id: str
    pid: int | None
    t: float


@dataclasses.dataclass(frozen=True)
class Suspect:
    """Something looks wrong with one worker; the executor has probed its node.

    ``slurmd_reachable`` None: not probed. ``finished``: the rank had reported done
    (its exit is not a fault). ``still_running``: its process or step has not exited.
    ``slurmd_answers``: every worker on the node was silent, so its slurmd was asked a
    Slurm request (``probe.py``): True answered, False not within the deadline, None
    not asked. ``probe_s``: how long that probe took (detection → its answer).
    """

    worker_id: str
    t: float
    process_exited: bool = False
    heartbeat_stale: bool = False
    node_state: str | None = None
    slurmd_reachable: bool | None = None
    still_running: bool = False
    finished: bool = False
    evidence: str = ""  # the watchdog's reason when it confirmed a hang (progress.py)
    slurmd_answers: bool | None = None
    probe_s: float | None = None
    error: ProgramError | None = None  # the program's own error, as the rank reported it before it exited
    peers_cut: str = ""  # its node is cut from its peers: the evidence (observe/partition.py)


@dataclasses.dataclass(frozen=True)
class Suspects:
    """Every suspect seen together: one incident. ``bad_spares``: spares found down or
    unreachable while probing (never chosen)."""

    items: tuple[Suspect, ...]
    bad_spares: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class StepFaults:
    """Relaunch mode: what the all-ranks step showed (``classify.find_faults``): node
    faults by node, or one process fault of the whole step (a non-zero exit)."""

    faults: tuple[Fault, ...]
    t: float
    step: str = ""
    bad_spares: frozenset[str] = frozenset()


@dataclasses.dataclass(frozen=True)
class WorkerMark:
    """A rank's event that marks recovery progress (reconnected, restored, first step, done)."""

    kind: WorkerEvent
    rank: int
    generation: int
    t: float


@dataclasses.dataclass(frozen=True)
class WorkerMarks:
    """The marks of one poll of the workers' events, in order: decided as one batch, so a
    recovery's N marks cost O(N) in all, not a copy of the marks so far per mark (O(N²))."""

    marks: tuple[WorkerMark, ...]


@dataclasses.dataclass(frozen=True)
class Published:
    """A plan of a recovery was written to the store at ``t`` (the ranktable phase ends)."""

    generation: int
    t: float


@dataclasses.dataclass(frozen=True)
class Tick:
    """Time passed: deadlines are checked against ``now``."""


@dataclasses.dataclass(frozen=True)
class AllDone:
    """Every rank of the current table reported done."""


@dataclasses.dataclass(frozen=True)
class Preempted:
    """The preemption signal (``signal``, e.g. ``USR2``) reached the supervisor or a rank."""

    signal: str = ""


@dataclasses.dataclass(frozen=True)
class NodeBack:
    """An excluded node of the allocation is healthy and reachable again."""

    node: str
    state: str


@dataclasses.dataclass(frozen=True)
class SpareChecked:
    """The health check ran on ``node`` (``health.py``, as a step there): ``reason`` says
    what failed (None: passed)."""

    node: str
    reason: str | None
    t: float
    duration_s: float = 0.0


@dataclasses.dataclass(frozen=True)
class Straggler:
    """A rank's own compute time per step is far above its peers'."""

    rank: int
    compute_ms: float
    peers_ms: tuple[float, ...]


class Verdict(enum.Enum):
    """What the step-progress watchdog (``observe/watchdog.py``) thinks of one rank.

    OK: alive and moving. SUSPECT: one sign of life is late while another says the rank
    lives and moves (a starved heartbeat thread, a GIL held for long): reported only.
    SLOW: no progress past the soft timeout: reported only. WAITING: no progress past
    the hard timeout, but blocked on its peers or the supervisor. HUNG: confirmed; the
    ladder recovers it (PROCESS_HUNG). SILENT: no sign of life at all; the node probe
    decides (node lost or process hung). The value is the string written to status.json
    (a rank's ``liveness``) and to events.jsonl (``previous``).
    """

    OK = "ok"
    SUSPECT = "suspect"
    SLOW = "slow"
    WAITING = "waiting"
    HUNG = "hung"
    SILENT = "silent"


@dataclasses.dataclass(frozen=True)
class LivenessChange:
    """The watchdog's verdict on a rank changed (ok, suspect, slow, waiting; hung and
    silent arrive as :class:`Suspects`). Reported, never acted on."""

    worker_id: str
    old: Verdict
    new: Verdict
    evidence: str
    t: float


@dataclasses.dataclass(frozen=True)
class StepTrained:
    """Relaunch mode: the all-ranks step of ``generation`` trained a step at ``t`` (the
    first line its program appended to ``SR_PROGRESS_FILE`` after the relaunch; ``step``
    the line's step number, if it gave one)."""

    generation: int
    t: float
    step: int | None = None


Observation = (Start | Connected | Suspects | StepFaults | WorkerMark | WorkerMarks | Published | Tick | AllDone
               | Preempted | NodeBack | Straggler | SpareChecked | LivenessChange | StepTrained)


# ---------------------------------------------------------------- actions

@dataclasses.dataclass(frozen=True)
class Launch:
    """Start one worker (a rank of ``generation`` or a standby) on ``node``."""

    worker_id: str
    node: str
    role: Role
    generation: int


@dataclasses.dataclass(frozen=True)
class Relaunch:
    """Relaunch mode: end the running all-ranks step (if any), start one for ``table``."""

    table: RankTable
    attempt: int


@dataclasses.dataclass(frozen=True)
class CheckSpare:
    """Run the health check on ``node`` in the background; answered by :class:`SpareChecked`."""

    node: str


@dataclasses.dataclass(frozen=True)
class Kill:
    """End one worker's process (its Slurm step, or the launcher's process)."""

    worker_id: str


@dataclasses.dataclass(frozen=True)
class Publish:
    """Publish the plan (the stop signal and fence), then write the rank table files.
    ``recovery``: answer with :class:`Published` (its ranktable phase ends then)."""

    plan: Plan
    recovery: bool = False


@dataclasses.dataclass(frozen=True)
class Isolate:
    """Take ``node`` out of service, off the critical path (a background thread)."""

    node: str
    state: str
    reason: str


@dataclasses.dataclass(frozen=True)
class Emit:
    """Write one event to events.jsonl (build it with :func:`emit`)."""

    kind: EventKind
    fields: Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class Say:
    """One line on the supervisor's output."""

    text: str


@dataclasses.dataclass(frozen=True)
class Phase:
    """The job's lifecycle moved (``lifecycle.TRANSITIONS`` was checked by ``decide``)."""

    old: JobPhase
    new: JobPhase
    reason: str


@dataclasses.dataclass(frozen=True)
class ShutDownStandbys:
    """Tell every warm standby the job is over: it exits cleanly (the store's shutdown key)."""


@dataclasses.dataclass(frozen=True)
class Reap:
    """Wait up to ``grace_s`` for the workers to exit; kill what is left. Never waited on:
    a dead worker or one on an excluded node (it may answer nothing), and with
    ``end_unready`` a standby not connected yet (still importing: it would see the shut-down
    only once connected, and it holds nothing), which is ended at once."""

    grace_s: float
    end_unready: bool = False


@dataclasses.dataclass(frozen=True)
class DrainEvents:
    """Read the workers' last events into the log (before the job ends)."""


@dataclasses.dataclass(frozen=True)
class Requeue:
    """``scontrol requeue`` the job (or tell the user to rerun it, without a scheduler)."""


@dataclasses.dataclass(frozen=True)
class Exit:
    """The supervisor ends with ``code``; ``error`` is printed as one line on stderr."""

    code: int
    error: str | None = None


Action = (Launch | Relaunch | CheckSpare | Kill | Publish | Isolate | Emit | Say | Phase | ShutDownStandbys | Reap
          | DrainEvents | Requeue | Exit)


def emit(kind: EventKind, **fields: Any) -> Emit:
    """An :class:`Emit` of ``kind`` with these fields."""
    return Emit(kind, fields)
