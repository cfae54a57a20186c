"""Submit a resilient job from Python through submitit.

    job = submit(["python", "train.py"], nodes=4, spares=1, job_dir="jobs/run1")
    job.result()   # the supervisor's exit code (0: finished)

submitit runs the supervisor once, in the batch step (``slurm_use_srun=False``), on
an ``sbatch --no-kill`` allocation of 1 + nodes + spares nodes; the supervisor then
starts the ranks and warm standbys as ``srun`` steps, exactly as on the sbatch path.
``job_dir`` may hold ``%j`` (as submitit's folder does): it becomes the job id in
the batch step. ``launch/submitter.py`` wraps this in a submitit-like executor.
``tasks_per_node`` has submitit's meaning: G ranks on each worker node (one per
GPU), G warm standbys on each spare. The site's ``job.sbatch_options`` reach
submitit's ``slurm_additional_parameters`` next to the toolkit's own (``no_kill``,
``nodes``, ``requeue``, ``signal``), ``job.setup`` its ``slurm_setup``.
"""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from ..config import ResilienceConfig, config_to_dict, load_config
from ..files import makedirs_private
from ..run_identity import new_run_id


__all__ = ["run_supervisor", "submit"]


def run_supervisor(config: Mapping[str, Any], command: Sequence[str], job_dir: str,
                   run_id: str | None = None) -> int:
    """The function submitit pickles and runs in the batch step: it hosts the store
    and runs the supervisor as a child it restarts if killed (as the sbatch path).
    ``run_id``: drawn at submission; submitit runs the same pickle again on a requeue,
    so every start of the job is one run (``run_identity``)."""
    from .allocation import keep_allocation

    return keep_allocation(load_config(config), command, job_dir, run_id=run_id)


def submit(command: Sequence[str], *, nodes: int, spares: int = 1, tasks_per_node: int | None = None,
           job_dir: str, config: ResilienceConfig | str | None = None, timeout_min: int = 60,
           executor_params: Mapping[str, Any] | None = None):
    """Submit and return the ``submitit.Job``; ``executor_params`` go to update_parameters.

    ``tasks_per_node``: ranks per node as in submitit (None: ``job.tasks_per_node`` of
    ``config``); every node of the allocation is given that many tasks.

    Raises:
        ConfigError: a count the config rejects (before anything is submitted).
    """
    import submitit

    base = config if isinstance(config, ResilienceConfig) else load_config(config)
    cfg = config_to_dict(base)
    cfg["job"].update(nodes=nodes, spares=spares)
    if tasks_per_node is not None:
        cfg["job"]["tasks_per_node"] = tasks_per_node
    resolved = load_config(cfg)  # validates the counts before anything is submitted
    job_dir = os.path.abspath(job_dir)
    # "%j" is filled in by submitit (its folder) and by the batch step (the job dir):
    # only the levels above it can exist before the job id does.
    makedirs_private(os.path.dirname(job_dir.split("%j", 1)[0]) if "%j" in job_dir else job_dir)
    executor = submitit.AutoExecutor(folder=os.path.join(job_dir, "submitit"), cluster="slurm")
    total = nodes + spares + (1 if resolved.job.supervisor_node else 0)
    # submitit counts one result per task: it sees a 1-task job (the supervisor); the
    # real node and task counts go straight into the #SBATCH lines (G tasks on every
    # node, as the sbatch path's --ntasks-per-node).
    params: dict[str, Any] = {
        "nodes": 1,
        "tasks_per_node": 1,
        "timeout_min": timeout_min,
        "slurm_use_srun": False,
        # submitit's batch shell does not exec python, so a "B:" signal would end the
        # shell, not reach the supervisor. The signal goes to every step instead: the
        # ranks and standbys catch it and request a checkpoint-and-requeue themselves.
        "slurm_additional_parameters": {
            "no_kill": True, "nodes": total, "ntasks_per_node": resolved.job.tasks_per_node, "requeue": True,
            **({"signal": resolved.job.preempt_signal} if resolved.job.preempt_signal else {}),
        },
        "slurm_signal_delay_s": 30,
    }
    if resolved.job.partition:
        params["slurm_partition"] = resolved.job.partition
    if resolved.job.setup:
        params["slurm_setup"] = list(resolved.job.setup)
    params.update(executor_params or {})
    # The site's #SBATCH options join the toolkit's (merged, never replacing them; the
    # config has refused the ones the toolkit owns). submitit writes --a-b for a_b.
    site = {k.replace("-", "_"): v for k, v in resolved.job.sbatch_options.items()}
    params["slurm_additional_parameters"] = {**site, **params["slurm_additional_parameters"]}
    executor.update_parameters(**params)
    return executor.submit(run_supervisor, config_to_dict(resolved), list(command), job_dir, new_run_id())
