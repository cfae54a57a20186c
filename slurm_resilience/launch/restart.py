"""Job-level recovery of an unmodified program: submit it, and supervise it in the allocation.

``slurm-resilience run`` renders ``slurm_resilience/templates/restart.sbatch.tmpl`` and
submits it; the batch host then runs ``slurm-resilience restart-supervise``, which
is ``supervise_restart`` below (``supervisor/executors/relaunch.py`` carries out ``supervisor/decide/decide.py``'s decisions).
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


__all__ = ["TEMPLATE", "render_restart", "submit_restart", "wait_result", "supervise_restart", "mpi_choice"]


TEMPLATE = "restart.sbatch.tmpl"


def render_restart(cfg: ResilienceConfig, *, command: Sequence[str], config_path: str, job_dir: str,
                   mpi: bool = False, job_name: str = "sr-restart", python: str = sys.executable,
                   mpi_path: str = "auto") -> str:
    """Pure: the sbatch script text. Every user value is shell-quoted. ``mpi_path``
    other than ``auto`` is handed to the batch host's supervisor (``--mpi-path``).

    Raises:
        ConfigError: empty command, missing template, a line break in a value, bad partition.
    """
    return render(cfg, command=command, config_path=config_path, job_dir=job_dir, job_name=job_name,
                  python=python, template=TEMPLATE, extra={"mpi_flag": _mpi_flag(mpi, mpi_path)})


def _mpi_flag(mpi: bool, mpi_path: str) -> str:
    if not mpi:
        return ""
    return " --mpi" if mpi_path == "auto" else f" --mpi --mpi-path {mpi_path}"  # one of choose.REQUESTS


def submit_restart(cfg: ResilienceConfig, command: Sequence[str], job_dir: str, *, mpi: bool,
                   mpi_path: str = "auto") -> str:
    """Write the config and script into ``job_dir`` (0600/0700) and sbatch it; returns the job id.

    Raises:
        ConfigError, SlurmCommandError.
    """
    import yaml

    from ..slurm import commands

    makedirs_private(job_dir)
    cfg_path = write_private(os.path.join(job_dir, "submitted-config.yaml"), yaml.safe_dump(config_to_dict(cfg)))
    script = render_restart(cfg, command=command, config_path=cfg_path, job_dir=job_dir, mpi=mpi, mpi_path=mpi_path)
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
                      environ: Mapping[str, str] = os.environ, mpi_path: str = "auto") -> int:
    """Inside the allocation: run the restart supervisor; returns (and records) the exit code.
    An MPI program takes the path ``mpi.choose`` picks here, where it runs: in-place
    repair (``mpi.supervise``) or the relaunch below; one line and an ``mpi_path`` event say which.

    Raises:
        ResilienceError: not inside an allocation, or too few nodes;
        UlfmUnavailableError: ``mpi_path`` is ``in-place`` and ULFM cannot be trusted here.
    """
    from ..container.argv import for_job
    from ..slurm.parse import SlurmEnv
    from ..slurm.steps import SrunLauncher
    from ..supervisor.executors.relaunch import RelaunchExecutor, layout

    env = SlurmEnv.from_environ(environ)
    if env.job_id is None:
        raise ResilienceError("not inside a Slurm allocation (no SLURM_JOB_ID): use `slurm-resilience run`")
    lay = layout(env.nodelist, env.node_name, cfg.job.nodes, supervisor_node=cfg.job.supervisor_node)
    job_dir = os.path.abspath(job_dir or cfg.job.job_dir.format(job_id=env.job_id))
    launcher = SrunLauncher(env.job_id, [*lay.workers, *lay.spares],
                            container=for_job(cfg.container, job_id=env.job_id, job_dir=job_dir, cwd=os.getcwd()))
    launcher.clean_containers([*lay.workers, *lay.spares], stale=True)  # what ended jobs left there
    if mpi:
        code = _supervise_mpi(cfg, command, job_dir, lay, launcher, mpi_path, job_id=env.job_id)
        if code is not None:
            return write_result(job_dir, code)
    sup = RelaunchExecutor(config=cfg, command=command, job_dir=job_dir, job_id=env.job_id, layout=lay,
                            allocation=env.nodelist, launcher=launcher, mpi=mpi)
    return write_result(job_dir, sup.run())


def mpi_choice(cfg: ResilienceConfig, command: Sequence[str], mpi_path: str, *,
               workers: Sequence[str] | None = None, spares: Sequence[str] | None = None):
    """Probe the program's MPI on this host and choose its path (``mpi/choose.py``);
    returns ``(PathChoice, MpiProbe)``. Without nodes (at submission) the config's
    counts stand in for them.

    Raises:
        UlfmUnavailableError: ``in-place`` asked for and ruled out; ConfigError: a bad ``mpi_path``.
    """
    from ..errors import ConfigError
    from ..mpi.choose import REQUESTS, choose_path
    from ..mpi.launch import mpirun_argv
    from ..mpi.probe import probe
    from ..mpi.supervise import build_launch

    if mpi_path not in REQUESTS:
        raise ConfigError(f"--mpi-path={mpi_path!r}: choose one of {', '.join(REQUESTS)}")
    found = probe(command) if mpi_path != "relaunch" else None
    if workers is None:
        workers = [f"worker{i}" for i in range(1, cfg.job.nodes + 1)]
        spares = [f"spare{i}" for i in range(1, cfg.job.spares + 1)]
    launch = build_launch(prefix=(found.prefix if found else "") or "/", workers=workers, spares=spares or (),
                          per_node=cfg.job.tasks_per_node, addresses=())
    if found is None:
        from ..mpi.choose import MpiProbe
        found = MpiProbe(interpreter=None)
    choice = choose_path(found, requested=mpi_path, launch_argv=mpirun_argv(launch, command),
                         spare_ranks=launch.spare_ranks, container=cfg.container.runtime)
    return choice, found


def _supervise_mpi(cfg: ResilienceConfig, command: Sequence[str], job_dir: str, lay, launcher,
                   mpi_path: str, *, job_id: str) -> int | None:
    """The MPI path's line and event; runs the in-place path to its end (its exit code),
    or returns None for the relaunch path."""
    from ..events import EventLog
    from ..mpi.choose import MpiPath
    from ..mpi.supervise import UlfmSupervisor
    from ..protocol import EventKind

    makedirs_private(job_dir)
    choice, found = mpi_choice(cfg, command, mpi_path, workers=lay.workers, spares=lay.spares)
    print(f"[sr] {choice.line()}", flush=True)
    events = EventLog(os.path.join(job_dir, "events.jsonl"))
    try:
        events.emit(EventKind.MPI_PATH, path=choice.path.value, reason=choice.reason, job_id=job_id)
        if choice.path is not MpiPath.IN_PLACE:
            return None
        events.emit(EventKind.JOB_START, path="in-place", workers=list(lay.workers), spares=list(lay.spares),
                    command=list(command))
        return UlfmSupervisor(config=cfg, command=command, job_dir=job_dir, prefix=found.prefix,
                              workers=lay.workers, spares=lay.spares, launcher=launcher, events=events).run()
    finally:
        events.close()
