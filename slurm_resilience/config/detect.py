"""The ``detect`` section: how faults are noticed (heartbeats, probes, the watchdog).

Split from :mod:`slurm_resilience.config` (which reads the YAML and holds the other
sections), like :mod:`slurm_resilience.config.job`.
"""

from __future__ import annotations

from dataclasses import dataclass

from slurm_resilience.errors import ConfigError

__all__ = ["DetectConfig"]

NODE_SILENCE_S = 0.9  # the node-silence deadline's default
BLOCK_PER_STALE = 2.5  # the blocking timeout's default floor, in heartbeat timeouts


@dataclass(frozen=True, kw_only=True)
class DetectConfig:
    """Fault detection.

    Fields:
        heartbeat_period_s: how often each worker beats (0 < p <= 0.5).
        heartbeat_timeout_s: a rank is stale after this silence (> 2 * period).
        standby_heartbeat_timeout_s: a warm standby is stale after this silence (>= the rank
            timeout): it is idle and off the critical path, so a busy node starving its
            heartbeat thread must not cost a spare; a standby that is really hung does not
            pass the adoption (its node's check needs every standby connected).
        node_poll_s: how often Slurm node states are polled (> 0).
        probe_timeout_s: timeout of one slurmd reachability probe, a TCP connect (> 0).
        slurmd_probe_deadline_s: when every worker on a node is heartbeat-stale, its slurmd
            must answer a Slurm request (``sstat`` of a step there) within this, or the node
            is lost (> 0, < heartbeat_timeout_s). Asked off the loop; healthy answers take
            10-20 ms on the lab cluster, so the deadline is only spent on a silent node.
        node_silence_s: a node from which nothing has come for this long (no heartbeat of
            any of its ranks, no line of its pulse) while the job's other nodes are heard,
            and whose slurmd then does not answer within ``slurmd_probe_deadline_s``, is
            lost: found well before its heartbeats turn stale. The probe starts once the
            node has been quiet for ``node_silence_s - slurmd_probe_deadline_s`` (at least
            ``heartbeat_period_s``). 0 turns this off (then the heartbeat timeout decides);
            else > ``slurmd_probe_deadline_s`` and <= ``heartbeat_timeout_s``. Unset:
            0.9 s, at most ``heartbeat_timeout_s`` (off when that leaves no time for the
            probe). A link that flaps back before it is spent costs no recovery: a
            node quiet for up to ``node_silence_s - heartbeat_period_s - 0.15 s`` of
            cut (0.5 s at the defaults) is heard again in time (docs/timeouts.md).
        straggler_threshold: a rank whose own compute time exceeds this × the
            median of the others is slow (> 1).
        straggler_window: ... for this many consecutive heartbeat checks (>= 1).
        headless_timeout_s: a rank that has lost the job's store (and with it the
            supervisor: the batch host is gone) for this long persists its newest state
            to the shared tier and requeues the job (``worker/headless.py``); 0 turns
            this off (> heartbeat_timeout_s, or 0).
        pulse: start a pulse process per rank (``worker/pulse.py``): it reports the rank's
            process state and progress whatever its interpreter does, so a starved
            heartbeat is a suspect, not a hang. Off: stale heartbeats alone decide.
        progress_soft_s: floor of the soft step timeout: a rank without progress this long
            is reported (``progress_slow``) (> heartbeat_timeout_s).
        progress_hard_s: floor of the hard step timeout: a rank without progress this long,
            not waiting on its peers, is hung and recovered (>= progress_soft_s,
            < reconnect.pg_timeout_s).
        progress_block_s: floor of the blocking step timeout: a rank without progress this
            long, not waiting, while every other rank waits on its peers (the job is blocked
            on it), is hung and recovered without waiting for the hard timeout; only once
            it has completed a step (> heartbeat_timeout_s, <= progress_hard_s). Unset:
            2.5 x heartbeat_timeout_s (5 s by default), at most progress_hard_s; equal to
            progress_hard_s turns the shortcut off.
        progress_factor: the timeouts grow with the measured step time: soft =
            max(progress_soft_s, factor/2 x longest recent step), block =
            max(progress_block_s, factor/2 x longest recent step), hard =
            max(progress_hard_s, factor x longest recent step) (>= 2).
        peer_probe_s: every rank of the job without progress this long (and at least twice
            the longest recent step): the node pulses probe each other, and a node cut from
            its peers only is replaced (NODE_PARTITIONED, ``supervisor/observe/partition.py``);
            repeated at this interval while the stall lasts (>= 0; 0 turns it off).
    """

    heartbeat_period_s: float = 0.25
    heartbeat_timeout_s: float = 2.0
    standby_heartbeat_timeout_s: float = 10.0
    node_poll_s: float = 2.0
    probe_timeout_s: float = 0.3
    slurmd_probe_deadline_s: float = 0.3
    node_silence_s: float | None = None
    straggler_threshold: float = 1.5
    straggler_window: int = 8
    headless_timeout_s: float = 30.0
    pulse: bool = True
    progress_soft_s: float = 10.0
    progress_hard_s: float = 20.0
    progress_block_s: float | None = None
    progress_factor: float = 10.0
    peer_probe_s: float = 2.0

    @property
    def silence_s(self) -> float:
        """The node-silence deadline in force (0: off): as set, else 0.9 s capped at the
        heartbeat timeout, off when that leaves the probe no time."""
        if self.node_silence_s is not None:
            return self.node_silence_s
        s = min(NODE_SILENCE_S, self.heartbeat_timeout_s)
        return s if s > self.slurmd_probe_deadline_s else 0.0

    @property
    def block_floor_s(self) -> float:
        """The blocking step timeout's floor: as set, else 2.5 x heartbeat_timeout_s (at most
        progress_hard_s): a healthy interpreter may go quiet up to the heartbeat timeout."""
        if self.progress_block_s is not None:
            return self.progress_block_s
        return min(self.progress_hard_s, BLOCK_PER_STALE * self.heartbeat_timeout_s)

    def __post_init__(self) -> None:
        if self.progress_factor < 2:
            raise ConfigError(f"detect.progress_factor={self.progress_factor} must be >= 2")
        if not 0 < self.heartbeat_period_s <= 0.5:
            raise ConfigError(
                f"detect.heartbeat_period_s={self.heartbeat_period_s} must be > 0 and <= 0.5"
            )
        if self.standby_heartbeat_timeout_s < self.heartbeat_timeout_s:
            raise ConfigError(f"detect.standby_heartbeat_timeout_s={self.standby_heartbeat_timeout_s} must be >= "
                              f"heartbeat_timeout_s={self.heartbeat_timeout_s}")
        if self.heartbeat_timeout_s <= 2 * self.heartbeat_period_s:
            raise ConfigError(
                f"detect.heartbeat_timeout_s={self.heartbeat_timeout_s} must be > 2 * heartbeat_period_s"
                f" ({2 * self.heartbeat_period_s:g}): raise the timeout or lower the period"
            )
        if self.straggler_threshold <= 1 or self.straggler_window < 1:
            raise ConfigError("detect.straggler_threshold must be > 1 and detect.straggler_window >= 1")
        if self.peer_probe_s < 0:
            raise ConfigError(f"detect.peer_probe_s={self.peer_probe_s} must be >= 0 (0 turns the peer probes off)")
        for name in ("node_poll_s", "probe_timeout_s", "slurmd_probe_deadline_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"detect.{name}={getattr(self, name)} must be > 0")
        if self.headless_timeout_s != 0 and self.headless_timeout_s <= self.heartbeat_timeout_s:
            raise ConfigError(f"detect.headless_timeout_s={self.headless_timeout_s} must be > heartbeat_timeout_s="
                              f"{self.heartbeat_timeout_s} (or 0 to turn it off)")
        if self.slurmd_probe_deadline_s >= self.heartbeat_timeout_s:
            raise ConfigError(f"detect.slurmd_probe_deadline_s={self.slurmd_probe_deadline_s} must be < "
                              f"heartbeat_timeout_s={self.heartbeat_timeout_s}: the probe only decides what "
                              "a stale heartbeat means, it must not take longer than noticing it")
        if self.node_silence_s is not None and self.node_silence_s != 0 and not (
                self.slurmd_probe_deadline_s < self.node_silence_s <= self.heartbeat_timeout_s):
            raise ConfigError(f"detect.node_silence_s={self.node_silence_s} must be > slurmd_probe_deadline_s="
                              f"{self.slurmd_probe_deadline_s} and <= heartbeat_timeout_s={self.heartbeat_timeout_s} "
                              "(or 0 to turn it off)")
