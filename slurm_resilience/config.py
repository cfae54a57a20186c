"""Per-component configuration: frozen keyword-only dataclasses, YAML in one place.

Each section of the YAML file maps to one dataclass::

    job:       {nodes: 4, spares: 1}
    detect:    {heartbeat_period_s: 0.25}
    recovery:  {...}
    reconnect: {...}
    checkpoint: {...}
    container: {runtime: podman, image: ...}
    run:       {warm: true, preload: [numpy]}

Unknown sections/keys and wrong types are ``ConfigError``s whose one-line
message names the key and the fix.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping

from slurm_resilience.config_container import ContainerConfig
from slurm_resilience.config_detect import DetectConfig
from slurm_resilience.config_io import check_type, read_source
from slurm_resilience.config_job import JobConfig
from slurm_resilience.config_run import RunConfig
from slurm_resilience.errors import ConfigError

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

# What ``recovery.isolate_state`` may say (see RecoveryConfig).
ISOLATE_STATES = ("auto", "none", "DRAIN", "DOWN")


@dataclass(frozen=True, kw_only=True)
class RecoveryConfig:
    """Recovery policy.

    Fields:
        online_timeout_s: how long a replacement rank may take to come online (> 0).
        fault_retry_times: process faults on healthy nodes this job may answer by restarting
            processes in place (online or a relaunch), counted per job (>= 0); past it a
            process fault is treated as a node fault.
        isolate_state: Slurm state given to a bad node: ``auto`` (DOWN when this user
            may change node states, i.e. is root, Slurm's SlurmUser or has AdminLevel
            Operator/Administrator; else none), ``none`` (never touch node states:
            release the node from the job, exclude it from a requeue, report it),
            DRAIN or DOWN (needs operator rights; a refusal is an event, not fatal).
        isolate_hook: a site command run once per isolated node (an argv list, no
            shell), e.g. a script that files a ticket; the node, its reason and the
            job id follow as the last three arguments. Empty: none.
        isolate_hook_timeout_s: how long the hook may run before it is killed (> 0).
        fallback_relaunch: when online recovery fails, relaunch every rank on healthy
            nodes from the node-local snapshots.
        fallback_timeout_s: how long that relaunch may take to train a step (> 0).
        scale_in: with no spare left, continue with fewer ranks.
        migrate_stragglers: replace a persistently slow rank's node with a spare
            at the next safe point (no step lost).
        min_world_size: never scale in below this many ranks (>= 1).
        health_check: a command (argv list, no shell) run on every spare node, with the
            built-in checks, before it may be adopted; it must exit 0 (empty: none).
        health_check_timeout_s: how long the checks may take on a node (> 0).
        spare_check_max_age_s: a spare whose last passed check is older is checked again
            (> 0); at adoption, in parallel with the recovery.
        max_requeues: job-level requeues (``scontrol requeue``) allowed, counted by
            ``SLURM_RESTART_COUNT`` (>= 0; the sbatch template sets ``--requeue``).
        requeue_by: ``requeue`` (``scontrol requeue``: same job id, Slurm holds it
            ~cred_expire s) or ``resubmit`` (the same job.sbatch as a new job id, the job dir
            and checkpoints kept; docs/recovery-ladder.md, "Requeue or resubmit").
        local_standbys: online mode: one warm standby (the program, imported up to
            ``Session()``) on every worker node; a rank restarted in place adopts it
            instead of a cold process, and a new one starts once the recovery is done.
        local_standbys_per_node: how many such standbys each node keeps: an integer >= 1
            (at most ``job.tasks_per_node`` are used) or ``"all"`` (= ``job.tasks_per_node``,
            so a process restart adopts a standby for every slot); every spare node keeps
            as many on top of its G, which become its node's own when it joins the table.
    """

    online_timeout_s: float = 30.0
    fallback_timeout_s: float = 120.0
    fault_retry_times: int = 3
    isolate_state: str = "auto"
    isolate_hook: tuple[str, ...] = ()
    isolate_hook_timeout_s: float = 30.0
    fallback_relaunch: bool = True
    scale_in: bool = True
    min_world_size: int = 1
    max_requeues: int = 1
    requeue_by: str = "requeue"
    migrate_stragglers: bool = False
    health_check: tuple[str, ...] = ()
    health_check_timeout_s: float = 30.0
    spare_check_max_age_s: float = 300.0
    local_standbys: bool = True
    local_standbys_per_node: int | str = 1

    def __post_init__(self) -> None:
        for name in ("online_timeout_s", "fallback_timeout_s", "health_check_timeout_s", "spare_check_max_age_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"recovery.{name}={getattr(self, name)} must be > 0")
        if self.min_world_size < 1:
            raise ConfigError(f"recovery.min_world_size={self.min_world_size} must be >= 1")
        if self.max_requeues < 0:
            raise ConfigError(f"recovery.max_requeues={self.max_requeues} must be >= 0: use 0 to never requeue")
        if self.requeue_by not in ("requeue", "resubmit"):
            raise ConfigError(f"recovery.requeue_by={self.requeue_by!r} must be requeue or resubmit")
        if self.fault_retry_times < 0:
            raise ConfigError(
                f"recovery.fault_retry_times={self.fault_retry_times} must be >= 0: use 0 to never restart in place"
            )
        if self.isolate_state not in ISOLATE_STATES:
            raise ConfigError(f"recovery.isolate_state={self.isolate_state!r} must be one of "
                              f"{', '.join(ISOLATE_STATES)}")
        if self.isolate_hook_timeout_s <= 0:
            raise ConfigError(f"recovery.isolate_hook_timeout_s={self.isolate_hook_timeout_s} must be > 0")
        per = self.local_standbys_per_node
        if per != "all" and (isinstance(per, str) or per < 1):
            raise ConfigError(f"recovery.local_standbys_per_node={per!r} must be an integer >= 1 or \"all\" "
                              "(one per slot of the node)")
        if self.isolate_hook and not self.isolate_hook[0]:
            raise ConfigError("recovery.isolate_hook starts with an empty string: the first item is the program")


@dataclass(frozen=True, kw_only=True)
class ReconnectConfig:
    """Rebuilding process groups after a rank table change.

    Fields:
        backend: auto (nccl with GPUs, else gloo), gloo or nccl.
        pg_timeout_s: process-group timeout (> 0).
        poll_interval_ms: store polling interval while waiting for peers (> 0).
        gloo_ifname: network interface for gloo (GLOO_SOCKET_IFNAME), or None.
        nccl_heartbeat_timeout_s: ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` given to the ranks
            (unless set in the environment): NCCL's monitor kills a process whose NCCL
            watchdog is stuck this long (> pg_timeout_s).
    """

    backend: str = "auto"
    pg_timeout_s: float = 30.0
    poll_interval_ms: float = 20.0
    gloo_ifname: str | None = None
    nccl_heartbeat_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"reconnect.backend={self.backend!r} must be one of auto, gloo, nccl")
        if self.pg_timeout_s <= 0:
            raise ConfigError(f"reconnect.pg_timeout_s={self.pg_timeout_s} must be > 0")
        if self.poll_interval_ms <= 0:
            raise ConfigError(f"reconnect.poll_interval_ms={self.poll_interval_ms} must be > 0")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Multi-level checkpoints (L0 host memory, L1 node-local, L2 shared filesystem).

    Fields:
        memory_every: L0 host-memory copy every N steps (0: off).
        local_every: L1 node-local checkpoint every N steps (0: off).
        local_auto: size the L1 interval by Young/Daly from the measured checkpoint
            cost and ``mtbf_s`` (overrides ``local_every``).
        local_dir: node-local directory; ``{job_id}``, ``{run_id}``, ``{node}``, ``{rank}``,
            ``{job_dir}``, ``{user}``. With ``{run_id}`` after ``{job_id}`` every run has a
            directory of its own, and ended runs' are removed (``checkpoint/clean.py``).
        local_redundancy: ``partner`` (a copy on the next node), ``xor`` (parity over
            groups of ``local_xor_group_size`` nodes: one lost node per group is
            rebuilt), or ``none``.
        local_keep: L1 checkpoints kept (>= 1).
        local_min_free_gb: a spare whose node-local directory has less free space is not
            adopted (>= 0).
        shared_every_kth: L2 drains every K-th L1 checkpoint (0: off).
        shared_dir: shared-filesystem directory (Lustre or any shared path).
        shared_keep: L2 checkpoints kept (>= 1); ``shared_keep_every``: also every M-th step.
        lustre_stripe_count: when ``shared_dir`` is on Lustre (mount table), each new L2
            step directory is striped over this many OSTs (``lfs setstripe -c``): -1 all,
            0 leave the filesystem's default layout, else 1..2000. Ignored elsewhere.
        lustre_stripe_size: Lustre stripe size (``lfs setstripe -S``), e.g. ``"4M"``;
            a multiple of 64K below 4G.
        mtbf_s: mean time between failures assumed until failures are observed.
        init_from: a DCP checkpoint directory (``ckpt export --format dcp`` or any
            ``torch.distributed.checkpoint.save``) the job starts from while it has no
            checkpoint of its own; its top-level keys are the registered object names
            (``worker/statesync.py``). Empty: start from the script's own step-0 state.
        adopt_legacy: restore checkpoints whose manifest names no run (written before
            run ids); off, they are another run's and ignored (``checkpoint/ownership.py``).
    """

    memory_every: int = 10
    local_every: int = 10
    local_auto: bool = False
    local_dir: str = "/tmp/slurm_resilience-{user}/{job_id}/{run_id}/{node}/ckpt"
    local_redundancy: str = "partner"
    local_xor_group_size: int = 4
    local_keep: int = 2
    local_min_free_gb: float = 1.0
    shared_every_kth: int = 5
    shared_dir: str = "{job_dir}/checkpoints"
    shared_keep: int = 2
    shared_keep_every: int = 0
    lustre_stripe_count: int = 4
    lustre_stripe_size: str = "4M"
    mtbf_s: float = 86400.0
    init_from: str = ""
    adopt_legacy: bool = False

    def __post_init__(self) -> None:
        for name in ("memory_every", "local_every", "shared_every_kth", "shared_keep_every", "local_min_free_gb"):
            if getattr(self, name) < 0:
                raise ConfigError(f"checkpoint.{name}={getattr(self, name)} must be >= 0 (0 turns it off)")
        for name in ("local_keep", "shared_keep"):
            if getattr(self, name) < 1:
                raise ConfigError(f"checkpoint.{name}={getattr(self, name)} must be >= 1")
        if self.local_redundancy not in ("none", "partner", "xor"):
            raise ConfigError(f"checkpoint.local_redundancy={self.local_redundancy!r} must be 'none', "
                              "'partner' or 'xor'")
        if self.local_xor_group_size < 2:
            raise ConfigError(f"checkpoint.local_xor_group_size={self.local_xor_group_size} must be >= 2 "
                              "(parity over a group of at least two nodes)")
        if self.shared_every_kth and not (self.local_every or self.local_auto):
            raise ConfigError("checkpoint.shared_every_kth drains L1 checkpoints: set local_every or local_auto")
        if self.mtbf_s <= 0:
            raise ConfigError(f"checkpoint.mtbf_s={self.mtbf_s} must be > 0")
        if self.init_from and not os.path.isabs(self.init_from):
            raise ConfigError(f"checkpoint.init_from={self.init_from!r} must be an absolute path "
                              "(every rank reads it, from its own working directory)")
        from .checkpoint.lustre import check_striping

        check_striping("checkpoint.lustre_", self.lustre_stripe_count, self.lustre_stripe_size)

    def tiers(self):
        """The tier specs this section describes (see ``checkpoint/tiers.py``)."""
        from .checkpoint.tiers import Redundancy, TierSpec

        specs = []
        if self.memory_every:
            specs.append(TierSpec(name="L0", storage="memory", interval_steps=self.memory_every))
        if self.local_every or self.local_auto:
            specs.append(TierSpec(
                name="L1", storage="local", path=self.local_dir, keep=self.local_keep,
                redundancy=Redundancy(self.local_redundancy), group_size=self.local_xor_group_size,
                **({"auto": True} if self.local_auto else {"interval_steps": self.local_every})))
        if self.shared_every_kth:
            specs.append(TierSpec(name="L2", storage="shared", path=self.shared_dir,
                                  every_kth=self.shared_every_kth, keep=self.shared_keep,
                                  keep_every=self.shared_keep_every or None,
                                  stripe_count=self.lustre_stripe_count, stripe_size=self.lustre_stripe_size))
        return tuple(specs)


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
        from .config_timeouts import check_hierarchy

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
