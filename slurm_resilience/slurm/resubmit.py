"""Requeue by resubmitting: the job's own ``job.sbatch`` again, as a new job id.

``recovery.requeue_by: resubmit`` (docs/recovery-ladder.md, "Requeue or resubmit").
Slurm 22.05 holds a requeued job before it may run again: the requeue completes only
once every step of the job has ended (a step on a lost node ends when slurmctld gives
up on it, ~5 s after the node is set DOWN in the lab), then the job's begin time is
set about ``cred_expire`` seconds ahead (5.2 s measured in the lab, where cred_expire
is 5; Slurm's default is 120) so that the nodes' revoked credentials of the previous
run expire first. An ``scontrol update StartTime=now`` sent while the job is still
COMPLETING is overwritten by the requeue; sent after it, it works, but by then every
process of the job is gone and nobody is left to send it.

A new submission has no such hold: it is queued at once, behind the old job
(``--dependency=afterany:OLD``, so two runs never share the job directory), with the
nodes this job isolated excluded, and starts as soon as the old job has ended. It runs
the same script in the same job directory, so it resumes from the same checkpoints:
``SR_ORIGIN_JOB_ID`` (the first job's id) keeps ``{job_id}`` in checkpoint paths the
same, and ``SR_RESUBMIT_COUNT`` counts, with ``SLURM_RESTART_COUNT``, against
``recovery.max_requeues``. The cost: the job id changes (``squeue``/``sacct`` show
the old job ending with exit code 4 and a new job), and ``JOBDIR/resubmitted.json``
names the successor, which ``slurm-resilience submit --wait`` follows.
"""

from __future__ import annotations

import json
import os
import signal
import time
from typing import Mapping, Sequence

from ..files import write_private
from . import commands
from .steps import SrunLauncher, deferred


__all__ = [
    "RESUBMITTED_FILE", "SCRIPT_FILE", "resubmit_env", "resubmit_args", "successor", "resubmit", "ResubmittingLauncher"
]


RESUBMITTED_FILE = "resubmitted.json"
SCRIPT_FILE = "job.sbatch"  # what `slurm-resilience submit` wrote and submitted
_KEEP = frozenset({"SLURM_CONF"})  # the client's own setting, not the job's


def resubmit_env(environ: Mapping[str, str], *, origin_job_id: str, resubmits: int) -> dict[str, str]:
    """Pure: the environment the successor is submitted with — the job's own, less the
    ``SLURM_*``/``SBATCH_*``/``SALLOC_*`` variables of this run (sbatch would read some
    as options, and the successor must not inherit them), plus the toolkit's count and
    the first job's id."""
    env = {k: v for k, v in environ.items()
           if k in _KEEP or not k.startswith(("SLURM_", "SBATCH_", "SALLOC_", "SRUN_"))}
    env.update(SR_ORIGIN_JOB_ID=origin_job_id, SR_RESUBMIT_COUNT=str(resubmits))
    return env


def resubmit_args(*, after: str, exclude: Sequence[str]) -> list[str]:
    """Pure: the sbatch flags of the successor: queued behind ``after``, never on
    ``exclude`` (validated node names)."""
    args = ["--dependency", f"afterany:{after}", "--kill-on-invalid-dep=yes"]
    if exclude:
        args += ["--exclude", commands.compress_hostlist(sorted(commands.validate_node_name(n) for n in exclude))]
    return args


def successor(job_dir: str, job_id: str) -> str | None:
    """The job that continues ``job_id`` in ``job_dir`` (its ``resubmitted.json``), or None."""
    try:
        with open(os.path.join(job_dir, RESUBMITTED_FILE)) as f:
            d = json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return None
    chain = d.get("chain", {})
    return str(chain[job_id]) if job_id in chain else None


def resubmit(job_id: str, job_dir: str, exclude: Sequence[str], *, origin_job_id: str, resubmits: int,
             environ: Mapping[str, str] = os.environ) -> str:
    """Submit ``JOBDIR/job.sbatch`` again behind ``job_id``; record it in
    ``JOBDIR/resubmitted.json``; returns the new job id. ``exclude``: this job's
    isolated nodes (the job's own ``ExcNodeList`` is kept as well).

    Raises:
        SlurmCommandError: sbatch failed. FileNotFoundError: no job.sbatch.
    """
    script = os.path.join(job_dir, SCRIPT_FILE)
    if not os.path.exists(script):
        raise FileNotFoundError(f"{script}: only a job submitted with `slurm-resilience submit` can be resubmitted")
    before = commands.show_job(job_id).get("ExcNodeList", "(null)")
    kept = [] if before in ("", "(null)") else commands.expand_hostlist(before)
    argv = ["sbatch", "--parsable", *resubmit_args(after=job_id, exclude=sorted({*kept, *exclude})), script]
    proc = commands.run(argv, timeout=30.0,
                        env=resubmit_env(environ, origin_job_id=origin_job_id, resubmits=resubmits))
    new = commands.parse_sbatch_job_id(proc.stdout)
    path = os.path.join(job_dir, RESUBMITTED_FILE)
    chain = {}
    if os.path.exists(path):
        with open(path) as f:
            chain = json.load(f).get("chain", {})
    write_private(path, json.dumps({"chain": {**chain, job_id: new}, "origin": origin_job_id, "t": time.time()}))
    return new


class ResubmittingLauncher(SrunLauncher):
    """An :class:`SrunLauncher` whose :meth:`requeue` resubmits the job (see the module
    docstring); steps carry ``SR_ORIGIN_JOB_ID`` so that checkpoint paths stay the first
    job's."""

    def __init__(self, *args, job_dir: str, origin_job_id: str, resubmits: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.job_dir, self.origin_job_id, self.resubmits = job_dir, origin_job_id, resubmits

    def launch(self, *, name: str, node: str, argv: Sequence[str], env: Mapping[str, str], log_path: str):
        return super().launch(name=name, node=node, argv=argv, log_path=log_path,
                              env={**env, "SR_ORIGIN_JOB_ID": self.origin_job_id})

    def requeue(self) -> None:
        """Job-level: queue the successor behind this job, without the isolated nodes;
        this job then ends as the supervisor exits (code 4).

        Raises:
            SlurmCommandError: sbatch failed (the job is not requeued).
        """
        self.clean_containers([n for n in self.step_nodes if n not in self._isolated])
        with deferred(signal.SIGTERM), self._release_lock:
            new = resubmit(self.job_id, self.job_dir, sorted(self._isolated), origin_job_id=self.origin_job_id,
                           resubmits=self.resubmits + 1)
        print(f"slurm_resilience: job {self.job_id} resubmitted as job {new} (recovery.requeue_by: resubmit)",
              flush=True)
