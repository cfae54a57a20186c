"""Per-component configuration: frozen keyword-only dataclasses, YAML in one place.

Each section of the YAML file maps to one dataclass, in a module of its own::

    job:        {nodes: 4, spares: 1}                    config/job.py
    detect:     {heartbeat_period_s: 0.25}               config/detect.py
    recovery:   {...}                                    config/recovery.py
    reconnect:  {...}                                    config/reconnect.py
    checkpoint: {...}                                    config/checkpoint.py
    container:  {runtime: podman, image: ...}            config/container.py
    run:        {warm: true, preload: [numpy]}           config/run.py

``config/load.py`` holds ``ResilienceConfig`` (every section) and reads YAML
(``config/io.py``); ``config/timeouts.py`` checks the order of the timeouts.
This package's names below are the public configuration API.
"""

from slurm_resilience.config.checkpoint import CheckpointConfig
from slurm_resilience.config.container import ContainerConfig
from slurm_resilience.config.detect import DetectConfig
from slurm_resilience.config.job import JobConfig
from slurm_resilience.config.load import ResilienceConfig, config_to_dict, load_config
from slurm_resilience.config.reconnect import ReconnectConfig
from slurm_resilience.config.recovery import RecoveryConfig
from slurm_resilience.config.run import RunConfig

__all__ = [
    "JobConfig",
    "DetectConfig",
    "RecoveryConfig",
    "ReconnectConfig",
    "CheckpointConfig",
    "ContainerConfig",
    "RunConfig",
    "ResilienceConfig",
    "load_config",
    "config_to_dict",
]
