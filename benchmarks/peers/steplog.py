"""Pure parsing of benchmarks/peers.py: a system's step log → recovery time, steps lost;
lines a system's script changed against the plain one. No Slurm, no torch."""

from __future__ import annotations

import difflib
import io
import statistics
import tokenize
from dataclasses import dataclass


@dataclass(frozen=True)
class Step:
    """One line of a step log: ``RESTART STEP T_START T_END`` (rank 0 after a completed step)."""
    restart: int
    step: int
    start: float
    end: float


def parse(text: str) -> list[Step]:
    """The well-formed lines of a step log; a torn last line (being written) is skipped."""
    rows = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 4:
            continue
        try:
            rows.append(Step(int(parts[0]), int(parts[1]), float(parts[2]), float(parts[3])))
        except ValueError:
            continue
    return rows


def recovery(rows: list[Step], t_fault: float) -> dict:
    """Fault → the first step that started after the fault and completed (a step in flight
    at the fault that still completes is not a recovery); steps lost = the steps completed
    before the fault that were done again after it."""
    before = [r.step for r in rows if r.end <= t_fault]
    after = sorted((r for r in rows if r.start > t_fault), key=lambda r: r.end)
    at_fault = max(before, default=0)
    if not after:
        return {"mttr_s": None, "step_at_fault": at_fault, "first_step_after": None, "steps_lost": None,
                "last_step": max((r.step for r in rows), default=None)}
    first = after[0]
    return {"mttr_s": round(first.end - t_fault, 3), "step_at_fault": at_fault, "first_step_after": first.step,
            "steps_lost": max(0, at_fault - (first.step - 1)), "last_step": max(r.step for r in rows)}


def stats(values: list[float]) -> dict:
    """Median, min, max and count of the values (None where there are none)."""
    v = sorted(x for x in values if x is not None)
    if not v:
        return {"median_s": None, "min_s": None, "max_s": None, "n": 0}
    return {"median_s": round(statistics.median(v), 3), "min_s": v[0], "max_s": v[-1], "n": len(v)}


def _code_lines(source: str) -> list[str]:
    """The code lines of a Python source: comments, docstrings and blank lines left out."""
    drop: set[int] = set()
    prev = tokenize.INDENT
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            drop.add(-tok.start[0])  # only the comment: the line's code stays
        elif tok.type == tokenize.STRING and prev in (tokenize.INDENT, tokenize.NEWLINE, tokenize.DEDENT):
            drop.update(range(tok.start[0], tok.end[0] + 1))  # a docstring / bare string statement
        if tok.type not in (tokenize.NL, tokenize.COMMENT):
            prev = tok.type
    lines = source.splitlines()
    return [ln.split("#")[0].rstrip() if -i in drop else ln.rstrip()
            for i, ln in enumerate(lines, 1) if i not in drop and ln.split("#")[0].strip()]


def lines_changed(plain: str, variant: str) -> dict:
    """Code lines added to and removed from the plain script (comments, docstrings and
    blank lines ignored)."""
    added = removed = 0
    for op in difflib.ndiff(_code_lines(plain), _code_lines(variant)):
        added += op.startswith("+ ")
        removed += op.startswith("- ")
    return {"added": added, "removed": removed}
