"""Pure: which recovery level answers a fault. Finest first, coarser on failure.

    level                what happens                                     needs
    ONLINE            survivors keep their processes; the dead rank is    a process fault, restart
                      restarted in place; comms rebuilt in-process         budget left
    PROCESS_RESTART   every rank relaunched as a new step on healthy      (fallback of an online
                      nodes, state from the checkpoint tiers               level that failed)
    NODE_REPLACEMENT  survivors keep their processes; a warm spare         a spare left
                      adopts the lost rank
    SCALE_IN          survivors re-form a smaller world (resharded,       world - lost >= min world
                      data position kept)
    REQUEUE           the whole job is requeued (scontrol requeue) and    requeues left
                      resumes from L1/L2
    FAIL              nothing left: clean error, state kept

A process fault on a healthy node is retried in place within the job's budget
(``fault_retry_times``, counted per job). Past it the node is treated as bad, like a
node fault, only with node-level evidence (``node_suspect``: its own processes failed
again and again while no other node's did, ``blame.node_suspect``); otherwise the job
is requeued within its requeue budget or fails — a rank's death never costs a healthy
node. A level that failed or timed out for this incident is never chosen again
for it, and after a time-out only levels that relaunch every process remain
(PROCESS_RESTART, then REQUEUE): a recovery that hung may have a hung survivor.
In relaunch mode (unmodified programs) there is no ONLINE and no SCALE_IN.
"""

from __future__ import annotations

import dataclasses
import enum

from ...model import FaultKind


__all__ = [
    "Level", "RUNGS", "LadderPolicy", "LadderInput", "LevelChoice", "choose_level", "FaultCase", "RecoveryPlan",
    "plan_recovery"
]


class Level(str, enum.Enum):
    """A recovery's level: the ladder's rungs (:data:`RUNGS`, finest first, as in the
    table above) and the two planned changes that run as a recovery. The value is the
    string written to events.jsonl (``ladder``/``recovery_start``/``recovery_done``'s
    ``level``) and compares equal to it; ``str`` and ``format`` give the value."""

    ONLINE = "online"
    PROCESS_RESTART = "process-restart"
    NODE_REPLACEMENT = "node-replacement"
    SCALE_IN = "scale-in"
    REQUEUE = "requeue"
    FAIL = "fail"
    STRAGGLER_MIGRATION = "straggler-migration"
    """Planned, not a rung: a straggler's node moves onto a spare at a safe point."""
    SCALE_OUT = "scale-out"
    """Planned, not a rung: a returned node joins the world again."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


RUNGS = (Level.ONLINE, Level.PROCESS_RESTART, Level.NODE_REPLACEMENT, Level.SCALE_IN, Level.REQUEUE, Level.FAIL)
"""The levels the ladder chooses from, finest first (a timed-out one joins ``failed``)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class LadderPolicy:
    """The configuration the ladder reads (``recovery.*``), with what the executor can do."""

    retry_budget: int  # recovery.fault_retry_times, per job
    min_world_size: int = 1
    scale_in: bool = True
    relaunch: bool = True  # recovery.fallback_relaunch (always True in relaunch mode)
    online: bool = True  # survivors can keep their processes (Session); False: relaunch mode
    max_requeues: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class LadderInput:
    """Everything the decision depends on (no I/O, no clock)."""

    fault: FaultKind
    spares_left: int
    retries_used: int  # process faults of this job already answered in place
    retry_budget: int  # recovery.fault_retry_times
    world_size: int
    lost: int = 1  # ranks lost in this incident (G for a node of G ranks)
    lost_nodes: int = 1  # nodes lost: spares needed
    min_world_size: int = 1
    scale_in: bool = True
    relaunch: bool = True  # recovery.fallback_relaunch
    online: bool = True
    requeues_used: int = 0
    max_requeues: int = 0
    failed: frozenset[Level] = frozenset()
    timed_out: bool = False  # a level of this incident timed out
    node_suspect: bool = False  # a process fault with node-level evidence against its node


@dataclasses.dataclass(frozen=True)
class LevelChoice:
    """The level chosen for one fault and why (for FAIL: why each level was ruled out)."""

    level: Level
    reason: str


_PROCESS_FAULTS = (FaultKind.PROCESS_DIED, FaultKind.PROCESS_HUNG)
# Levels that keep the survivors' processes: after a time-out they are not trusted again
# for the incident (something in the survivors may hang), so only relaunching every
# process, a requeue or failing remain.
_KEEP_SURVIVORS = (Level.ONLINE, Level.NODE_REPLACEMENT, Level.SCALE_IN)


def choose_level(inp: LadderInput) -> LevelChoice:
    """The finest level whose preconditions hold and that has not failed for this incident."""
    process_fault = inp.fault in _PROCESS_FAULTS
    budget_left = inp.retries_used < inp.retry_budget
    order = []
    if inp.timed_out:
        order += [Level.PROCESS_RESTART]
    elif process_fault and budget_left:
        order += [Level.ONLINE, Level.PROCESS_RESTART]
    why_not: list[str] = []
    if process_fault and not budget_left and not inp.timed_out and not inp.node_suspect:
        why_not.append(f"restart budget spent ({inp.retries_used}/{inp.retry_budget}) and the node is "
                       "healthy: a process's death never costs its node")
    else:
        order += [Level.NODE_REPLACEMENT, Level.SCALE_IN]
    order += [Level.REQUEUE]
    for level in order:
        if level in inp.failed:
            why_not.append(f"{level.value} already failed")
            continue
        if inp.timed_out and level in _KEEP_SURVIVORS:
            why_not.append(f"{level.value} keeps survivors, and a level timed out")
            continue
        ok, why = _allowed(level, inp)
        if ok:
            return LevelChoice(level, why)
        why_not.append(why)
    return LevelChoice(Level.FAIL, "; ".join(why_not) or "no level applies")


