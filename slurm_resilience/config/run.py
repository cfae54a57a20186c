"""The ``run`` section: how ``slurm-resilience run`` starts an unmodified program's ranks.

Split from :mod:`slurm_resilience.config` (which reads the YAML and holds the other
sections), like :mod:`slurm_resilience.config.job`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from slurm_resilience.errors import ConfigError

__all__ = ["RunConfig"]

_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """Warm relaunches of an unmodified program (docs/restart.md, "Warm relaunch").

    Fields:
        warm: start a zygote per worker and spare node with the job (a process that
            has imported torch and ``preload``) and fork every generation's ranks from
            it instead of a new ``srun`` step that imports torch cold. Torch mode and
            ``python script.py ...`` commands only; anything else runs cold.
        preload: modules each zygote imports besides torch and torch._dynamo (``[numpy, transformers]``).
        zygote_start_s: how long the first generation waits for the zygotes to be
            ready before it starts cold instead (> 0).
        step_pattern: a regular expression (Python ``re``) searched in each line of a
            relaunched step's output: the first line it matches is the program's first
            step after the relaunch, which ends the recovery (its group ``step``, or else
            its first group, is the step number when it is one). For a program that
            writes nothing to ``SR_PROGRESS_FILE`` (docs/restart.md); empty: that file only.
    """

    warm: bool = True
    preload: tuple[str, ...] = ()
    zygote_start_s: float = 120.0
    step_pattern: str = ""

    def __post_init__(self) -> None:
        bad = [m for m in self.preload if not _MODULE.fullmatch(m)]
        if bad:
            raise ConfigError(f"run.preload: {bad[0]!r} is not a module name (e.g. numpy, transformers.models)")
        if not self.zygote_start_s > 0:
            raise ConfigError(f"run.zygote_start_s must be > 0, got {self.zygote_start_s}")
        try:
            re.compile(self.step_pattern)
        except re.error as exc:
            raise ConfigError(f"run.step_pattern {self.step_pattern!r} is not a regular expression: {exc}") from None
