"""Where a published figure came from: every benchmark's JSON carries the script that
wrote it (``generator``, relative to the repository) and the command line it ran
(``command``), with the machine, its CPUs and load, and the time it was written.

A unit test (tests/unit/test_results_provenance.py) checks that every
``docs/results/*.json`` names a generator that exists in the repository.
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def generator_of(script: str | os.PathLike) -> str:
    """``script``'s path relative to the repository (``benchmarks/mttr.py``)."""
    path = Path(script).resolve()
    try:
        return path.relative_to(REPO).as_posix()
    except ValueError:  # a copy outside the repository: its name is all we know
        return path.name


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (None where /proc has none)."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def stamp(script: str | os.PathLike, argv: list[str] | None = None) -> dict:
    """The provenance fields of one run of ``script`` (its ``__file__``) with ``argv``
    (default: this process's arguments): generator, command, machine, cpus, load, written."""
    import datetime

    gen = generator_of(script)
    args = sys.argv[1:] if argv is None else argv
    return {"generator": gen, "command": shlex.join(["python3", gen, *args]), "machine": platform.node(),
            "cpus": os.cpu_count(), "load": loadavg(),
            "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def stamped(doc: dict, script: str | os.PathLike | None = None) -> dict:
    """``doc`` with the provenance fields added (existing keys of ``doc`` win, but for
    ``generator`` and ``command``, which always name this run); ``script``: the running
    benchmark's ``__file__`` (default: ``sys.argv[0]``, the script python3 was given)."""
    prov = stamp(script or sys.argv[0])
    return {**{k: v for k, v in prov.items() if k not in doc}, **doc,
            "generator": prov["generator"], "command": prov["command"]}
