"""Which recovery path ``slurm-resilience run --mpi`` takes (pure).

Two paths exist for an MPI program:

    IN_PLACE   the job runs under the bundled ``mpirun --with-ft ulfm``; spare ranks
               park in the world and a lost rank is repaired in place
               (``mpi/ulfm.py``, docs/mpi-ulfm.md)
    RELAUNCH   the whole step is relaunched through ``srun --mpi=pmix`` after a
               fault (any MPI; ``supervisor/executors/relaunch.py``)

In-place repair is only trusted when every fact says it works, because mpi4py
degrades silently on an MPI without ULFM (Shrink becomes Dup, Agree an Allreduce):
the program's interpreter loads Open MPI >= 5 through an mpi4py with the ULFM calls,
the ``ompi_info`` of that same installation says "FT MPI support: yes", its
``mpirun`` exists, the program uses ``slurm_resilience.mpi.Session`` (an unmodified
program cannot take part in a repair), and the launch line carries
``--with-ft ulfm``. Anything else is the relaunch path, with the first reason that
failed. ``mpi/probe.py`` gathers the facts; this module only reads them.
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Sequence

from .errors import UlfmUnavailableError

__all__ = [
    "MpiPath", "REQUESTS", "MpiProbe", "PathChoice", "open_mpi_version", "parse_ompi_info", "ft_supported",
    "launches_with_ulfm", "choose_path"
]


class MpiPath(enum.Enum):
    """The recovery path of an MPI job (see the module docstring)."""

    IN_PLACE = "in-place"
    RELAUNCH = "relaunch"


REQUESTS = ("auto", "in-place", "relaunch")
"""What ``--mpi-path`` accepts: ``auto`` decides from the probe."""


@dataclass(frozen=True, kw_only=True)
class MpiProbe:
    """What ``mpi/probe.py`` found out about the program's MPI (no decision in it).

    Attributes:
        interpreter: the program's first word when it is a Python interpreter, else None.
        script: the program's script (the interpreter's first argument), or None.
        uses_session: the script imports ``slurm_resilience.mpi`` (None: unknown).
        error: why the interpreter could not be asked (mpi4py missing, time-out), or "".
        library: ``MPI.Get_library_version()`` as that interpreter's mpi4py reports it.
        has_ulfm_calls: that mpi4py has ``Comm.Shrink`` and ``ERR_PROC_FAILED``.
        libmpi: the ``libmpi.so`` that mpi4py loaded.
        prefix: the installation around it (``libmpi``'s ``lib/``'s parent).
        ft_support: ``ompi_info``'s ``ft_mpi_support`` of that prefix (None: no ompi_info).
        mpirun: ``PREFIX/bin/mpirun`` exists and is executable.
    """

    interpreter: str | None
    script: str | None = None
    uses_session: bool | None = None
    error: str = ""
    library: str = ""
    has_ulfm_calls: bool = False
    libmpi: str = ""
    prefix: str = ""
    ft_support: bool | None = None
    mpirun: bool = False


@dataclass(frozen=True)
class PathChoice:
    """The path and the one reason given for it (printed and logged as is)."""

    path: MpiPath
    reason: str

    def line(self) -> str:
        """The one line ``run --mpi`` prints."""
        what = "in-place repair (ULFM)" if self.path is MpiPath.IN_PLACE else "relaunch of the whole step"
        return f"MPI recovery path: {what}: {self.reason}"


_OPEN_MPI = re.compile(r"Open MPI v(\d+)\.(\d+)(?:\.(\d+))?")


def open_mpi_version(library: str) -> tuple[int, ...] | None:
    """``(major, minor[, patch])`` of an Open MPI library version string, else None."""
    m = _OPEN_MPI.search(library)
    return None if m is None else tuple(int(g) for g in m.groups() if g is not None)


def parse_ompi_info(text: str) -> dict[str, str]:
    """``ompi_info --parsable`` lines ``a:b:c:value`` as ``{"a:b:c": value}``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.rpartition(":")
        if sep and key:
            out.setdefault(key, value)
    return out


def ft_supported(info: dict[str, str]) -> bool:
    """Does a parsed ``ompi_info`` say the MPI layer has fault tolerance (ULFM)?"""
    return info.get("options:ft_mpi_support", "").strip().lower() == "yes"


def launches_with_ulfm(argv: Sequence[str]) -> bool:
    """Does a launch line switch ULFM on (``--with-ft ulfm``)?"""
    return any(a == "--with-ft" and b in ("ulfm", "mpi") for a, b in zip(argv, argv[1:]))


def _why_not(probe: MpiProbe, launch_argv: Sequence[str], container: str) -> str | None:
    """The first reason in-place repair cannot be trusted, or None."""
    if container != "none":
        return f"ranks run in {container} containers; the ULFM launcher starts them on the host"
    if probe.interpreter is None:
        return "the program is not started by a Python interpreter (in-place repair is for mpi4py " \
               "programs that use slurm_resilience.mpi.Session)"
    if probe.error:
        return f"{probe.interpreter} cannot report its MPI: {probe.error}"
    version = open_mpi_version(probe.library)
    if version is None or version < (5,):
        lib = probe.library.split(",")[0].strip() or "an unknown MPI"
        return f"{probe.interpreter}'s mpi4py loads {lib}, which has no ULFM (needs Open MPI >= 5)"
    if not probe.has_ulfm_calls:
        return f"{probe.interpreter}'s mpi4py has no ULFM calls (Comm.Shrink): needs mpi4py >= 4"
    if probe.ft_support is None:
        return f"no ompi_info beside {probe.libmpi or 'its libmpi'} to confirm FT support"
    if not probe.ft_support:
        return f"ompi_info of {probe.prefix} says FT MPI support: no"
    if not probe.mpirun:
        return f"no {probe.prefix}/bin/mpirun to launch with --with-ft ulfm"
    if probe.uses_session is None:
        return "cannot tell whether the program uses slurm_resilience.mpi.Session (no script to read)"
    if not probe.uses_session:
        return f"{probe.script} does not use slurm_resilience.mpi.Session, so it cannot take part in a repair"
    if not launches_with_ulfm(launch_argv):
        return "the launch line lacks --with-ft ulfm"
    return None


def choose_path(probe: MpiProbe, *, requested: str, launch_argv: Sequence[str], spare_ranks: int,
                container: str = "none") -> PathChoice:
    """Decide the path of an MPI job from the probe and the launch line it would get.

    ``requested``: ``auto`` (decide), ``relaunch`` (always), ``in-place`` (an error
    when in-place repair cannot be trusted).

    Raises:
        UlfmUnavailableError: ``in-place`` was requested and a fact rules it out.
        ValueError: ``requested`` is not one of ``REQUESTS``.
    """
    if requested not in REQUESTS:
        raise ValueError(f"--mpi-path={requested!r}: choose one of {', '.join(REQUESTS)}")
    if requested == "relaunch":
        return PathChoice(MpiPath.RELAUNCH, "asked for (--mpi-path relaunch)")
    why = _why_not(probe, launch_argv, container)
    if why is not None:
        if requested == "in-place":
            raise UlfmUnavailableError(f"--mpi-path in-place: {why}")
        return PathChoice(MpiPath.RELAUNCH, why)
    ver = ".".join(str(v) for v in open_mpi_version(probe.library) or ())
    return PathChoice(MpiPath.IN_PLACE,
                      f"mpi4py loads Open MPI {ver} from {probe.prefix} (ompi_info: FT MPI support yes), "
                      f"{probe.script} uses slurm_resilience.mpi.Session, mpirun --with-ft ulfm; "
                      f"{spare_ranks} spare rank(s)")
