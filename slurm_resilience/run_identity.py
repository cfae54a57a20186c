"""Which run a checkpoint belongs to.

A **run** is one submission of a training job, kept across its requeues:
``scontrol requeue`` runs the same batch script again, ``recovery.requeue_by:
resubmit`` submits the job's own ``JOBDIR/job.sbatch`` again (a new job id), and
both must resume the same run's checkpoints. Slurm's job id alone does not name a
run: a slurmctld restarted with a fresh state directory numbers jobs from 1 again,
and a node-local checkpoint directory named after job 1 may still hold an earlier
program's checkpoints. So every run also carries a random 128-bit **run id**:

- ``slurm-resilience submit`` draws it and writes ``export SR_RUN_ID=…`` into
  ``job.sbatch``: a requeue reruns that script, a resubmission submits it again;
- the submitit path draws it at submission and passes it to the batch step;
- a start without one (``slurm-resilience local``, a hand-written batch script
  running ``slurm-resilience supervise``) draws a fresh one, unless the start is a
  resumption (a requeue, ``SLURM_RESTART_COUNT`` > 0; or ``local`` given an
  existing ``--job-dir``), which keeps the one recorded in ``JOBDIR/run.json``. A new
  job that merely finds a ``run.json`` (a job id repeated, hence the same default
  job directory) is not a resumption: it draws its own.

The batch step (``supervisor/executors/keeper.py``) settles it once per start
(:func:`establish`), records it 0600 in ``JOBDIR/run.json`` and exports
``SR_RUN_ID``; the supervisor hands it to every worker (``protocol.WorkerEnv``), and
the checkpoint engine writes it into every manifest and restores only its own run's
(``checkpoint/ownership.py``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from typing import Mapping

from .errors import ConfigError
from .files import makedirs_private, write_private


__all__ = [
    "RUN_ID_ENV", "RUN_FILE", "RunIdentity", "new_run_id", "check_run_id", "choose", "read_recorded", "establish",
    "from_environ", "continued"
]


RUN_ID_ENV = "SR_RUN_ID"
RUN_FILE = "run.json"
_RUN_ID = re.compile(r"[0-9a-f]{32}")


@dataclass(frozen=True)
class RunIdentity:
    """The run a checkpoint belongs to.

    Attributes:
        job_id: the Slurm job id of the run's first job (``SR_ORIGIN_JOB_ID`` after a
            resubmission; ``local-PID`` without Slurm); informational, a restarted
            Slurm repeats it.
        run_id: 32 lowercase hex digits drawn once per submission (:func:`new_run_id`),
            the same in every requeue of it; never repeated by another run.

    Raises:
        ConfigError: on construction, ``run_id`` is not 32 lowercase hex digits.
    """

    job_id: str
    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    def owns(self, recorded: str | None, *, adopt_legacy: bool = False) -> bool:
        """Pure: whether a checkpoint whose manifest records run id ``recorded`` is this
        run's. A manifest without one (written before run ids) is another run's unless
        ``adopt_legacy`` (``checkpoint.adopt_legacy``) says otherwise."""
        if recorded is None:
            return adopt_legacy
        return recorded == self.run_id


def new_run_id() -> str:
    """A fresh run id (128 random bits, hex)."""
    return secrets.token_hex(16)


def check_run_id(value: str) -> str:
    """``value`` if it is a run id.

    Raises:
        ConfigError: not 32 lowercase hex digits.
    """
    if not isinstance(value, str) or not _RUN_ID.fullmatch(value):
        raise ConfigError(f"bad run id {value!r}: expected 32 lowercase hex digits ({RUN_ID_ENV})")
    return value


def choose(given: str | None, recorded: str | None, *, resumed: bool) -> str | None:
    """Pure: the run id of a start, or None when a fresh one must be drawn.

    ``given``: ``SR_RUN_ID`` of the start (from ``job.sbatch`` or the submitter);
    ``recorded``: the one in ``JOBDIR/run.json``; ``resumed``: the start continues an
    earlier one (a requeue, ``local`` on an existing job directory). A given id wins;
    a recorded one is kept only by a resumption, since a new job whose job directory
    happens to exist (a job id repeated by a restarted Slurm) is another run.

    Raises:
        ConfigError: ``given`` is not a run id.
    """
    if given:
        return check_run_id(given)
    if resumed and recorded:
        return recorded
    return None


def read_recorded(job_dir: str) -> str | None:
    """The run id in ``JOBDIR/run.json``, or None (no file, or not a run id)."""
    try:
        with open(os.path.join(job_dir, RUN_FILE)) as f:
            value = json.load(f).get("run_id")
        return check_run_id(value)
    except (OSError, ValueError, AttributeError, ConfigError):  # no file, not JSON, not a run id
        return None


def establish(job_dir: str, given: str | None, *, resumed: bool) -> str:
    """The run id of this start (:func:`choose`, drawing one if needed), recorded 0600
    in ``JOBDIR/run.json``.

    Raises:
        ConfigError: ``given`` is not a run id.
        OSError: the job directory cannot be written.
    """
    recorded = read_recorded(job_dir)
    run_id = choose(given, recorded, resumed=resumed) or new_run_id()
    if run_id != recorded:
        makedirs_private(job_dir)
        write_private(os.path.join(job_dir, RUN_FILE), json.dumps({"run_id": run_id}) + "\n")
    return run_id


def from_environ(environ: Mapping[str, str]) -> str:
    """The run id the batch step handed its child (``SR_RUN_ID``), read once at its start.

    Raises:
        ConfigError: none, or not a run id (the keeper sets it: ``--child`` is its own).
    """
    value = environ.get(RUN_ID_ENV)
    if not value:
        raise ConfigError(f"no {RUN_ID_ENV} in the environment: the batch step (keeper) sets it for "
                          "the supervisor it starts; run `slurm-resilience supervise` without --child")
    return check_run_id(value)


def continued(arg: str) -> str:
    """The run id ``submit --continue-run ARG`` names: ARG itself when it is a run id,
    else the one recorded in the job directory ARG (``JOBDIR/run.json``).

    Raises:
        ConfigError: ARG is neither a run id nor a job directory with a recorded one.
    """
    if _RUN_ID.fullmatch(arg):
        return arg
    recorded = read_recorded(arg)
    if recorded is None:
        raise ConfigError(f"--continue-run {arg}: not a run id (32 hex digits) nor a job directory with "
                          f"a {RUN_FILE} (the run of a job started by slurm-resilience)")
    return recorded

