"""Checkpoint tiers as data, and the pure choice of which tiers save at a step.

A tier is a :class:`TierSpec`: where it stores (``memory`` = host RAM, ``local`` =
node-local disk, ``shared`` = the parallel filesystem), how often, with what
redundancy and how many checkpoints it keeps. The usual three levels::

    L0  memory  every 10 steps                    (process failure)
    L1  local   every 10 steps, PARTNER or XOR    (one node lost)
    L2  shared  every 5th L1 checkpoint, drained  (anything else)

:func:`tier_for_step` picks the tiers for a step (SCR's
``scr_reddesc_for_checkpoint``); ``intervals`` sizes an ``auto`` interval from
checkpoint cost and the mean time between failures.

Path templates may use ``{job_id}`` (Slurm job id), ``{run_id}`` (the run's own id,
``run_identity``: no other run repeats it), ``{node}`` (host name of the
rank), ``{rank}`` (global rank), ``{job_dir}`` (``job.job_dir`` of the config,
already expanded) and ``{user}`` (the user the process runs as: a node-local root
shared by several users' jobs is created 0700 by the first one, so a default path
names its user); ``layout.expand_path`` fills them in.
"""

from __future__ import annotations

import dataclasses
import enum
import string
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from slurm_resilience.errors import CheckpointError, ConfigError

from .layout import JOB_CHECKPOINTS
from .lustre import check_striping

__all__ = [
    "Redundancy",
    "TierSpec",
    "STORAGES",
    "PATH_PLACEHOLDERS",
    "tier_for_step",
    "base_tier",
    "parse_tiers",
    "check_tiers",
    "default_tiers",
]

STORAGES = ("memory", "local", "shared")
PATH_PLACEHOLDERS = ("job_id", "run_id", "node", "rank", "job_dir", "user")


class Redundancy(enum.Enum):
    """How a node-local tier survives the loss of a node.

    NONE: a shard lives only on its own node; losing the node loses it.
    PARTNER: a full copy of each rank's shard on the next node's disk
        (:func:`~slurm_resilience.checkpoint.redundancy.partner_of`); costs one
        extra shard per rank, survives any single node loss (and any set of lost
        nodes that never contains both a rank's node and its partner's).
    XOR: parity over a group of ``group_size`` ranks on distinct nodes
        (:func:`~slurm_resilience.checkpoint.redundancy.xor_groups`); any one lost
        shard per group is rebuilt; costs about shard / (group_size - 1) per rank.
    """

    NONE = "none"
    PARTNER = "partner"
    XOR = "xor"


