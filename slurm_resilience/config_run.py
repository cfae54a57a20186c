"""The ``run`` section: how ``slurm-resilience run`` starts an unmodified program's ranks.

Split from :mod:`slurm_resilience.config` (which reads the YAML and holds the other
sections), like :mod:`slurm_resilience.config_job`.
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
    """

    warm: bool = True
    preload: tuple[str, ...] = ()
    zygote_start_s: float = 120.0

    def __post_init__(self) -> None:
        bad = [m for m in self.preload if not _MODULE.fullmatch(m)]
        if bad:
            raise ConfigError(f"run.preload: {bad[0]!r} is not a module name (e.g. numpy, transformers.models)")
        if not self.zygote_start_s > 0:
            raise ConfigError(f"run.zygote_start_s must be > 0, got {self.zygote_start_s}")
