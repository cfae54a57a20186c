"""Site options: the user's own ``#SBATCH`` and ``srun`` options, checked and rendered.

A site needs options the toolkit cannot guess (``--account``, ``--qos``,
``--gres=gpu:8``, ``--constraint``, ``--mem``, a reservation, ``--gpu-bind``...).
They are data: a mapping ``name → value`` where the name is the long option
without its dashes (``account``; ``--account`` and submitit's ``gpus_per_node``
are accepted and normalised), the value a string or number (``--name=value``),
``true`` (a flag: ``--exclusive``), a list (joined with commas, Slurm's list
syntax: ``gres: [gpu:8, nic:1]`` → ``--gres=gpu:8,nic:1``), or ``false``/null
(left out).

Options that decide how the toolkit works are refused, each with the config key
that controls it. Values may hold no line break (a ``#SBATCH`` line must stay one
line of the script) and only the characters of Slurm's option syntax; ``srun``
options only ever travel as argv elements, never through a shell.
"""

from __future__ import annotations

import re
from typing import Any, Mapping, Sequence

from ..errors import ConfigError

__all__ = ["OWNED_SBATCH", "OWNED_SRUN", "HETJOB_WORKER_ONLY", "normalize", "parse_cli",
           "parse_argv", "sbatch_lines", "srun_args"]

_NAME = re.compile(r"[a-z][a-z0-9-]*")
# Slurm's option syntax: names, counts, units, lists, constraint expressions
# (a&b|c, [x*2], !y), times, mail addresses. No spaces, quotes, $, `, ;, \ or #.
_VALUE = re.compile(r"[A-Za-z0-9_.,:=@%+/*&|!()\[\]{}~^-]*")

_SBATCH_SCRIPT = "submit --hetjob (the template renders the components)"
# option → the config key (or flag) that controls it: the toolkit renders these itself.
OWNED_SBATCH: dict[str, str] = {
    "nodes": "job.nodes and job.spares (--nodes, --spares)",
    "ntasks": "job.tasks_per_node (--tasks-per-node)",
    "ntasks-per-node": "job.tasks_per_node (--tasks-per-node)",
    "tasks-per-node": "job.tasks_per_node (--tasks-per-node)",
    "no-kill": "nothing: always on (a lost node must not end the job)",
    "requeue": "recovery.max_requeues",
    "no-requeue": "recovery.max_requeues",
    "signal": "job.preempt_signal",
    "output": "--job-dir / job.job_dir (the log is JOBDIR/supervisor.log)",
    "error": "--job-dir / job.job_dir (the log is JOBDIR/supervisor.log)",
    "open-mode": "nothing: always append (one log across requeues)",
    "time": "job.time_limit (timeout_min in the executor)",
    "partition": "job.partition (job.supervisor_partition for a hetjob's supervisor)",
    "job-name": "the job name (name= in the executor)",
    "het-group": _SBATCH_SCRIPT,
    "hetjob": _SBATCH_SCRIPT,
    "packjob": _SBATCH_SCRIPT,
    "array": "nothing: one resilient job per submission",
    "wrap": "the command after -- (the batch script runs the supervisor)",
    "parsable": "nothing: the toolkit reads the job id from sbatch",
    "wait": "--wait of slurm-resilience submit",
    "batch": "nothing: the batch step runs the supervisor",
}
_STEP = "nothing: each rank's step is the toolkit's (srun_argv in slurm/steps.py)"
OWNED_SRUN: dict[str, str] = {
    "nodes": _STEP, "ntasks": _STEP, "ntasks-per-node": _STEP, "tasks-per-node": _STEP,
    "nodelist": _STEP, "exclude": _STEP, "jobid": _STEP, "het-group": _STEP, "job-name": _STEP,
    "no-kill": _STEP, "overlap": _STEP, "exclusive": _STEP, "exact": _STEP, "kill-on-bad-exit": _STEP,
    "relative": _STEP, "distribution": _STEP,
    "output": "--job-dir / job.job_dir (each step logs to JOBDIR/logs/)",
    "error": "--job-dir / job.job_dir (each step logs to JOBDIR/logs/)",
    "input": "nothing: steps read no input",
    "pty": "nothing: steps read no input",
    "gpus-per-task": "job.tasks_per_node: each rank binds cuda:LOCAL_RANK of its node's GPUs "
                     "(docs/site-options.md, GPUs)",
    "gpus": "job.tasks_per_node: each rank binds cuda:LOCAL_RANK of its node's GPUs (docs/site-options.md, GPUs)",
    "time": "job.time_limit",
}
# Per-node resources: in a hetjob they go to the worker component only (component 0,
# the supervisor's node, takes job.supervisor_sbatch_options instead).
HETJOB_WORKER_ONLY = frozenset({
    "gres", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "cpus-per-gpu", "mem-per-gpu",
    "gpu-bind", "gpu-freq", "constraint", "cluster-constraint", "mem", "mem-per-cpu", "cpus-per-task",
    "exclusive", "oversubscribe", "cores-per-socket", "sockets-per-node", "threads-per-core",
    "tmp", "nodelist", "exclude", "switches", "ntasks-per-gpu", "ntasks-per-core", "ntasks-per-socket",
    "mincpus", "hint", "network", "gres-flags", "distribution", "contiguous", "use-min-nodes",
})