@dataclass(frozen=True, kw_only=True)
class TierSpec:
    """One checkpoint level.

    Fields:
        name: unique name, "L0", "L1", "L2" or any user name.
        storage: "memory" (host RAM), "local" (node-local disk) or "shared" (parallel FS).
        interval_steps: save when ``step % interval_steps == 0`` (>= 1).
        interval_s: save when this many seconds passed since this tier's last save (> 0).
        auto: interval in steps from Young/Daly (see :class:`IntervalEstimator`).
        redundancy: NONE, PARTNER or XOR; anything but NONE only for storage "local".
        group_size: ranks per XOR group (>= 2).
        keep: checkpoints kept by retention (>= 1).
        keep_every: shared tiers only: also keep every checkpoint whose step is a
            multiple of this (>= 1), beyond ``keep``.
        path: directory template (placeholders in :data:`PATH_PLACEHOLDERS`);
            required for "local" and "shared", absent for "memory".
        every_kth: shared tiers only: drain every K-th checkpoint of the base tier
            (see :func:`base_tier`, :func:`tier_for_step`).
        stripe_count: shared tiers on Lustre only: each new step directory is striped
            over this many OSTs (``lfs setstripe -c``; -1: all, 0: leave the
            filesystem's default layout). See ``lustre``.
        stripe_size: shared tiers on Lustre only: stripe size (``lfs setstripe -S``),
            e.g. "4M": a multiple of 64K below 4G.

    Exactly one of interval_steps, interval_s, auto, every_kth is set.
    """

    name: str
    storage: str
    interval_steps: int | None = None
    interval_s: float | None = None
    auto: bool = False
    redundancy: Redundancy = Redundancy.NONE
    group_size: int = 4
    keep: int = 2
    keep_every: int | None = None
    path: str | None = None
    every_kth: int | None = None
    stripe_count: int = 4
    stripe_size: str = "4M"

    def __post_init__(self) -> None:
        where = f"tier {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"tier name {self.name!r} must be a non-empty string such as 'L1'")
        if self.storage not in STORAGES:
            raise ConfigError(f"{where}: storage={self.storage!r} must be one of {', '.join(STORAGES)}")
        chosen = [k for k in ("interval_steps", "interval_s", "every_kth") if getattr(self, k) is not None]
        chosen += ["auto"] if self.auto else []
        if len(chosen) != 1:
            got = ", ".join(chosen) if chosen else "none"
            raise ConfigError(
                f"{where}: set exactly one of interval_steps, interval_s, auto, every_kth (got {got})"
            )
        if self.interval_steps is not None and self.interval_steps < 1:
            raise ConfigError(f"{where}: interval_steps={self.interval_steps} must be >= 1")
        if self.interval_s is not None and not self.interval_s > 0:
            raise ConfigError(f"{where}: interval_s={self.interval_s} must be > 0")
        if self.every_kth is not None and self.storage != "shared":
            raise ConfigError(f"{where}: every_kth is for shared tiers only (storage is {self.storage!r})")
        if self.every_kth is not None and self.every_kth < 1:
            raise ConfigError(f"{where}: every_kth={self.every_kth} must be >= 1")
        if not isinstance(self.redundancy, Redundancy):
            raise ConfigError(f"{where}: redundancy={self.redundancy!r} must be a Redundancy (none, partner, xor)")
        if self.redundancy is not Redundancy.NONE and self.storage != "local":
            raise ConfigError(
                f"{where}: redundancy={self.redundancy.value} needs storage 'local' (storage is {self.storage!r})"
            )
        if self.group_size < 2:
            raise ConfigError(f"{where}: group_size={self.group_size} must be >= 2")
        if self.keep < 1:
            raise ConfigError(f"{where}: keep={self.keep} must be >= 1: keep at least one checkpoint")
        if self.keep_every is not None and self.storage != "shared":
            raise ConfigError(f"{where}: keep_every is for shared tiers only (storage is {self.storage!r})")
        if self.keep_every is not None and self.keep_every < 1:
            raise ConfigError(f"{where}: keep_every={self.keep_every} must be >= 1")
        if self.storage == "memory" and self.path is not None:
            raise ConfigError(f"{where}: a memory tier has no path (got {self.path!r}): remove it")
        if self.storage != "memory":
            if not self.path:
                raise ConfigError(f"{where}: storage {self.storage!r} needs a path such as '/tmp/ckpt/{{job_id}}'")
            _check_template(where, self.path)
        check_striping(f"{where}: ", self.stripe_count, self.stripe_size)


def _check_template(where: str, template: str) -> None:
    try:
        fields = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as exc:
        raise ConfigError(f"{where}: path {template!r} is not a valid template: {exc}") from None
    for f in fields:
        if f not in PATH_PLACEHOLDERS:
            raise ConfigError(
                f"{where}: path placeholder {{{f}}} is unknown; valid: "
                + ", ".join("{" + p + "}" for p in PATH_PLACEHOLDERS)
            )


def base_tier(specs: Sequence[TierSpec]) -> TierSpec | None:
    """The tier an ``every_kth`` tier drains: the first "local" tier, else the first "memory" one."""
    for storage in ("local", "memory"):
        for s in specs:
            if s.storage == storage:
                return s
    return None


def tier_for_step(
    specs: Sequence[TierSpec],
    step: int,
    *,
    now: float,
    last_saved: Mapping[str, tuple[int, float]],
    auto_interval_steps: Mapping[str, int] | None = None,
    save_counts: Mapping[str, int] | None = None,
) -> list[str]:
    """Names of the tiers that take a checkpoint at ``step``, in ``specs`` order. Pure.

    Rules per tier:
        interval_steps=N: ``step % N == 0``.
        interval_s=T: ``now - t >= T`` with ``(_, t) = last_saved[name]``; a tier never
            saved is due (seed ``last_saved`` with the start to delay it).
        auto: ``step - s >= auto_interval_steps[name]`` with ``(s, _) = last_saved[name]``
            (``s = 0`` when never saved).
        every_kth=K: drains when the base tier (:func:`base_tier`) saves at this step
            and the number of base-tier checkpoints so far, including this one
            (``save_counts[base] + 1``; missing counts are 0), is a multiple of K.

    Raises:
        CheckpointError: an auto tier has no entry in ``auto_interval_steps``, or an
            every_kth tier has no base tier.
    """
    autos = auto_interval_steps or {}
    counts = save_counts or {}
    due = [s.name for s in specs if s.every_kth is None and _due(s, step, now, last_saved, autos)]
    base = base_tier(specs)
    for s in specs:
        if s.every_kth is None:
            continue
        if base is None:
            raise CheckpointError(
                f"tier {s.name!r} drains every {s.every_kth} checkpoints but no local/memory tier exists"
            )
        if base.name in due and (counts.get(base.name, 0) + 1) % s.every_kth == 0:
            due.append(s.name)
    return [s.name for s in specs if s.name in due]


