"""Checkpoint tiers as data, and the pure choice of which tiers save at a step.

A tier is a :class:`TierSpec`: where it stores (``memory`` = host RAM, ``local`` =
node-local disk, ``shared`` = the parallel filesystem), how often, with what
redundancy and how many checkpoints it keeps. The usual three levels::

    L0  memory  every 10 steps                    (process failure)
    L1  local   every 10 steps, PARTNER or XOR    (one node lost)
    L2  shared  every 5th L1 checkpoint, drained  (anything else)

:func:`tier_for_step` picks the tiers for a step (SCR's
``scr_reddesc_for_checkpoint``); :func:`young_daly_interval`, :func:`daly_interval`
and :class:`IntervalEstimator` size an ``auto`` interval from checkpoint cost and
the mean time between failures.

Path templates may use ``{job_id}`` (Slurm job id), ``{node}`` (host name of the
rank), ``{rank}`` (global rank) and ``{job_dir}`` (``job.job_dir`` of the config,
already expanded); :func:`expand_path` fills them in.
"""

from __future__ import annotations

import dataclasses
import enum
import math
import string
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from slurm_resilience.errors import CheckpointError, ConfigError

__all__ = [
    "Redundancy",
    "TierSpec",
    "STORAGES",
    "PATH_PLACEHOLDERS",
    "tier_for_step",
    "base_tier",
    "young_daly_interval",
    "daly_interval",
    "auto_steps",
    "IntervalEstimator",
    "parse_tiers",
    "check_tiers",
    "default_tiers",
    "expand_path",
]

STORAGES = ("memory", "local", "shared")
PATH_PLACEHOLDERS = ("job_id", "node", "rank", "job_dir")


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


def expand_path(spec: TierSpec, **values: Any) -> str:
    """Fill the placeholders of ``spec.path`` from ``values`` (job_id, node, rank, job_dir).

    Raises:
        ConfigError: the tier has no path or a placeholder it uses is not given.
    """
    if spec.path is None:
        raise ConfigError(f"tier {spec.name!r}: storage {spec.storage!r} has no path to expand")
    try:
        return spec.path.format_map(values)
    except KeyError as exc:
        raise ConfigError(f"tier {spec.name!r}: path {spec.path!r} needs a value for {{{exc.args[0]}}}") from None


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


def young_daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum compute time between checkpoints: ``sqrt(2 C M)``.

    J. W. Young, "A first order approximation to the optimum checkpoint interval",
    CACM 17(9), 1974; C = checkpoint cost, M = mean time between failures (seconds).

    Raises:
        ConfigError: C < 0 or M <= 0.
    """
    _check_cost_mtbf(checkpoint_cost_s, mtbf_s)
    return math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)


def daly_interval(checkpoint_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum compute time between checkpoints.

    ``sqrt(2CM) * (1 + sqrt(C/(2M))/3 + C/(18M)) - C`` for ``C < 2M``, else ``M``.
    J. T. Daly, "A higher order estimate of the optimum checkpoint interval for
    restart dumps", FGCS 22(3), 2006.

    Raises:
        ConfigError: C < 0 or M <= 0.
    """
    _check_cost_mtbf(checkpoint_cost_s, mtbf_s)
    c, m = checkpoint_cost_s, mtbf_s
    if c >= 2.0 * m:
        return m
    return math.sqrt(2.0 * c * m) * (1.0 + math.sqrt(c / (2.0 * m)) / 3.0 + c / (18.0 * m)) - c


def auto_steps(cost_s: float, mtbf_s: float, step_time_s: float) -> int:
    """Daly's interval in whole training steps (rounded down, at least 1).

    Raises:
        ConfigError: cost < 0, mtbf <= 0 or step_time <= 0.
    """
    if not step_time_s > 0:
        raise ConfigError(f"step_time_s={step_time_s} must be > 0")
    return max(1, int(daly_interval(cost_s, mtbf_s) // step_time_s))


def _check_cost_mtbf(cost: float, mtbf: float) -> None:
    if not cost >= 0:
        raise ConfigError(f"checkpoint cost {cost} s must be >= 0")
    if not mtbf > 0:
        raise ConfigError(f"mtbf {mtbf} s must be > 0")


class IntervalEstimator:
    """Online ``auto`` interval: EWMA of checkpoint cost and step time, observed MTBF.

    MTBF is ``elapsed / failures`` (elapsed since construction, by the injected
    clock) once at least two failures were observed, else the configured
    ``mtbf_s``. Until one checkpoint and one step were observed,
    :meth:`interval_steps` returns ``initial_steps``. Deterministic given the clock.
    """

    def __init__(
        self,
        *,
        mtbf_s: float,
        initial_steps: int = 100,
        alpha: float = 0.3,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Raises: ConfigError: mtbf_s <= 0, initial_steps < 1 or alpha outside (0, 1]."""
        if not mtbf_s > 0:
            raise ConfigError(f"mtbf_s={mtbf_s} must be > 0")
        if initial_steps < 1:
            raise ConfigError(f"initial_steps={initial_steps} must be >= 1")
        if not 0 < alpha <= 1:
            raise ConfigError(f"alpha={alpha} must be in (0, 1]")
        self._mtbf_s = mtbf_s
        self._initial = initial_steps
        self._alpha = alpha
        self._clock = clock
        self._start = clock()
        self._cost: float | None = None
        self._step: float | None = None
        self._failures: list[float] = []

    def _ewma(self, old: float | None, x: float) -> float:
        return x if old is None else self._alpha * x + (1 - self._alpha) * old

    def observe_checkpoint(self, cost_s: float) -> None:
        """Record the blocking cost of one checkpoint (seconds, >= 0)."""
        if not cost_s >= 0:
            raise ConfigError(f"checkpoint cost {cost_s} s must be >= 0")
        self._cost = self._ewma(self._cost, cost_s)

    def observe_step(self, duration_s: float) -> None:
        """Record the duration of one training step (seconds, > 0)."""
        if not duration_s > 0:
            raise ConfigError(f"step duration {duration_s} s must be > 0")
        self._step = self._ewma(self._step, duration_s)

    def observe_failure(self, t: float | None = None) -> None:
        """Record a failure at clock time ``t`` (default: now)."""
        self._failures.append(self._clock() if t is None else t)

    def mtbf_s(self) -> float:
        """Observed MTBF after >= 2 failures, else the configured one."""
        if len(self._failures) < 2:
            return self._mtbf_s
        elapsed = max(self._clock(), self._failures[-1]) - self._start
        return max(elapsed, 1e-9) / len(self._failures)

    def interval_steps(self) -> int:
        """Steps between checkpoints per :func:`auto_steps` (>= 1)."""
        if self._cost is None or self._step is None:
            return self._initial
        return auto_steps(self._cost, self.mtbf_s(), self._step)


_FIELDS = {f.name: f for f in dataclasses.fields(TierSpec)}
_INT_KEYS = ("interval_steps", "group_size", "keep", "keep_every", "every_kth")
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
            path="/tmp/slurm_resilience/{job_id}/{node}/ckpt",
        ),
        TierSpec(name="L2", storage="shared", every_kth=5, path="{job_dir}/checkpoints", keep=2),
    )
