"""Run the supervisor inside a Slurm allocation (the batch step).

Used by ``slurm-resilience supervise`` (sbatch path) and by the submitit path alike.
"""

from __future__ import annotations

import json
import os
import time
from typing import Mapping, Sequence

from ..config import ResilienceConfig
from ..errors import ResilienceError
from ..files import write_private


def supervise_allocation(cfg: ResilienceConfig, command: Sequence[str], job_dir: str | None,
                         environ: Mapping[str, str] = os.environ) -> int:
    """Supervise ``command`` on this allocation; returns the job's exit code.

    Raises:
        ResilienceError: not inside an allocation, or too few nodes for the config.
    """
    from ..slurm.parse import SlurmEnv
    from ..slurm.steps import SrunLauncher
    from ..supervisor.loop import Supervisor

    env = SlurmEnv.from_environ(environ)
    if env.job_id is None:
        raise ResilienceError("not inside a Slurm allocation (no SLURM_JOB_ID): use `slurm-resilience submit`")
    me = env.node_name
    pool = [n for n in env.nodelist if n != me] if cfg.job.supervisor_node else list(env.nodelist)
    launcher = SrunLauncher(env.job_id, [*pool, me] if me else pool)
    job_dir = os.path.abspath(job_dir or cfg.job.job_dir.format(job_id=env.job_id))
    sup = Supervisor(config=cfg, command=command, job_dir=job_dir, nodes=pool, launcher=launcher,
                     store_host=launcher.address(me) if me else "127.0.0.1", job_id=env.job_id,
                     restart_count=env.restart_count)
    return write_result(job_dir, sup.run())


def write_result(job_dir: str, code: int) -> int:
    """``job_dir/result.json`` tells a waiting submitter how the job ended."""
    write_private(os.path.join(job_dir, "result.json"), json.dumps({"exit_code": code, "t": time.time()}))
    return code
