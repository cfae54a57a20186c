"""Pure parsing of Slurm text: hostlists, ``scontrol -o show node``, env, sbatch.

Nothing here runs a command or reads ``os.environ``; callers pass text in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from itertools import product
from typing import Callable, Iterable, Mapping

__all__ = [
    "expand_hostlist",
    "compress_hostlist",
    "parse_scontrol_nodes",
    "parse_scontrol_jobs",
    "node_state_flags",
    "SlurmEnv",
    "parse_sbatch_job_id",
    "validate_node_name",
    "TaskExit",
    "parse_task_exits",
]

_NODE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")


def validate_node_name(name: str) -> str:
    """Return ``name`` if it is a safe node name, else raise ValueError.

    Names from Slurm end up in argv lists; this keeps options and odd bytes out.
    """
    if not isinstance(name, str) or not _NODE_NAME.fullmatch(name):
        raise ValueError(f"invalid node name {name!r}: expected [A-Za-z0-9][A-Za-z0-9._-]{{0,62}}")
    return name


# ---------------------------------------------------------------- hostlists

def _split_top_level(s: str) -> list[str]:
    """Split on commas that are outside brackets."""
    parts, depth, cur = [], 0, []
    for ch in s:
        if ch == "[":
            if depth:
                raise ValueError(f"nested '[' in hostlist {s!r}")
            depth = 1
        elif ch == "]":
            if not depth:
                raise ValueError(f"unbalanced ']' in hostlist {s!r}")
            depth = 0
        if ch == "," and not depth:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise ValueError(f"unbalanced '[' in hostlist {s!r}")
    parts.append("".join(cur))
    return parts


def _expand_range(body: str, whole: str) -> list[str]:
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise ValueError(f"bad range {item!r} in hostlist {whole!r}")
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if lo > hi:
            raise ValueError(f"bad range {item!r} in hostlist {whole!r}: start > end")
        width = len(lo_s) if lo_s.startswith("0") and len(lo_s) > 1 else 0
        out.extend(str(i).zfill(width) for i in range(lo, hi + 1))
    return out


def _expand_one(expr: str, whole: str) -> list[str]:
    pieces = re.split(r"\[([^\]]*)\]", expr)
    # pieces alternates literal, range-body, literal, ...
    choices: list[list[str]] = []
    for i, piece in enumerate(pieces):
        if i % 2 == 0:
            if "[" in piece or "]" in piece:
                raise ValueError(f"unbalanced brackets in hostlist {whole!r}")
            choices.append([piece])
        else:
            choices.append(_expand_range(piece, whole))
    names = ["".join(p) for p in product(*choices)]
    for n in names:
        if not n:
            raise ValueError(f"empty host name in hostlist {whole!r}")
    return names


def expand_hostlist(s: str) -> list[str]:
    """Expand Slurm hostlist syntax into names, in order.

    ``n[1-3,5]`` → n1 n2 n3 n5; ``gpu[01-03]`` keeps zero padding;
    ``rack[1-2]-n[1-2]`` → cartesian product (rack1-n1, rack1-n2, rack2-n1, ...).
    An empty string gives an empty list.

    Raises:
        ValueError: unbalanced brackets, bad or reversed range, empty name.
    """
    s = s.strip()
    if not s:
        return []
    out: list[str] = []
    for part in _split_top_level(s):
        part = part.strip()
        if not part:
            raise ValueError(f"empty element in hostlist {s!r}")
        out.extend(_expand_one(part, s))
    return out


_TRAILING_NUM = re.compile(r"^(.*?)(\d+)$")


def _ranges(nums: list[str]) -> str:
    """Compress digit strings of one width class into ``1-3,5``."""
    parts: list[str] = []
    start = prev = nums[0]
    for n in nums[1:] + [None]:  # type: ignore[list-item]
        if n is not None and int(n) == int(prev) + 1 and len(n) == len(prev):
            prev = n
            continue
        parts.append(start if start == prev else f"{start}-{prev}")
        if n is not None:
            start = prev = n
    return ",".join(parts)


def compress_hostlist(names: Iterable[str]) -> str:
    """Inverse of ``expand_hostlist`` (order preserved): n1,n2,n3,n5 → ``n[1-3,5]``.

    Only runs of consecutive names with the same prefix and digit width are
    merged, so ``expand_hostlist(compress_hostlist(x)) == list(x)``.
    """
    groups: list[tuple[str, list[str]]] = []  # (prefix, [numbers]) or (name, [])
    for name in names:
        m = _TRAILING_NUM.match(name)
        if m and groups and groups[-1][1] and groups[-1][0] == m.group(1):
            groups[-1][1].append(m.group(2))
        elif m:
            groups.append((m.group(1), [m.group(2)]))
        else:
            groups.append((name, []))
    out = []
    for prefix, nums in groups:
        if not nums:
            out.append(prefix)
        elif len(nums) == 1:
            out.append(prefix + nums[0])
        else:
            out.append(f"{prefix}[{_ranges(nums)}]")
    return ",".join(out)


# ---------------------------------------------------------------- scontrol

_TOKEN_START = re.compile(r" (?=[A-Za-z_][A-Za-z0-9_:]*=)")


def parse_scontrol_nodes(text: str) -> dict[str, dict[str, str]]:
    """Parse ``scontrol -o show node`` output into ``{NodeName: {key: value}}``.

    A token begins only where a space is followed by ``Word=``, so values with
    spaces (``OS=Linux 6.1.0 #1 SMP``) survive; ``Reason=`` always runs to the
    end of the line.
    """
    nodes: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or not line.startswith("NodeName="):
            continue
        reason = None
        idx = line.find(" Reason=")
        if idx >= 0:
            reason = line[idx + len(" Reason="):]
            line = line[:idx]
        fields = _fields(line)
        if reason is not None:
            fields["Reason"] = reason.strip()
        nodes[fields["NodeName"]] = fields
    return nodes


def _fields(line: str) -> dict[str, str]:
    fields: dict[str, str] = {}
    for token in _TOKEN_START.split(line):
        key, sep, value = token.partition("=")
        if sep:
            fields[key] = value.strip()
    return fields


def parse_scontrol_jobs(text: str) -> dict[str, dict[str, str]]:
    """Parse ``scontrol -o show job`` output into ``{JobId: {key: value}}``.

    A heterogeneous job's components are separate records (``JobId=76
    HetJobId=75 HetJobOffset=1 … NodeList=n[2,4-5] BatchHost=n2 …``).
    """
    jobs: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("JobId="):
            fields = _fields(line)
            jobs[fields["JobId"]] = fields
    return jobs


_STATE_SUFFIX_FLAGS = {
    "*": "NOT_RESPONDING",
    "~": "POWERED_DOWN",
    "#": "POWERING_UP",
    "!": "POWERING_DOWN",
    "%": "POWERING_DOWN",
    "$": "MAINTENANCE",
    "@": "REBOOT_REQUESTED",
    "^": "REBOOT_ISSUED",
    "-": "PLANNED",
}


def node_state_flags(state: str) -> frozenset[str]:
    """Split a node state into flags: ``IDLE+DRAIN`` → {IDLE, DRAIN}; ``DOWN*`` → {DOWN, NOT_RESPONDING}."""
    flags: set[str] = set()
    for part in state.strip().upper().split("+"):
        part = part.strip()
        while part and part[-1] in _STATE_SUFFIX_FLAGS:
            flags.add(_STATE_SUFFIX_FLAGS[part[-1]])
            part = part[:-1]
        if part:
            flags.add(part.replace(" ", "_"))
    return frozenset(flags)


# ---------------------------------------------------------------- env, sbatch

def _opt(v: str | None) -> str | None:
    return v if v else None


def _nodelist(v: str | None) -> tuple[str, ...]:
    return tuple(expand_hostlist(v or ""))


def _count(v: str | None) -> int:
    return int(v) if v else 0


# field → (environment variable, converter): read once, declaratively.
_ENV_MAP: dict[str, tuple[str, Callable[[str | None], object]]] = {
    "job_id": ("SLURM_JOB_ID", _opt),
    "nodelist": ("SLURM_JOB_NODELIST", _nodelist),
    "node_name": ("SLURMD_NODENAME", _opt),
    "step_id": ("SLURM_STEP_ID", _opt),
    "requeue_count": ("SLURM_RESTART_COUNT", _count),
    "submit_dir": ("SLURM_SUBMIT_DIR", _opt),
    "het_size": ("SLURM_HET_SIZE", _count),
    "resubmit_count": ("SR_RESUBMIT_COUNT", _count),
    "origin_job_id": ("SR_ORIGIN_JOB_ID", _opt),
}


@dataclass(frozen=True)
class SlurmEnv:
    """The ``SLURM_*`` variables this package uses, read once.

    In a heterogeneous job (``SLURM_HET_SIZE`` set) the plain variables describe
    component 0 (the batch host's); each component ``i`` has its own job id and
    node list in ``SLURM_JOB_ID_HET_GROUP_i`` / ``SLURM_JOB_NODELIST_HET_GROUP_i``,
    gathered here in ``het_job_ids`` and ``het_nodelists`` (index = component).
    """

    job_id: str | None
    nodelist: tuple[str, ...]
    node_name: str | None
    step_id: str | None
    requeue_count: int
    """How often Slurm requeued this job (``SLURM_RESTART_COUNT``; 0 on the first run)."""
    submit_dir: str | None
    het_size: int = 0
    resubmit_count: int = 0
    """How often the toolkit resubmitted this job as a new job id (``SR_RESUBMIT_COUNT``,
    ``recovery.requeue_by: resubmit``); counted with ``requeue_count`` against max_requeues."""
    origin_job_id: str | None = None
    """The first job id of a resubmitted job (``SR_ORIGIN_JOB_ID``): its checkpoints' paths."""
    het_job_ids: tuple[str, ...] = ()
    het_nodelists: tuple[tuple[str, ...], ...] = ()

    @property
    def is_hetjob(self) -> bool:
        return self.het_size > 0

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> "SlurmEnv":
        """Build from a mapping (pass ``os.environ`` at the edge).

        Raises:
            ValueError: malformed SLURM_JOB_NODELIST or SLURM_RESTART_COUNT; a
                heterogeneous job's SLURM_HET_SIZE without the per-component
                SLURM_JOB_ID_HET_GROUP_i / SLURM_JOB_NODELIST_HET_GROUP_i.
        """
        values = {}
        for field, (var, conv) in _ENV_MAP.items():
            values[field] = _convert(env, var, conv)
        values.update(_het_components(env, values["het_size"]))  # type: ignore[arg-type]
        return cls(**values)  # type: ignore[arg-type]


def _convert(env: Mapping[str, str], var: str, conv: Callable[[str | None], object]) -> object:
    try:
        return conv(env.get(var))
    except ValueError as exc:
        raise ValueError(f"bad {var}={env.get(var)!r}: {exc}") from None


def _het_components(env: Mapping[str, str], size: int) -> dict[str, tuple]:
    """Per-component job ids and node lists of a heterogeneous job (size 0: none)."""
    ids, nodelists = [], []
    for group in range(size):
        id_var, list_var = f"SLURM_JOB_ID_HET_GROUP_{group}", f"SLURM_JOB_NODELIST_HET_GROUP_{group}"
        for var in (id_var, list_var):
            if not env.get(var):
                raise ValueError(f"SLURM_HET_SIZE={size} but {var} is not set: not a hetjob batch environment")
        ids.append(env[id_var])
        nodelists.append(_convert(env, list_var, _nodelist))
    return {"het_job_ids": tuple(ids), "het_nodelists": tuple(nodelists)}


def parse_sbatch_job_id(stdout: str) -> str:
    """Job id from ``sbatch --parsable`` output (``123`` or ``123;cluster``).

    Raises:
        ValueError: the output holds no numeric job id.
    """
    line = stdout.strip().splitlines()[-1].strip() if stdout.strip() else ""
    job_id = line.split(";", 1)[0].strip()
    if not re.fullmatch(r"\d+(_\d+)?", job_id):
        raise ValueError(f"cannot parse job id from sbatch output {stdout.strip()!r}")
    return job_id


def config_seconds(value: str | None) -> float | None:
    """Pure: a duration from ``scontrol show config`` (``5 sec``) in seconds; None when absent
    or in another form."""
    m = re.fullmatch(r"\s*(\d+)\s*sec\s*", value or "")
    return float(m.group(1)) if m else None


@dataclass(frozen=True)
class TaskExit:
    """One bad task exit that ``srun`` reported: ``srun: error: NODE: task(s) LIST: REASON``.

    Attributes:
        node: where the tasks ran.
        tasks: their step task ids (the MPI ranks of an ``srun --mpi`` step).
        reason: ``Exited with exit code N`` or the signal's name (``Killed``).
    """

    node: str
    tasks: tuple[int, ...]
    reason: str

    def line(self) -> str:
        """``n3 task 1: Killed``, for a fault's detail."""
        word = "task" if len(self.tasks) == 1 else "tasks"
        return f"{self.node} {word} {','.join(map(str, self.tasks))}: {self.reason}"


_TASK_EXIT = re.compile(r"^srun: error: (\S+): tasks? ([0-9][0-9,-]*): (.+?)\s*$")


def parse_task_exits(text: str) -> tuple[TaskExit, ...]:
    """Pure: the bad task exits ``srun`` wrote to its stderr, in the order written (the
    first is the root cause under ``--kill-on-bad-exit=1``: the others were ended after it)."""
    found = []
    for m in filter(None, map(_TASK_EXIT.match, text.splitlines())):
        tasks = [range(int(lo), int(hi or lo) + 1) for lo, _, hi in (p.partition("-") for p in m[2].split(",") if p)]
        found.append(TaskExit(m[1], tuple(t for r in tasks for t in r), m[3]))
    return tuple(found)
