"""The ``job`` section: the Slurm allocation, and the site's own options for it.

Split from :mod:`slurm_resilience.config` (which reads the YAML and holds the
other sections). Site options (``sbatch_options``, ``srun_options``,
``supervisor_sbatch_options``) are checked and normalised by
:mod:`slurm_resilience.slurm.options`; ``setup`` lines are the user's own shell.
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass, field
from typing import Any

from slurm_resilience.errors import ConfigError
from slurm_resilience.slurm.options import OWNED_SBATCH, OWNED_SRUN, normalize

__all__ = ["JobConfig"]

_TIME_LIMIT = re.compile(r"(\d+-)?\d{1,2}:\d{2}:\d{2}|\d+")
_PARTITION = re.compile(r"[A-Za-z0-9_.,-]+")


@dataclass(frozen=True, kw_only=True)
class JobConfig:
    """The Slurm allocation.

    Fields:
        nodes: worker nodes, one rank each (>= 1).
        spares: extra nodes held idle to replace lost ones (>= 0).
        tasks_per_node: ranks per node, one per GPU on a GPU node (>= 1); a spare node
            holds as many warm standbys.
        job_dir: where the job writes rank tables and events; ``{job_id}`` is filled in.
        time_limit: Slurm ``--time``: ``[D-]HH:MM:SS`` or minutes.
        partition: Slurm partition, or None for the default.
        supervisor_node: an extra node in the allocation runs the supervisor alone.
        preempt_signal: ``SIG@SECONDS`` sent to the supervisor before the time limit
            or on preemption (``--signal=B:USR2@60``); it checkpoints to a durable
            tier and requeues the job. Empty: none.
        supervisor_respawns: times the batch step respawns a supervisor that was
            killed; the restarted one re-attaches to the running workers (>= 0).
        sbatch_options: the site's ``#SBATCH`` options, ``name → value`` (``account``,
            ``qos``, ``gres``, ``constraint``, ``mem``, ``exclusive: true``, a list
            joins with commas); in every template, and in a hetjob on the worker
            component (per-node resources) or both (job-wide ones such as account).
        srun_options: options of every worker, standby and relaunch step
            (``gpu-bind: closest``, ``cpu-bind: cores``, ``mpi: pmix``).
        setup: shell lines run by the batch script before the supervisor starts;
            the steps inherit their environment (``module load``, venv activation,
            exports). Rendered verbatim: the user's own shell.
        supervisor_partition: with ``--hetjob``, component 0's partition (e.g. a small
            CPU partition); None: ``partition``.
        supervisor_sbatch_options: with ``--hetjob``, component 0's own ``#SBATCH``
            options (e.g. ``{mem: 8G, cpus-per-task: 4}``).
    """

    nodes: int = 4
    spares: int = 1
    tasks_per_node: int = 1
    job_dir: str = "sr-jobs/{job_id}"
    time_limit: str = "00:30:00"
    partition: str | None = None
    supervisor_node: bool = True
    preempt_signal: str = "USR2@60"
    supervisor_respawns: int = 3
    sbatch_options: dict[str, Any] = field(default_factory=dict)
    srun_options: dict[str, Any] = field(default_factory=dict)
    setup: tuple[str, ...] = ()
    supervisor_partition: str | None = None
    supervisor_sbatch_options: dict[str, Any] = field(default_factory=dict)

    @property
    def preempt_signum(self) -> "signal.Signals | None":
        """The preemption signal as a ``signal.Signals`` (None when disabled); the one
        parser of ``preempt_signal`` (supervisor, keeper and sessions use it)."""
        if not self.preempt_signal:
            return None
        name = self.preempt_signal.split("@")[0]
        return signal.Signals[name if name.startswith("SIG") else "SIG" + name]

    @property
    def preempt_signal_name(self) -> str:
        """``USR2`` for ``USR2@60`` (empty when disabled)."""
        return self.preempt_signal.split("@")[0].removeprefix("SIG") if self.preempt_signal else ""

    def __post_init__(self) -> None:
        if self.nodes < 1:
            raise ConfigError(f"job.nodes={self.nodes} must be >= 1: give at least one worker node")
        if self.spares < 0:
            raise ConfigError(f"job.spares={self.spares} must be >= 0: use 0 for no spare nodes")
        if self.supervisor_respawns < 0:
            raise ConfigError(f"job.supervisor_respawns={self.supervisor_respawns} must be >= 0: "
                              "use 0 to never respawn a killed supervisor")
        if self.tasks_per_node < 1:
            raise ConfigError(f"job.tasks_per_node={self.tasks_per_node} must be >= 1: one rank per GPU of a node")
        if not _TIME_LIMIT.fullmatch(self.time_limit):
            raise ConfigError(
                f"job.time_limit={self.time_limit!r} is not a Slurm time: use [D-]HH:MM:SS or minutes"
            )
        if self.preempt_signal and not re.fullmatch(r"(SIG)?(USR1|USR2|TERM|INT|HUP)@\d+", self.preempt_signal):
            raise ConfigError(f"job.preempt_signal={self.preempt_signal!r} must look like 'USR2@60' (or be empty)")
        if not self.job_dir:
            raise ConfigError("job.job_dir is empty: give a directory such as 'sr-jobs/{job_id}'")
        for key in ("partition", "supervisor_partition"):
            value = getattr(self, key)
            if value is not None and not _PARTITION.fullmatch(value):
                raise ConfigError(f"job.{key}={value!r} is not a partition name: letters, digits, _ . , - only")
        # frozen: the normalised forms replace what was given (``--account`` → ``account``)
        for key, owned in (("sbatch_options", OWNED_SBATCH), ("supervisor_sbatch_options", OWNED_SBATCH),
                           ("srun_options", OWNED_SRUN)):
            object.__setattr__(self, key, normalize(f"job.{key}", getattr(self, key), owned))
        object.__setattr__(self, "setup", _setup_lines(self.setup))


def _setup_lines(setup: Any) -> tuple[str, ...]:
    """Each setup line is one line of the batch script.

    Raises:
        ConfigError: not strings, a NUL, or a last line continued with ``\\`` (it would
            swallow the line that starts the supervisor).
    """
    lines = setup.splitlines() if isinstance(setup, str) else setup
    if not isinstance(lines, (list, tuple)) or not all(isinstance(ln, str) for ln in lines):
        raise ConfigError(f"job.setup must be a list of shell lines, got {setup!r}")
    out = tuple(part for ln in lines for part in (ln.splitlines() or [""]))
    if any("\0" in ln for ln in out):
        raise ConfigError("job.setup holds a NUL character: not allowed in a batch script")
    if out and out[-1].rstrip().endswith("\\"):
        raise ConfigError(f"job.setup's last line {out[-1]!r} ends with a backslash: it would continue into "
                          "the line that starts the supervisor")
    return out
