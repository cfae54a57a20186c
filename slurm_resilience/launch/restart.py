"""Job-level recovery of an unmodified program: submit it, and supervise it in the allocation.

``slurm-resilience run`` renders ``slurm_resilience/templates/restart.sbatch.tmpl`` and
submits it; the batch host then runs ``slurm-resilience restart-supervise``, which
is ``supervise_restart`` below (``supervisor/relaunch.py`` carries out ``supervisor/decide.py``'s decisions).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Mapping, Sequence

from ..config import ResilienceConfig, config_to_dict
from ..errors import ResilienceError
from ..files import makedirs_private, write_private
from .allocation import write_result
from .sbatch import render

TEMPLATE = "restart.sbatch.tmpl"


def render_restart(cfg: ResilienceConfig, *, command: Sequence[str], config_path: str, job_dir: str,
                   mpi: bool = False, job_name: str = "sr-restart", python: str = sys.executable) -> str:
    """Pure: the sbatch script text. Every user value is shell-quoted.

    Raises:
        ConfigError: empty command, missing template, a line break in a value, bad partition.
    """
    return render(cfg, command=command, config_path=config_path, job_dir=job_dir, job_name=job_name,
                  python=python, template=TEMPLATE, extra={"mpi_flag": " --mpi" if mpi else ""})


def submit_restart(cfg: ResilienceConfig, command: Sequence[str], job_dir: str, *, mpi: bool) -> str:
    """Write the config and script into ``job_dir`` (0600/0700) and sbatch it; returns the job id.

    Raises:
        ConfigError, SlurmCommandError.
    """
    import yaml

    from ..slurm import commands

    makedirs_private(job_dir)
    cfg_path = write_private(os.path.join(job_dir, "submitted-config.yaml"), yaml.safe_dump(config_to_dict(cfg)))
    script = render_restart(cfg, command=command, config_path=cfg_path, job_dir=job_dir, mpi=mpi)
    return commands.sbatch(write_private(os.path.join(job_dir, "job.sbatch"), script, mode=0o700))


def wait_result(job_id: str, job_dir: str, poll_s: float = 0.5) -> int:
    """Wait until the job leaves the queue; its exit code from ``job_dir/result.json``.

    Raises:
        ResilienceError: the job ended without writing a result.
    """
    from ..slurm import commands

    while commands.job_state(job_id) is not None:
        time.sleep(poll_s)
    try:
        with open(os.path.join(job_dir, "result.json")) as f:
            return int(json.load(f)["exit_code"])
    except FileNotFoundError:
        raise ResilienceError(f"job {job_id} ended without a result: see {job_dir}/supervisor.log") from None


def supervise_restart(cfg: ResilienceConfig, command: Sequence[str], job_dir: str | None, *, mpi: bool,
                      environ: Mapping[str, str] = os.environ) -> int:
    """Inside the allocation: run the restart supervisor; returns (and records) the exit code.

    Raises:
        ResilienceError: not inside an allocation, or too few nodes.
    """
    from ..container.argv import for_job
    from ..slurm.parse import SlurmEnv
    from ..slurm.steps import SrunLauncher
    from ..supervisor.relaunch import RelaunchExecutor, layout

    env = SlurmEnv.from_environ(environ)
    if env.job_id is None:
        raise ResilienceError("not inside a Slurm allocation (no SLURM_JOB_ID): use `slurm-resilience run`")
    lay = layout(env.nodelist, env.node_name, cfg.job.nodes, supervisor_node=cfg.job.supervisor_node)
    job_dir = os.path.abspath(job_dir or cfg.job.job_dir.format(job_id=env.job_id))
    launcher = SrunLauncher(env.job_id, [*lay.workers, *lay.spares],
                            container=for_job(cfg.container, job_id=env.job_id, job_dir=job_dir, cwd=os.getcwd()))
    launcher.clean_containers([*lay.workers, *lay.spares], stale=True)  # what ended jobs left there
    sup = RelaunchExecutor(config=cfg, command=command, job_dir=job_dir, job_id=env.job_id, layout=lay,
                            allocation=env.nodelist, launcher=launcher, mpi=mpi)
    return write_result(job_dir, sup.run())