def _allowed(level: Level, inp: LadderInput) -> tuple[bool, str]:
    if level is Level.ONLINE:
        if not inp.online:
            return False, "online recovery needs Session (relaunch mode)"
        return True, f"process fault on a healthy node: restart in place ({inp.retries_used + 1}/{inp.retry_budget})"
    if level is Level.PROCESS_RESTART:
        if not inp.relaunch:
            return False, "relaunch disabled"
        if inp.timed_out:
            return True, "a level timed out: relaunch every rank in place"
        return True, f"relaunch every rank in place ({inp.retries_used + 1}/{inp.retry_budget})"
    if level is Level.NODE_REPLACEMENT:
        if inp.spares_left >= inp.lost_nodes:
            return True, f"{inp.spares_left} spare(s) left"
        return False, f"no spare left ({inp.spares_left} for {inp.lost_nodes} lost node(s))"
    if level is Level.SCALE_IN:
        remaining = inp.world_size - inp.lost
        if not inp.scale_in:
            return False, "scale-in disabled"
        if remaining < inp.min_world_size:
            return False, f"scale-in to {remaining} is below min_world_size={inp.min_world_size}"
        return True, f"no spare left: continue with {remaining} rank(s)"
    if level is Level.REQUEUE:
        if inp.requeues_used < inp.max_requeues:
            return True, f"requeue the job ({inp.requeues_used + 1}/{inp.max_requeues})"
        return False, f"requeue budget spent ({inp.requeues_used}/{inp.max_requeues})"
    return False, "fail"


@dataclasses.dataclass(frozen=True)
class FaultCase:
    """One fault as classified: a rank's (``rank``), or a node's, whose ``ranks`` (its G
    ranks) are lost together; ``rank`` None: a whole step's, rank unknown."""

    rank: int | None
    node: str
    kind: FaultKind
    ranks: tuple[int, ...] = ()
    node_suspect: bool = False  # a process fault, with node-level evidence against the node (blame.py)

    @property
    def lost(self) -> int:
        """Ranks this case takes out of the world if it is not replaced."""
        return len(self.ranks) or 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class RecoveryPlan:
    """What to do about an incident (one or more faults seen together)."""

    level: Level
    spares: tuple[tuple[int, str], ...] = ()  # (rank, spare node): node replacement
    restarts: tuple[int, ...] = ()  # ranks restarted in place (online)
    lost: tuple[int, ...] = ()  # ranks dropped (scale-in)
    isolate: tuple[str, ...] = ()  # nodes taken out of service
    reason: str = ""




def plan_recovery(cases: list[FaultCase], *, spares: list[str], world_size: int, policy: LadderPolicy,
                  retries_used: int = 0, requeues_used: int = 0,
                  failed: frozenset[Level] = frozenset(), timed_out: bool = False) -> RecoveryPlan:
    """Pure: one plan for every fault of the incident; the coarsest level needed wins.

    Spares are handed out in order, one per lost node; faults beyond the spares
    scale in (if allowed) as one shrink; if any fault needs a requeue or nothing
    applies, the whole incident does. A node fault whose rank is unknown (a whole
    step's) cannot be given a spare.
    """
    free = list(spares)
    node_faults = [c for c in cases if c.kind not in _PROCESS_FAULTS
                   or (retries_used >= policy.retry_budget and c.node_suspect)]
    decisions: list[tuple[FaultCase, LevelChoice]] = []
    lost_so_far = 0
    for c in cases:
        d = choose_level(LadderInput(
            fault=c.kind, spares_left=len(free) if c.rank is not None else 0, retries_used=retries_used,
            retry_budget=policy.retry_budget, world_size=world_size - lost_so_far, lost=c.lost,
            min_world_size=policy.min_world_size, scale_in=policy.scale_in and c.rank is not None,
            relaunch=policy.relaunch, online=policy.online, requeues_used=requeues_used,
            max_requeues=policy.max_requeues, failed=failed, timed_out=timed_out, node_suspect=c.node_suspect))
        if d.level is Level.NODE_REPLACEMENT:
            free.pop(0)
        if d.level is Level.SCALE_IN:
            lost_so_far += c.lost
        decisions.append((c, d))
    worst = max((d.level for _, d in decisions), key=RUNGS.index)
    reason = "; ".join(f"{_who(c)} on {c.node}: {d.level.value} ({d.reason})" for c, d in decisions)
    isolate = tuple(sorted({c.node for c in node_faults if c.rank is not None or c.kind not in _PROCESS_FAULTS}))
    if worst in (Level.REQUEUE, Level.FAIL, Level.PROCESS_RESTART):
        return RecoveryPlan(level=worst, isolate=isolate, reason=reason)
    handed = iter(spares)
    return RecoveryPlan(
        level=worst,
        spares=tuple((c.rank, next(handed)) for c, d in decisions if d.level is Level.NODE_REPLACEMENT),
        restarts=tuple(c.rank for c, d in decisions if d.level is Level.ONLINE),
        lost=tuple(c.rank for c, d in decisions if d.level is Level.SCALE_IN),
        isolate=isolate, reason=reason)


def _who(c: FaultCase) -> str:
    return f"rank {c.rank}" if c.rank is not None else "step"
