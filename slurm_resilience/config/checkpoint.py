"""The ``checkpoint`` section: the multi-level checkpoint tiers."""

from __future__ import annotations

import os
from dataclasses import dataclass

from slurm_resilience.errors import ConfigError

__all__ = ["CheckpointConfig"]


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
        from ..checkpoint.lustre import check_striping

        check_striping("checkpoint.lustre_", self.lustre_stripe_count, self.lustre_stripe_size)

    def tiers(self):
        """The tier specs this section describes (see ``checkpoint/tiers.py``)."""
        from ..checkpoint.tiers import Redundancy, TierSpec

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
