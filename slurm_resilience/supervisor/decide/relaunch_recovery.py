"""Pure: a relaunch-mode recovery's lines, marks and phases (used by ``decide``/``recover``).

No rank of an unmodified program reports events, so the executor (``relaunch.py``)
gives the marks itself::

    StepFaults (detected) ─classify─ classified ─replace─ replaced
        ─ranktable─ Published: the old step ended, the relaunched one started
        ─first_step─ StepTrained: the program's first progress line after the relaunch

``first_step`` holds everything the program does before its first step: its start
(a cold ``import torch`` or a zygote's fork), its own rendezvous and snapshot load,
one step. No rank reports joining or restoring, so ``reconnect`` and ``restore`` are
not emitted. A program that appends no progress line (``SR_PROGRESS_FILE``,
docs/restart.md) never marks a first step: its recovery is closed without one when
the step ends or faults again, with its known phases and a line that says so.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from ...model import Fault
from ...protocol import EventKind, RecoveryPhase
from .messages import Action, Published, Say, StepFaults, StepTrained, emit
from .report import Mark, recovery_phases
from .actions import Decision
from .state import Recovery, SupervisorState

_NOT_OBSERVED = (RecoveryPhase.RECONNECT, RecoveryPhase.RESTORE)


def step_faults(state: SupervisorState, obs: StepFaults) -> tuple[SupervisorState, list[Action], list[Fault]]:
    """The step's faults, each with the rank its node held (None: the whole step), their
    ``fault_detected`` event and ``fault:`` lines; a recovery whose relaunched step faults
    before it trained is closed first (``unfinished``). The incident is ``recover``'s."""
    faults = []
    for f in obs.faults:
        slot = state.table.slot_for_node(f.node)
        faults.append(dataclasses.replace(f, rank=slot.rank if slot else None))
    state, acts = unfinished(state, "the relaunched step failed")
    acts += [emit(EventKind.FAULT_DETECTED, faults=[f.to_dict() for f in faults], step=obs.step,
                  fault=faults[0].to_dict(), observed_at=obs.t),  # fault, observed_at: as online (timeline)
             *fault_lines(state, faults)]
    return state, acts, faults


def fault_lines(state: SupervisorState, faults: Sequence[Fault]) -> list[Action]:
    """One ``fault:`` line per fault, as the online supervisor writes it per rank."""
    out: list[Action] = []
    for f in faults:
        ranks = state.table.ranks_on(f.node) if f.rank is not None else ()
        who = ("the step" if not ranks else f"rank {ranks[0]}" if len(ranks) == 1
               else f"ranks {','.join(str(r) for r in ranks)}")
        out.append(Say(f"fault: {who} on {f.node}: {f.kind.name} ({f.detail})"))
    return out


def relaunching(rec: Recovery, attempt: int, nodes: Sequence[str]) -> Say:
    """The recovery's first line: its level and where the step goes."""
    return Say(f"recovery {rec.number}: {rec.level}, relaunching the step (relaunch {attempt}) "
               f"on {','.join(nodes)}")


def on_relaunched(state: SupervisorState, obs: Published) -> Decision:
    """The relaunched step started at ``obs.t`` (its ``ranktable`` phase ends).

    There is no deadline: the step's own exit or a node fault ends a relaunch that
    does not train (relaunch mode has no time-outs to fall back on)."""
    rec = state.recovery
    if rec is None or rec.generation != obs.generation or Mark.PUBLISHED in rec.marks:
        return state, []
    rec = dataclasses.replace(rec, marks={**rec.marks, Mark.PUBLISHED: obs.t})
    return dataclasses.replace(state, recovery=rec), [
        Say(f"recovery {rec.number}: relaunch {state.relaunches} started on {','.join(state.table.node_list)} "
            f"{(obs.t - rec.marks['detected']) * 1000:.1f} ms after detection")]


def on_step_trained(state: SupervisorState, obs: StepTrained) -> Decision:
    """The relaunched program trained a step: the recovery is done (phases, ``recovery_done``)."""
    rec = state.recovery
    if rec is None or rec.generation != obs.generation or Mark.PUBLISHED not in rec.marks:
        return state, []  # the job's first start, or a step of an older relaunch
    t = max(obs.t, rec.marks[Mark.PUBLISHED])  # a line's own time, never before the step started
    phases = _phases(rec, t)
    total = t - rec.marks[Mark.DETECTED]
    step = {} if obs.step is None else {"step": obs.step}
    acts: list[Action] = [*phases,
                          emit(EventKind.RECOVERY_DONE, t=t, recovery=rec.number, level=rec.level,
                               generation=rec.generation, detected=rec.marks[Mark.DETECTED], first_step=t,
                               detect_to_step_s=total, **step),
                          Say(f"recovery {rec.number} done: relaunch {state.relaunches} trained a step "
                              f"{total * 1000:.0f} ms after detection")]
    return dataclasses.replace(state, recovery=None), acts


def unfinished(state: SupervisorState, why: str) -> Decision:
    """Close a recovery whose relaunched step never reported a step (``why``: what ended
    it); its known phases are logged, no ``recovery_done``. No recovery: no change."""
    rec = state.recovery
    if rec is None:
        return state, []
    acts: list[Action] = list(_phases(rec, None))
    acts.append(Say(f"recovery {rec.number}: {why} before the program reported a step "
                    "(no line in SR_PROGRESS_FILE: no first-step time)"))
    return dataclasses.replace(state, recovery=None), acts


def _phases(rec: Recovery, first_step: float | None) -> list[Action]:
    """The phases observed so far: without ``published`` only classify and replace."""
    marks = dict(rec.marks)
    if Mark.PUBLISHED not in marks:
        marks[Mark.PUBLISHED] = marks[Mark.REPLACED]
        keep = (RecoveryPhase.CLASSIFY, RecoveryPhase.REPLACE)
    else:
        keep = tuple(p for p in RecoveryPhase if p not in _NOT_OBSERVED
                     and (first_step is not None or p is not RecoveryPhase.FIRST_STEP))
    worker = {Mark.FIRST_STEP: {0: first_step if first_step is not None else marks[Mark.PUBLISHED]}}
    return [emit(EventKind.PHASE, recovery=rec.number, phase=phase, start=start, end=end,
                 duration_ms=round((end - start) * 1000, 3))
            for phase, start, end in recovery_phases(marks, worker) if phase in keep]


__all__ = ["step_faults", "fault_lines", "relaunching", "on_relaunched", "on_step_trained", "unfinished"]
