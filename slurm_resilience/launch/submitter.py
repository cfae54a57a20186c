"""A submitit-like executor for resilient jobs.

    executor = ResilientExecutor(folder="jobs")
    executor.update_parameters(nodes=4, spares=1, tasks_per_node=8, timeout_min=60,
                               recovery={"recovery": {"scale_in": False}})
    job = executor.submit(["python", "train.py", "--steps", "1000"])
    job.job_id, job.folder   # jobs/<job_id>: events, status, rank tables, final state
    job.result()             # the supervisor's exit code (0: finished)

It feels like ``submitit.AutoExecutor`` but submits a *command*, not a function:
the supervisor runs it on ``nodes`` × ``tasks_per_node`` ranks with ``spares`` ×
``tasks_per_node`` warm standbys (``tasks_per_node`` as in submitit). Submission
is ``submitit_launch.submit``; this module only keeps parameters and wraps the job.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..config import ResilienceConfig, config_to_dict, load_config
from ..errors import ConfigError, ResilienceError
from ..slurm.options import parse_argv

__all__ = ["ResilientExecutor", "ResilientJob"]

# update_parameters keys that become config keys: parameter → (section, key).
_CONFIG_PARAMS = {
    "nodes": ("job", "nodes"),
    "spares": ("job", "spares"),
    "tasks_per_node": ("job", "tasks_per_node"),
    "slurm_partition": ("job", "partition"),
}
_OWN_PARAMS = ("timeout_min", "recovery", "name", "gpus_per_node", "mem_gb", "cpus_per_task")
# submitit's generic parameters, with submitit's meaning, as #SBATCH options.
_GENERIC = {"gpus_per_node": "gpus-per-node", "cpus_per_task": "cpus-per-task"}
# slurm_* parameters that stay submitit's own (they shape its batch script, not the job).
_SUBMITIT_OWN = ("slurm_job_name", "slurm_signal_delay_s", "slurm_max_num_timeout", "slurm_stderr_to_stdout",
                 "slurm_array_parallelism")
# slurm_* parameters submitit has that the toolkit decides: → what controls them.
_REFUSED = {"slurm_time": "timeout_min", "slurm_use_srun": "nothing: the batch step runs the supervisor",
            "slurm_nodes": "nodes and spares", "slurm_ntasks_per_node": "tasks_per_node"}


class ResilientJob:
    """One submitted job: ``job_id``, ``folder`` (the job directory), ``paths`` (submitit's
    log and pickle paths), ``done()``, ``result()``, ``cancel()``."""

    def __init__(self, submitit_job: Any, folder: Path) -> None:
        self._job = submitit_job
        self.folder = folder

    @property
    def job_id(self) -> str:
        return str(self._job.job_id)

    @property
    def paths(self) -> Any:
        """submitit's ``JobPaths`` (``stdout``, ``stderr``, ``result_pickle``, ``folder``)."""
        return self._job.paths

    def done(self) -> bool:
        """True once the supervisor has returned, or the job has left the queue.

        Needs no accounting (``sacct``): a job gone from ``squeue`` is done.

        Raises:
            SlurmCommandError: squeue failed.
        """
        from ..slurm import commands

        if self._job.paths.result_pickle.exists():
            return True
        return commands.job_state(self.job_id) is None

    def result(self, timeout_s: float | None = None, poll_s: float = 0.5) -> int:
        """Wait for the job; the supervisor's exit code (0: training finished).

        Raises:
            TimeoutError: not done within ``timeout_s``.
            ResilienceError: the job ended without a result (see ``paths.stderr``
                and ``folder/supervisor.log``).
            submitit.core.utils.FailedJobException: the supervisor raised.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self.done():
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"job {self.job_id} not done within {timeout_s:g}s")
            time.sleep(poll_s)
        if not self._job.paths.result_pickle.exists():
            raise ResilienceError(f"job {self.job_id} ended without a result: see {self._job.paths.stderr}")
        return int(self._job.result())

    def cancel(self) -> None:
        """``scancel`` the whole job."""
        self._job.cancel(check=False)

    def __repr__(self) -> str:
        return f"ResilientJob(job_id={self.job_id!r}, folder={str(self.folder)!r})"


class ResilientExecutor:
    """Submits commands as resilient jobs; each job's directory is ``folder/<job_id>``.

    ``config``: a base YAML path, mapping or ``ResilienceConfig``; parameters given to
    ``update_parameters`` override it.
    """

    def __init__(self, folder: str | os.PathLike, config: ResilienceConfig | str | Mapping | None = None) -> None:
        self.folder = Path(folder).absolute()
        self._base = config_to_dict(config if isinstance(config, ResilienceConfig) else load_config(config))
        self._overrides: dict[str, dict[str, Any]] = {}
        self._timeout_min = 60
        self._slurm: dict[str, Any] = {}

    def update_parameters(self, **kwargs: Any) -> None:
        """Set job parameters; later calls add to earlier ones.

        ``nodes``, ``spares``, ``tasks_per_node`` (as in submitit: ranks per node, one
        per GPU; a spare holds as many standbys), ``timeout_min``,
        ``recovery`` (config sections → keys, e.g. ``{"recovery": {"scale_in": False},
        "checkpoint": {"local_every": 10}}``), ``name`` (the Slurm job name), and
        submitit's Slurm parameters with submitit's meaning: ``slurm_partition``
        (``job.partition``), ``slurm_setup`` (``job.setup``), ``slurm_srun_args``
        (``job.srun_options``), ``slurm_additional_parameters`` and every other
        ``slurm_X`` (``slurm_account``, ``slurm_qos``, ``slurm_gres``,
        ``slurm_constraint``, ``slurm_mem``, ``slurm_exclusive`` ...) become
        ``job.sbatch_options`` (``#SBATCH --X``), as do ``gpus_per_node``,
        ``cpus_per_task`` and ``mem_gb`` (``--mem=<N>GB``). Options the toolkit owns
        (``nodes``, ``no_kill``, ``requeue``, ``signal``, ``time`` ...) are refused.

        Raises:
            ConfigError: an unknown or refused parameter, or a value the config rejects.
        """
        overrides = {section: dict(keys) for section, keys in self._overrides.items()}
        slurm = dict(self._slurm)
        timeout = self._timeout_min
        job = overrides.setdefault("job", {})
        sbatch = dict(job.get("sbatch_options", self._base["job"]["sbatch_options"]))
        for key, value in kwargs.items():
            if key in _CONFIG_PARAMS:
                section, field = _CONFIG_PARAMS[key]
                overrides.setdefault(section, {})[field] = value
            elif key in _REFUSED:
                raise ConfigError(f"{key} is the toolkit's own: set it with {_REFUSED[key]}")
            elif key in _GENERIC:
                sbatch[_GENERIC[key]] = value
            elif key == "mem_gb":
                sbatch["mem"] = f"{value}GB"
            elif key == "slurm_setup":
                job["setup"] = value
            elif key == "slurm_srun_args":
                job["srun_options"] = {**job.get("srun_options", self._base["job"]["srun_options"]),
                                       **parse_argv(key, value)}
            elif key == "slurm_additional_parameters":
                if not isinstance(value, Mapping):
                    raise ConfigError(f"slurm_additional_parameters must be a mapping, got {value!r}")
                sbatch.update(value)
            elif key == "recovery":
                for section, keys in _sections(value).items():
                    overrides.setdefault(section, {}).update(keys)
            elif key == "timeout_min":
                timeout = int(value)
            elif key == "name":
                slurm["slurm_job_name"] = value
            elif key in _SUBMITIT_OWN:
                slurm[key] = value
            elif key.startswith("slurm_"):
                sbatch[key.removeprefix("slurm_")] = value
            else:
                valid = ", ".join([*_CONFIG_PARAMS, *_OWN_PARAMS, "slurm_*"])
                raise ConfigError(f"unknown parameter {key!r} for ResilientExecutor; valid: {valid}")
        if timeout < 1:
            raise ConfigError(f"timeout_min={timeout} must be >= 1")
        job["sbatch_options"] = _dedupe(sbatch)
        load_config(self._base, overrides)  # validate now, not at submission
        self._overrides, self._slurm, self._timeout_min = overrides, slurm, timeout

    @property
    def config(self) -> ResilienceConfig:
        """The configuration the next job is submitted with."""
        return load_config(self._base, self._overrides)

    def submit(self, command: Sequence[str]) -> ResilientJob:
        """Submit ``command`` (argv list; it runs once per rank) and return the job.

        Raises:
            ConfigError: empty or non-list command; invalid configuration.
            submitit.core.utils.FailedSubmissionError: sbatch refused the job.
        """
        from .submitit_launch import submit

        if isinstance(command, (str, bytes)) or not command:
            raise ConfigError("command must be a non-empty argv list, e.g. ['python', 'train.py']")
        cfg = self.config
        job = submit(list(command), nodes=cfg.job.nodes, spares=cfg.job.spares,
                     tasks_per_node=cfg.job.tasks_per_node,
                     job_dir=str(self.folder / "%j"), config=cfg, timeout_min=self._timeout_min,
                     executor_params=self._slurm)
        return ResilientJob(job, self.folder / str(job.job_id))


def _dedupe(options: Mapping[str, Any]) -> dict[str, Any]:
    """Later spellings of one option win (``slurm_mem`` then ``mem_gb``): the config
    refuses an option given twice, which two parameters are not."""
    out: dict[str, Any] = {}
    for key, value in options.items():
        name = key.strip().lstrip("-").replace("_", "-").lower() if isinstance(key, str) else key
        out.pop(name, None)
        out[name] = value
    return out


def _sections(value: Any) -> dict[str, Mapping[str, Any]]:
    if not isinstance(value, Mapping) or not all(isinstance(v, Mapping) for v in value.values()):
        raise ConfigError("recovery= takes config sections → keys, e.g. {'recovery': {'scale_in': False}}")
    return dict(value)
