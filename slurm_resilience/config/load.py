"""All sections together (``ResilienceConfig``) and YAML in: ``load_config``, ``config_to_dict``.

Unknown sections/keys and wrong types are ``ConfigError``s whose one-line
message names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from slurm_resilience.config.checkpoint import CheckpointConfig
from slurm_resilience.config.container import ContainerConfig
from slurm_resilience.config.detect import DetectConfig
from slurm_resilience.config.io import check_type, read_source
from slurm_resilience.config.job import JobConfig
from slurm_resilience.config.reconnect import ReconnectConfig
from slurm_resilience.config.recovery import RecoveryConfig
from slurm_resilience.config.run import RunConfig
from slurm_resilience.config.timeouts import check_hierarchy
from slurm_resilience.errors import ConfigError

__all__ = ["ResilienceConfig", "RENAMED", "load_config", "config_to_dict"]


@dataclass(frozen=True, kw_only=True)
class ResilienceConfig:
    """All sections together; each component takes only its own section."""

    job: JobConfig = field(default_factory=JobConfig)
    detect: DetectConfig = field(default_factory=DetectConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    reconnect: ReconnectConfig = field(default_factory=ReconnectConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    container: ContainerConfig = field(default_factory=ContainerConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def __post_init__(self) -> None:
        check_hierarchy(self)  # the order the timeouts must have (docs/timeouts.md)


_SECTIONS: dict[str, type] = {
    "job": JobConfig,
    "detect": DetectConfig,
    "recovery": RecoveryConfig,
    "reconnect": ReconnectConfig,
    "checkpoint": CheckpointConfig,
    "container": ContainerConfig,
    "run": RunConfig,
}


# Keys that changed name (one word, one meaning: a "restart" of the supervisor by the
# keeper is a respawn; fault retries and requeues have their own names).
RENAMED = {"job.supervisor_restarts": "job.supervisor_respawns"}


def _build_section(name: str, raw: Any, origin: str) -> Any:
    cls = _SECTIONS[name]
    if raw is None:
        raw = {}
    if not isinstance(raw, Mapping):
        raise ConfigError(f"section '{name}' in {origin} must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    valid = [f.name for f in dataclasses.fields(cls)]
    kwargs = {}
    for key, value in raw.items():
        if f"{name}.{key}" in RENAMED:
            raise ConfigError(f"'{name}.{key}' in {origin} was renamed '{RENAMED[name + '.' + key]}': "
                              "use the new name")
        if key not in valid:
            raise ConfigError(f"unknown key '{name}.{key}' in {origin}; valid keys: {', '.join(valid)}")
        kwargs[key] = check_type(f"{name}.{key}", value, hints[key])
    return cls(**kwargs)


def load_config(
    source: str | os.PathLike | Mapping | None = None,
    overrides: Mapping[str, Mapping] | None = None,
) -> ResilienceConfig:
    """Load a YAML file (or a mapping) and apply ``overrides`` per section.

    Raises:
        ConfigError: missing file, bad YAML, unknown section/key, wrong type,
            or a value that fails a component's checks.
    """
    doc, origin = read_source(source, _SECTIONS)
    merged: dict[str, dict] = {}
    for layer, where in ((doc, origin), (overrides or {}, "overrides")):
        for name, section in layer.items():
            if name not in _SECTIONS:
                raise ConfigError(f"unknown section '{name}' in {where}; valid sections: {', '.join(_SECTIONS)}")
            if section is not None and not isinstance(section, Mapping):
                raise ConfigError(f"section '{name}' in {where} must be a mapping, got {section!r}")
            merged.setdefault(name, {}).update(section or {})
    return ResilienceConfig(**{name: _build_section(name, merged.get(name), origin) for name in _SECTIONS})


def config_to_dict(cfg: ResilienceConfig) -> dict[str, dict[str, Any]]:
    """Plain nested dict (lists, not tuples: YAML-safe); ``load_config(config_to_dict(cfg)) == cfg``."""
    return {name: {k: list(v) if isinstance(v, tuple) else v for k, v in dataclasses.asdict(getattr(cfg, name)).items()}
            for name in _SECTIONS}
