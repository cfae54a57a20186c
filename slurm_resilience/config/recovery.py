"""The ``recovery`` section: what the supervisor may do about a fault."""

from __future__ import annotations

from dataclasses import dataclass

from slurm_resilience.errors import ConfigError

__all__ = ["ISOLATE_STATES", "RecoveryConfig"]

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

    online_timeout_s: float = 45.0
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
