"""Pure: whose fault is it — the program's or a node's? (used by ``recover.on_suspects``)

Only node-level evidence may take a node out of service: the node unreachable, its
slurmd silent, Slurm's state of it unhealthy (``classify.py``), or the node's own
processes failing again and again while no other node's do (:func:`node_suspect`).
A rank's death on a reachable, healthy node costs a restart budget, never the node.

A program's own error is recognised from what the ranks report before they exit
(``program_error.ProgramError``: type, message digest, step, phase) —
:func:`program_verdict`:

=========================================================  ==========================
seen                                                       verdict
=========================================================  ==========================
the same error (type + digest) on ranks of two or more     the program's: every rank
nodes in the same generation (or on every rank of a        runs the same code on the
one-node job)                                              same data position
the same error at the same step and phase as one seen      the program's: a recovery
before an earlier recovery                                 replays the step exactly
=========================================================  ==========================

A program's error ends the job at once (``Level.FAIL`` with the error's first lines):
no node is isolated and nothing is requeued — the next attempt would fail the same way.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

from ...program_error import ProgramError

__all__ = ["ErrorSeen", "ProgramBlame", "program_verdict", "node_suspect", "remember", "last_error", "HISTORY"]

HISTORY = 64  # program errors kept in the state (the newest)
NODE_SUSPECT_FAILURES = 2  # a node's own process failures (none elsewhere) that make it suspect


@dataclasses.dataclass(frozen=True)
class ErrorSeen:
    """A program error as the supervisor saw it: which rank and node, and how many
    recoveries the job had started by then (``recovery``)."""

    rank: int | None
    node: str
    recovery: int
    error: ProgramError

    def to_dict(self) -> dict:
        """For ``supervisor.json``."""
        return {"rank": self.rank, "node": self.node, "recovery": self.recovery, "error": self.error.to_dict()}

    @classmethod
    def from_dict(cls, d: Mapping) -> "ErrorSeen":
        """The inverse of :meth:`to_dict` (a re-attached supervisor's saved state)."""
        return cls(rank=None if d.get("rank") is None else int(d["rank"]), node=str(d["node"]),
                   recovery=int(d["recovery"]), error=ProgramError.from_dict(dict(d["error"])))


@dataclasses.dataclass(frozen=True)
class ProgramBlame:
    """The incident is the program's: ``first`` is the error to show (the earliest
    report of that signature), ``why`` the rule that fired."""

    first: ErrorSeen
    why: str
    ranks: tuple[int, ...]

    def message(self) -> str:
        """The reason the job is aborted with (printed and logged): the program's error and where it happened."""
        e = self.first.error
        where = f"step {e.step}" if e.step is not None else "before the first step"
        return (f"the program failed: {e.headline} (rank {self.first.rank} on {self.first.node}, {where}, "
                f"{e.phase.value}); {self.why}: a program error, not a node fault — no node isolated, "
                "no requeue")


def program_verdict(history: Sequence[ErrorSeen], new: Sequence[ErrorSeen], *,
                    nodes_in_job: int) -> ProgramBlame | None:
    """Pure: is this incident (``new``) the program's own error, given what came before?"""
    for seen in new:
        sig, err = seen.error.signature, seen.error
        together = [s for s in (*history, *new) if s.error.signature == sig and s.error.generation == err.generation]
        nodes = {s.node for s in together}
        ranks = _ranks(together)
        if len(nodes) >= 2 or (nodes_in_job == 1 and len(ranks) >= 2):
            return ProgramBlame(together[0], f"the same error on rank(s) {', '.join(map(str, ranks))} of "
                                             f"{len(nodes)} node(s) in generation {err.generation}", ranks)
        earlier = [s for s in history if s.error.signature == sig and s.recovery < seen.recovery
                   and _before(s.error.generation, err.generation)
                   and s.error.step == err.step and s.error.phase is err.phase]
        if earlier:
            point = f"step {err.step}" if err.step is not None else "before the first step"
            return ProgramBlame(earlier[0], f"the same error at the same point ({point}, {err.phase.value}) "
                                            f"after recovery {seen.recovery}", _ranks([*earlier, seen]))
    return None


def node_suspect(process_failures: Mapping[str, int], node: str) -> bool:
    """Pure: the node's own processes failed repeatedly while no other node's did —
    node-level evidence, even though the node answers and Slurm finds it healthy."""
    mine = process_failures.get(node, 0)
    others = sum(n for x, n in process_failures.items() if x != node)
    return mine >= NODE_SUSPECT_FAILURES and others == 0


def remember(history: Sequence[ErrorSeen], new: Iterable[ErrorSeen]) -> tuple[ErrorSeen, ...]:
    """The newest ``HISTORY`` errors."""
    return (*history, *new)[-HISTORY:]


def last_error(history: Sequence[ErrorSeen], cases: Iterable, recovery: int) -> dict:
    """Pure: the newest program error the incident's ranks (``cases``' ``rank``) reported
    in recovery ``recovery``, as ``actions.abort`` fields (the status shows its traceback
    with the failure, whatever ended the ladder); {} when none reported one."""
    ranks = {c.rank for c in cases if c.rank is not None}
    seen = next((e for e in reversed(history) if e.rank in ranks and e.recovery == recovery), None)
    if seen is None:
        return {}
    return {"traceback": seen.error.traceback, "program_error": seen.error.to_dict(), "rank": seen.rank,
            "node": seen.node}


def _before(a: int | None, b: int | None) -> bool:
    """Generation ``a`` came before ``b`` (unknown generations: assume so)."""
    return a is None or b is None or a < b


def _ranks(seen: Iterable[ErrorSeen]) -> tuple[int, ...]:
    return tuple(sorted({s.rank for s in seen if s.rank is not None}))
