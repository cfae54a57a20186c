"""The timeout hierarchy: the order the toolkit's timeouts must have, checked.

Each rule is a pair of values and the reason for their order (``docs/timeouts.md``
has the whole table, Slurm's and NCCL's timeouts included). ``check_hierarchy`` is
called when a configuration is built and raises the first broken rule as one line
naming both values; ``nccl_environ`` gives the ranks NCCL's watchdog settings
unless the user set them; ``slurm_warnings`` checks the two Slurm timeouts the
toolkit cannot change (read from ``scontrol show config``).
"""

from __future__ import annotations

import math
from typing import Mapping, Protocol

from slurm_resilience.config.detect import DetectConfig
from slurm_resilience.config.reconnect import ReconnectConfig
from slurm_resilience.config.recovery import RecoveryConfig
from slurm_resilience.errors import ConfigError

__all__ = ["check_hierarchy", "rules", "nccl_environ", "slurm_warnings", "timing_warnings", "NCCL_ASYNC_ERROR_HANDLING"]


class Sections(Protocol):
    """The three sections whose timeouts are ordered (a ``ResilienceConfig`` has them;
    named here by what is read, so this module needs only the sections' modules)."""

    @property
    def detect(self) -> DetectConfig: ...

    @property
    def recovery(self) -> RecoveryConfig: ...

    @property
    def reconnect(self) -> ReconnectConfig: ...

# CleanUpOnly: a timed-out NCCL collective aborts the communicator and its error reaches
# the rank's bounded wait (a StepAborted: the online path), the process is not torn down.
NCCL_ASYNC_ERROR_HANDLING = "2"


def rules(cfg: Sections) -> list[tuple[str, float, str, float, str]]:
    """(smaller name, value, larger name, value, why) for every pair that must be ordered."""
    d, r, c = cfg.detect, cfg.recovery, cfg.reconnect
    return [
        ("reconnect.poll_interval_ms/1000", c.poll_interval_ms / 1000, "detect.heartbeat_period_s",
         d.heartbeat_period_s, "a survivor must leave a broken collective (one wait slice) faster than a beat"),
        ("detect.heartbeat_timeout_s", d.heartbeat_timeout_s, "detect.progress_soft_s", d.progress_soft_s,
         "a stale heartbeat is a suspect before the step watchdog may call a rank slow"),
        ("detect.heartbeat_timeout_s", d.heartbeat_timeout_s, "detect.progress_block_s", d.block_floor_s,
         "a healthy rank may go quiet (GIL held, CPU starved) up to the heartbeat timeout; the job "
         "waiting on it must not make that a hang"),
        ("detect.progress_hard_s", d.progress_hard_s, "reconnect.pg_timeout_s", c.pg_timeout_s,
         "the watchdog must recover a hung rank before its peers' collectives time out on their own"),
        ("reconnect.pg_timeout_s", c.pg_timeout_s, "reconnect.nccl_heartbeat_timeout_s", c.nccl_heartbeat_timeout_s,
         "NCCL's monitor kills the process: it must come after the toolkit's own abort"),
    ]


def check_hierarchy(cfg: Sections) -> None:
    """Raise ConfigError naming the first two values out of order.

    Raises:
        ConfigError: a rule of :func:`rules` is broken, progress_soft_s or progress_block_s
            > progress_hard_s, or recovery.online_timeout_s > recovery.fallback_timeout_s.
    """
    for small, a, large, b, why in rules(cfg):
        if not a < b:
            raise ConfigError(f"{small}={a:g} must be < {large}={b:g}: {why}")
    d, r = cfg.detect, cfg.recovery
    if d.progress_soft_s > d.progress_hard_s:
        raise ConfigError(f"detect.progress_soft_s={d.progress_soft_s:g} must be <= "
                          f"detect.progress_hard_s={d.progress_hard_s:g}: a rank is reported slow before it is hung")
    if d.block_floor_s > d.progress_hard_s:
        raise ConfigError(f"detect.progress_block_s={d.block_floor_s:g} must be <= "
                          f"detect.progress_hard_s={d.progress_hard_s:g}: the job blocked on a rank is the "
                          "shortcut, not the longer wait")
    if r.online_timeout_s > r.fallback_timeout_s:
        raise ConfigError(f"recovery.online_timeout_s={r.online_timeout_s:g} must be <= "
                          f"recovery.fallback_timeout_s={r.fallback_timeout_s:g}: the fallback relaunches every "
                          "rank from the checkpoint tiers, more work than an online recovery")


def nccl_environ(c: ReconnectConfig, environ: Mapping[str, str]) -> dict[str, str]:
    """Pure: NCCL's watchdog variables for the ranks, except those the user set.

    Raises:
        ConfigError: the user's TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC is not above pg_timeout_s.
    """
    out = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ASYNC_ERROR_HANDLING,
           "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(math.ceil(c.nccl_heartbeat_timeout_s))}
    user = environ.get("TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC")
    if user is not None:
        try:
            value = float(user)
        except ValueError:
            raise ConfigError(f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={user!r} in the environment is not a number") from None
        if value <= c.pg_timeout_s:
            raise ConfigError(f"TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC={user} (environment) must be > "
                              f"reconnect.pg_timeout_s={c.pg_timeout_s:g}: NCCL's monitor would kill a rank "
                              "before the toolkit aborts its collective")
    return {k: v for k, v in out.items() if k not in environ}


def timing_warnings(cfg: Sections) -> list[str]:
    """Pure: lines about timeouts that are legal but race each other (never fatal).

    A survivor blocked inside a collective the toolkit does not own (DDP's backward, a
    user's ``all_reduce``) waits on a live peer that abandoned it: gloo cannot interrupt
    that call, so it returns only at ``reconnect.pg_timeout_s`` after it started (before
    the fault). An online recovery given no more than that times out although it would
    have succeeded, and the job falls back to relaunching every rank.
    """
    online, pg = cfg.recovery.online_timeout_s, cfg.reconnect.pg_timeout_s
    if online <= pg:
        return [f"recovery.online_timeout_s={online:g} is not above reconnect.pg_timeout_s={pg:g}: a survivor "
                "blocked in a collective of its own loop (DDP) is released only by the group timeout, so an "
                "online recovery may time out and fall back to a relaunch"]
    return []


def slurm_warnings(cfg: Sections, *, slurmd_timeout_s: float | None,
                   kill_wait_s: float | None) -> list[str]:
    """Pure: lines about Slurm's timeouts (the site's, not the user's to change).

    SlurmdTimeout: Slurm marks a silent node DOWN after it; the toolkit should have
    replaced the node by then (``detect.heartbeat_timeout_s`` below it), otherwise
    Slurm's own reaction races the recovery. KillWait: a hung rank that ignores
    SIGTERM is SIGKILLed this long after a step cancel; a relaunch in place does not
    wait on it, but the online recovery of its node must outlast it.
    """
    out = []
    hb = cfg.detect.heartbeat_timeout_s
    if slurmd_timeout_s is not None and slurmd_timeout_s <= hb:
        out.append(f"SlurmdTimeout={slurmd_timeout_s:g} is not above detect.heartbeat_timeout_s={hb:g}: Slurm may "
                   "mark a silent node DOWN before the toolkit replaces it")
    online = cfg.recovery.online_timeout_s
    if kill_wait_s is not None and kill_wait_s >= online:
        out.append(f"KillWait={kill_wait_s:g} is not below recovery.online_timeout_s={online:g}: a cancelled hung "
                   "step may outlive the online recovery's deadline")
    return out
