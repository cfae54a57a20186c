"""Run the supervisor inside a Slurm allocation (the batch step).

Used by ``slurm-resilience supervise`` (sbatch path) and by the submitit path alike.
In a heterogeneous job (``submit --hetjob``) the supervisor is component 0 and the
workers and spares come from component 1; every step carries ``--het-group=1``.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping, Sequence

from ..config import ResilienceConfig
from ..errors import ResilienceError
from ..files import write_private

if TYPE_CHECKING:
    from ..slurm.parse import SlurmEnv


__all__ = [
    "WORKER_HET_GROUP", "WorkerPool", "worker_pool", "supervise_allocation", "keep_allocation", "allocation_job_dir",
    "write_result"
]


WORKER_HET_GROUP = 1  # hetjob.sbatch.tmpl: component 0 = supervisor, 1 = workers + spares


@dataclass(frozen=True)
class WorkerPool:
    """Where ranks and standbys may run: ``nodes``; in a hetjob, of component
    ``het_group`` whose own job id is ``het_job_id`` (both None otherwise)."""

    nodes: tuple[str, ...]
    het_group: int | None = None
    het_job_id: str | None = None


def worker_pool(env: "SlurmEnv", supervisor_node: bool) -> WorkerPool:
    """Pure: the worker/spare nodes of this allocation, never the supervisor's own.

    Raises:
        ResilienceError: a heterogeneous job without a worker component.
    """
    me = env.node_name
    if env.is_hetjob:
        if env.het_size <= WORKER_HET_GROUP:
            raise ResilienceError(f"heterogeneous job {env.job_id} has {env.het_size} component(s): "
                                  f"workers need component {WORKER_HET_GROUP} (submit with --hetjob)")
        nodes = env.het_nodelists[WORKER_HET_GROUP]
        return WorkerPool(tuple(n for n in nodes if n != me), WORKER_HET_GROUP,
                          env.het_job_ids[WORKER_HET_GROUP])
    if supervisor_node:
        return WorkerPool(tuple(n for n in env.nodelist if n != me))
    return WorkerPool(tuple(env.nodelist))


def supervise_allocation(cfg: ResilienceConfig, command: Sequence[str], job_dir: str | None,
                         environ: Mapping[str, str] = os.environ, *, run_id: str,
                         store_port: int | None = None, reattach: bool = False) -> int:
    """Supervise ``command`` on this allocation; returns the job's exit code.

    ``job_dir`` may hold ``%j`` (the job id, as in sbatch and submitit paths).
    ``run_id``: the run's, from the batch step. ``store_port``: the store hosted by the
    batch step (``keep_allocation``).

    Raises:
        ResilienceError: not inside an allocation, too few nodes for the config, or a
            heterogeneous job without a worker component.
    """
    from ..container.argv import for_job
    from ..slurm.options import srun_args
    from ..slurm.parse import SlurmEnv
    from ..supervisor.executors.online import Supervisor

    env = SlurmEnv.from_environ(environ)
    if env.job_id is None:
        raise ResilienceError("not inside a Slurm allocation (no SLURM_JOB_ID): use `slurm-resilience submit`")
    me = env.node_name
    workers = worker_pool(env, cfg.job.supervisor_node)
    pool = list(workers.nodes)
    job_dir = os.path.abspath((job_dir or cfg.job.job_dir.format(job_id=env.job_id)).replace("%j", env.job_id))
    kind, more = _launcher_kind(cfg, env, job_dir)
    launcher = kind(env.job_id, [*pool, me] if me else pool, het_group=workers.het_group,
                    het_job_id=workers.het_job_id, srun_options=srun_args(cfg.job.srun_options),
                    container=for_job(cfg.container, job_id=env.job_id, job_dir=job_dir, cwd=os.getcwd()),
                    step_nodes=pool, **more)
    if not reattach:  # a node back in service starts clean: what ended jobs left there goes
        launcher.clean_containers(pool, stale=True)
    sup = Supervisor(config=cfg, command=command, job_dir=job_dir, nodes=pool, launcher=launcher,
                     store_host=launcher.address(me) if me else "127.0.0.1", job_id=env.job_id, run_id=run_id,
                     requeue_count=env.requeue_count + env.resubmit_count, store_port=store_port, reattach=reattach)
    return write_result(job_dir, sup.run())


def _launcher_kind(cfg: ResilienceConfig, env: "SlurmEnv", job_dir: str) -> tuple[type, dict]:
    """The step launcher: one that requeues by resubmitting (``recovery.requeue_by:
    resubmit``, an ordinary job submitted with ``slurm-resilience submit``: a hetjob,
    or a job without ``JOBDIR/job.sbatch`` such as submitit's, is requeued), or the
    plain one; with its extra keyword arguments."""
    from ..slurm.resubmit import SCRIPT_FILE, ResubmittingLauncher
    from ..slurm.steps import SrunLauncher

    if cfg.recovery.requeue_by == "resubmit" and not env.is_hetjob and os.path.exists(os.path.join(job_dir, SCRIPT_FILE)):
        return ResubmittingLauncher, {"job_dir": job_dir, "origin_job_id": env.origin_job_id or str(env.job_id),
                                      "resubmits": env.resubmit_count}
    return SrunLauncher, {}


def keep_allocation(cfg: ResilienceConfig, command: Sequence[str], job_dir: str | None,
                    environ: Mapping[str, str] = os.environ, *, started: float | None = None,
                    run_id: str | None = None) -> int:
    """The batch step of the sbatch and submitit paths: host the store, run the
    supervisor as a child and restart it if it is killed (``supervisor/executors/keeper.py``).
    ``run_id``: the submitter's (submitit path), else ``SR_RUN_ID`` from ``job.sbatch``;
    without either a requeue keeps the recorded one (``run_identity``).

    Raises:
        ResilienceError: not inside an allocation.
        ConfigError: the given run id is not one.
    """
    from ..run_identity import RUN_ID_ENV
    from ..slurm.parse import SlurmEnv
    from ..supervisor.executors.keeper import keep_supervisor

    job_dir, host = allocation_job_dir(cfg, job_dir, environ)
    env = SlurmEnv.from_environ(environ)
    return write_result(job_dir, keep_supervisor(
        cfg, command, job_dir, host, started=started, run_id=run_id or environ.get(RUN_ID_ENV) or None,
        resumed=env.requeue_count + env.resubmit_count > 0))


def allocation_job_dir(cfg: ResilienceConfig, job_dir: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """(job dir with ``%j`` filled in, the store's address on this batch host)."""
    from ..slurm import commands
    from ..slurm.parse import SlurmEnv

    env = SlurmEnv.from_environ(environ)
    if env.job_id is None:
        raise ResilienceError("not inside a Slurm allocation (no SLURM_JOB_ID): use `slurm-resilience submit`")
    me = env.node_name
    host = commands.node_address(commands.show_nodes([me])[me])[0] if me else "127.0.0.1"
    return os.path.abspath((job_dir or cfg.job.job_dir.format(job_id=env.job_id)).replace("%j", env.job_id)), host


def write_result(job_dir: str, code: int) -> int:
    """``job_dir/result.json`` tells a waiting submitter how the job ended."""
    write_private(os.path.join(job_dir, "result.json"), json.dumps({"exit_code": code, "t": time.time()}))
    return code