def _due(
    spec: TierSpec, step: int, now: float, last: Mapping[str, tuple[int, float]], autos: Mapping[str, int]
) -> bool:
    if spec.interval_steps is not None:
        return step % spec.interval_steps == 0
    if spec.interval_s is not None:
        return spec.name not in last or now - last[spec.name][1] >= spec.interval_s
    if spec.name not in autos:
        raise CheckpointError(
            f"tier {spec.name!r} is auto but auto_interval_steps has no entry for it:"
            " pass IntervalEstimator.interval_steps()"
        )
    return step - last.get(spec.name, (0, 0.0))[0] >= autos[spec.name]


_FIELDS = {f.name: f for f in dataclasses.fields(TierSpec)}
_INT_KEYS = ("interval_steps", "group_size", "keep", "keep_every", "every_kth", "stripe_count")
_OPTIONAL = ("interval_steps", "interval_s", "keep_every", "path", "every_kth")


def parse_tiers(raw: Sequence[Mapping[str, Any]]) -> tuple[TierSpec, ...]:
    """Tiers from YAML-like mappings (redundancy as "none" | "partner" | "xor").

    Raises:
        ConfigError: not a list of mappings, unknown key (valid keys listed), missing
            name/storage, wrong type, bad storage, duplicate names, redundancy on a
            non-local tier, every_kth without a base tier, or any TierSpec check.
    """
    if isinstance(raw, (str, bytes)) or not isinstance(raw, Sequence):
        raise ConfigError(f"tiers must be a list of mappings, got {type(raw).__name__}")
    specs = tuple(_parse_one(i, item) for i, item in enumerate(raw))
    check_tiers(specs)
    return specs


def _parse_one(i: int, item: Any) -> TierSpec:
    where = f"tiers[{i}]"
    if not isinstance(item, Mapping):
        raise ConfigError(f"{where} must be a mapping, got {item!r}")
    for key in item:
        if key not in _FIELDS:
            raise ConfigError(f"unknown key '{where}.{key}'; valid keys: {', '.join(_FIELDS)}")
    for key in ("name", "storage"):
        if key not in item:
            raise ConfigError(f"{where} needs '{key}'")
    kw: dict[str, Any] = {}
    for key, value in item.items():
        if value is None and key in _OPTIONAL:
            kw[key] = None
        elif key in _INT_KEYS:
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"{where}.{key} must be an integer, got {value!r}")
            kw[key] = value
        elif key == "interval_s":
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"{where}.interval_s must be a number, got {value!r}")
            kw[key] = float(value)
        elif key == "auto":
            if not isinstance(value, bool):
                raise ConfigError(f"{where}.auto must be true or false, got {value!r}")
            kw[key] = value
        elif key == "redundancy":
            kw[key] = _redundancy(where, value)
        else:
            if not isinstance(value, str):
                raise ConfigError(f"{where}.{key} must be a string, got {value!r}")
            kw[key] = value
    return TierSpec(**kw)


def _redundancy(where: str, value: Any) -> Redundancy:
    if isinstance(value, Redundancy):
        return value
    valid = ", ".join(r.value for r in Redundancy)
    if not isinstance(value, str) or value.lower() not in {r.value for r in Redundancy}:
        raise ConfigError(f"{where}.redundancy={value!r} must be one of {valid}")
    return Redundancy(value.lower())


def check_tiers(specs: Sequence[TierSpec]) -> None:
    """Cross-tier checks: unique names, every_kth tiers have a base tier.

    Raises:
        ConfigError: a duplicate name or an every_kth tier with nothing to drain.
    """
    seen: set[str] = set()
    for s in specs:
        if s.name in seen:
            raise ConfigError(f"duplicate tier name {s.name!r}: tier names must be unique")
        seen.add(s.name)
    if base_tier(specs) is None:
        for s in specs:
            if s.every_kth is not None:
                raise ConfigError(
                    f"tier {s.name!r}: every_kth drains a local or memory tier, but none is configured"
                )


def default_tiers() -> tuple[TierSpec, ...]:
    """L0 memory every 10 steps; L1 local every 10 steps with PARTNER; L2 shared every 5th L1, keep 2."""
    return (
        TierSpec(name="L0", storage="memory", interval_steps=10),
        TierSpec(
            name="L1",
            storage="local",
            interval_steps=10,
            redundancy=Redundancy.PARTNER,
            path="/tmp/slurm_resilience-{user}/{job_id}/{run_id}/{node}/ckpt",
        ),
        TierSpec(name="L2", storage="shared", every_kth=5, path="{job_dir}/" + JOB_CHECKPOINTS, keep=2),
    )
