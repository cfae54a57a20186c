"""Gather the facts ``mpi/choose.py`` decides from: ask the program's interpreter
which MPI its mpi4py loads, and that installation's ``ompi_info`` whether it has FT.

The interpreter is run with ``mpi4py.rc.initialize = False`` (``MPI_Get_library_version``
needs no ``MPI_Init``; no singleton runtime starts) and a time-out. Every command is
an argv list.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
from typing import Sequence

from .choose import MpiProbe, ft_supported, parse_ompi_info

__all__ = ["split_program", "uses_session", "probe"]

_PYTHON = re.compile(r"python(\d+(\.\d+)?)?$")
_ASK = r"""
import json, sys
import mpi4py
mpi4py.rc.initialize = False
mpi4py.rc.finalize = False
from mpi4py import MPI
lib = [ln.split()[-1] for ln in open('/proc/self/maps') if 'libmpi.so' in ln]
print(json.dumps({"library": MPI.Get_library_version().strip("\x00 \n"), "libmpi": lib[0] if lib else "",
                  "ulfm": hasattr(MPI.Comm, "Shrink") and hasattr(MPI, "ERR_PROC_FAILED")}))
"""
_SESSION = re.compile(r"^\s*(from\s+slurm_resilience\.mpi(\.ulfm)?\s+import\b|import\s+slurm_resilience\.mpi\b)",
                      re.MULTILINE)


def split_program(command: Sequence[str]) -> tuple[str | None, str | None]:
    """Pure: (the interpreter, its script) of a program's argv; (None, None) when the
    first word is not a Python interpreter, (python, None) for ``-m``/``-c`` forms."""
    if not command or not _PYTHON.match(os.path.basename(command[0])):
        return None, None
    rest = list(command[1:])
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c"):
        rest.pop(0)  # interpreter flags such as -u
    if not rest or rest[0] in ("-m", "-c"):
        return command[0], None
    return command[0], rest[0]


def uses_session(script: str | None) -> bool | None:
    """Does the script import ``slurm_resilience.mpi``? None: no script or unreadable."""
    if script is None:
        return None
    try:
        with open(script, encoding="utf-8", errors="replace") as f:
            return _SESSION.search(f.read()) is not None
    except OSError:
        return None


def probe(command: Sequence[str], *, timeout_s: float = 30.0) -> MpiProbe:
    """The facts about ``command``'s MPI, gathered on this host (never raises for a
    broken interpreter: the reason goes into ``MpiProbe.error``)."""
    interpreter, script = split_program(command)
    if interpreter is None:
        return MpiProbe(interpreter=None)
    session = uses_session(script)
    try:
        out = subprocess.run([interpreter, "-c", _ASK], capture_output=True, text=True,
                             timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return MpiProbe(interpreter=interpreter, script=script, uses_session=session,
                        error=f"{type(exc).__name__}: {exc}")
    if out.returncode != 0:
        last = (out.stderr.strip().splitlines() or ["exit code %d" % out.returncode])[-1]
        return MpiProbe(interpreter=interpreter, script=script, uses_session=session, error=last)
    try:
        facts = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return MpiProbe(interpreter=interpreter, script=script, uses_session=session,
                        error=f"unreadable answer {out.stdout[-200:]!r}")
    libmpi = facts.get("libmpi", "")
    prefix = os.path.dirname(os.path.dirname(libmpi)) if libmpi else ""
    ft = None
    info_bin = os.path.join(prefix, "bin", "ompi_info") if prefix else ""
    if info_bin and os.access(info_bin, os.X_OK):
        try:
            info = subprocess.run([info_bin, "--parsable"], capture_output=True, text=True,
                                  timeout=timeout_s, stdin=subprocess.DEVNULL, check=False)
            ft = ft_supported(parse_ompi_info(info.stdout)) if info.returncode == 0 else None
        except (OSError, subprocess.TimeoutExpired):
            ft = None
    mpirun = bool(prefix) and os.access(os.path.join(prefix, "bin", "mpirun"), os.X_OK)
    return MpiProbe(interpreter=interpreter, script=script, uses_session=session,
                    library=facts.get("library", ""), has_ulfm_calls=bool(facts.get("ulfm")),
                    libmpi=libmpi, prefix=prefix, ft_support=ft, mpirun=mpirun)
