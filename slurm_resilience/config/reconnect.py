"""The ``reconnect`` section: rebuilding process groups after a rank table change."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_resilience.errors import ConfigError

__all__ = ["ReconnectConfig"]


@dataclass(frozen=True, kw_only=True)
class ReconnectConfig:
    """Rebuilding process groups after a rank table change.

    Fields:
        backend: auto (nccl with GPUs, else gloo), gloo or nccl.
        pg_timeout_s: process-group timeout (> 0).
        poll_interval_ms: how often a waiting rank looks for a newer plan (its page; the store by
            ``worker/plan_watch.look``) and its peers (> 0).
        gloo_ifname: network interface for gloo (GLOO_SOCKET_IFNAME), or None.
        gloo_lazy_init: gloo groups connect a pair of ranks when a collective first uses it
            (``TORCH_GLOO_LAZY_INIT``), not every pair while the group forms: a ring
            all-reduce then opens 2 connections a rank, not N - 1, and a rebuilt group is
            joined without waiting for the whole mesh.
        nccl_heartbeat_timeout_s: ``TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC`` given to the ranks
            (unless set in the environment): NCCL's monitor kills a process whose NCCL
            watchdog is stuck this long (> pg_timeout_s).
    """

    backend: str = "auto"
    pg_timeout_s: float = 30.0
    poll_interval_ms: float = 20.0
    gloo_ifname: str | None = None
    gloo_lazy_init: bool = True
    nccl_heartbeat_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"reconnect.backend={self.backend!r} must be one of auto, gloo, nccl")
        if self.pg_timeout_s <= 0:
            raise ConfigError(f"reconnect.pg_timeout_s={self.pg_timeout_s} must be > 0")
        if self.poll_interval_ms <= 0:
            raise ConfigError(f"reconnect.poll_interval_ms={self.poll_interval_ms} must be > 0")