def _name(where: str, key: Any) -> str:
    if not isinstance(key, str):
        raise ConfigError(f"{where}: option name {key!r} must be a string such as 'account'")
    name = key.strip().lstrip("-").replace("_", "-").lower()
    if len(name) == 1:
        raise ConfigError(f"{where}: option {key!r}: use the long name (e.g. 'account' for -A, "
                          "'constraint' for -C)")
    if not _NAME.fullmatch(name):
        raise ConfigError(f"{where}: option name {key!r} is not a Slurm long option (letters, digits, -)")
    return name


def _value(where: str, name: str, value: Any) -> str | bool | None:
    at = f"{where}.{name}" if where.startswith("job.") else f"{where} {name}"
    if value is None or value is False:
        return None
    if value is True:
        return True
    if isinstance(value, (list, tuple)):
        parts = [_value(where, name, v) for v in value]
        if any(not isinstance(p, str) for p in parts):
            raise ConfigError(f"{at}: a list holds strings or numbers, got {list(value)!r}")
        value = ",".join(parts)  # type: ignore[arg-type]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ConfigError(f"{at} must be a string, a number, true, false or a list, got {value!r}")
    text = str(value)
    if any(c in text for c in "\n\r\0"):
        raise ConfigError(f"{at}={text!r} contains a line break: not allowed in an sbatch script")
    if not text or not _VALUE.fullmatch(text):
        bad = "".join(sorted({c for c in text if not _VALUE.fullmatch(c)})) or "(empty)"
        raise ConfigError(f"{at}={text!r} has characters outside Slurm's option syntax: "
                          f"{bad!r} (no spaces, quotes, $ ` ; \\ #)")
    return text


def normalize(where: str, options: Any, owned: Mapping[str, str]) -> dict[str, str | bool]:
    """Pure: ``{name: "value" | True}`` from a user mapping; ``where`` names the config key.

    Raises:
        ConfigError: not a mapping, a bad name or value, an option the toolkit owns,
            or one option given twice (``account`` and ``--account``).
    """
    if options is None:
        return {}
    if not isinstance(options, Mapping):
        raise ConfigError(f"{where} must be a mapping of option → value, e.g. {{account: proj}}, got {options!r}")
    out: dict[str, str | bool] = {}
    for key, value in options.items():
        name = _name(where, key)
        if name in owned:
            raise ConfigError(f"{where}: --{name} is the toolkit's own: set it with {owned[name]}")
        if name in out:
            raise ConfigError(f"{where}: --{name} is given twice ({key!r})")
        v = _value(where, name, value)
        if v is not None:
            out[name] = v
    return out


def parse_cli(flag: str, items: Sequence[str] | None) -> dict[str, str | bool]:
    """``--sbatch-option account=proj`` / ``exclusive`` → a mapping for ``normalize``
    (later ones win).

    Raises:
        ConfigError: an empty item.
    """
    out: dict[str, str | bool] = {}
    for item in items or ():
        key, sep, value = item.partition("=")
        if not key.strip("-"):
            raise ConfigError(f"{flag} {item!r}: give KEY=VALUE (e.g. account=proj) or a flag (e.g. exclusive)")
        out[key] = value if sep else True
    return out


def parse_argv(where: str, args: Any) -> dict[str, str | bool]:
    """submitit's ``slurm_srun_args`` (``["--cpu-bind", "none", "--gpu-bind=closest"]``)
    → a mapping for ``normalize``.

    Raises:
        ConfigError: not a list of strings, or a value before any option.
    """
    if isinstance(args, str) or not isinstance(args, (list, tuple)) or not all(isinstance(a, str) for a in args):
        raise ConfigError(f"{where} must be a list of srun arguments, e.g. ['--cpu-bind=cores'], got {args!r}")
    out: dict[str, str | bool] = {}
    last = None
    for arg in args:
        if arg.startswith("-"):
            key, sep, value = arg.partition("=")
            out[key] = value if sep else True
            last = None if sep else key
        elif last is not None and out[last] is True:
            out[last], last = arg, None
        else:
            raise ConfigError(f"{where}: {arg!r} follows no option")
    return out


def sbatch_lines(options: Mapping[str, str | bool]) -> list[str]:
    """Pure: ``#SBATCH`` lines for normalized options, in the order given."""
    return [f"#SBATCH --{k}" if v is True else f"#SBATCH --{k}={v}" for k, v in options.items()]


def srun_args(options: Mapping[str, str | bool]) -> list[str]:
    """Pure: argv elements for normalized options (``--gpu-bind=closest``)."""
    return [f"--{k}" if v is True else f"--{k}={v}" for k, v in options.items()]
