"""`slurm-resilience …`: submit, run, supervise (inside the allocation), local, timeline, status.

User mistakes end with one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from typing import Sequence

from .errors import ResilienceError
from .files import makedirs_private


__all__ = [
    "EXIT_USAGE", "cmd_supervise", "cmd_local", "cmd_submit", "cmd_run", "cmd_restart_supervise", "cmd_timeline",
    "cmd_status", "cmd_inject", "build_parser", "main"
]


EXIT_USAGE = 2


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config (sections job, detect, recovery, reconnect, checkpoint)")
    p.add_argument("--nodes", type=int, help="worker nodes (overrides job.nodes)")
    p.add_argument("--spares", type=int, help="spare nodes (overrides job.spares)")
    p.add_argument("--tasks-per-node", metavar="G",
                   help="ranks per node, one per GPU (overrides job.tasks_per_node; a spare holds G standbys)")
    p.add_argument("--job-dir", help="job directory (events, logs, rank tables, final state)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- python train.py ...")


def _site_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sbatch-option", action="append", metavar="KEY=VALUE",
                   help="an #SBATCH option, repeatable: account=proj, gres=gpu:8, exclusive (adds to job.sbatch_options)")
    p.add_argument("--srun-option", action="append", metavar="KEY=VALUE",
                   help="an option of every rank's step, repeatable: gpu-bind=closest (adds to job.srun_options)")
    p.add_argument("--setup", action="append", metavar="LINE",
                   help="a shell line run before the supervisor, repeatable: 'module load cuda' (adds to job.setup)")


def _no_reattach(args) -> None:
    if args.reattach:
        raise ResilienceError("--reattach is for the supervisor the batch step restarts; a job whose "
                              "batch step ended resumes from its checkpoints: run it again without --reattach")


def _supervisor_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)  # the keeper's supervisor
    p.add_argument("--reattach", action="store_true",
                   help="take over the running workers of a killed supervisor (JOBDIR/supervisor.json)")


def _tasks_per_node(value: str | None) -> int | None:
    """``--tasks-per-node`` as an int; the config checks >= 1 (one message for CLI and YAML).

    Raises:
        ConfigError: not an integer.
    """
    from .errors import ConfigError

    if value is None:
        return None
    try:
        return int(value, 10)
    except ValueError:
        raise ConfigError(f"--tasks-per-node={value!r} must be an integer >= 1: ranks per node, "
                          "one per GPU") from None


def _load(args):
    from .config import load_config

    job = {k: v for k, v in (("nodes", args.nodes), ("spares", args.spares),
                             ("tasks_per_node", _tasks_per_node(args.tasks_per_node))) if v is not None}
    cfg = load_config(args.config, {"job": job} if job else None)
    site = _site_overrides(cfg, args)
    if site:
        cfg = load_config(args.config, {"job": {**job, **site}})
    from .config.timeouts import nccl_environ

    nccl_environ(cfg.reconnect, os.environ)  # a user-set NCCL watchdog out of order: refused here, not in the job
    if cfg.checkpoint.init_from:  # not a DCP checkpoint: refused here, not at the job's first state sync
        from .checkpoint.dcp_io import dcp_keys
        from .errors import CheckpointError, ConfigError

        try:
            dcp_keys(cfg.checkpoint.init_from)
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    return cfg, command


def _site_overrides(cfg, args) -> dict:
    """``--sbatch-option``/``--srun-option``/``--setup`` added to the config's own
    (a flag's option replaces the config's value for that option).

    Raises:
        ConfigError: a malformed item (the config checks names and values).
    """
    from .slurm.options import OWNED_SBATCH, OWNED_SRUN, normalize, parse_cli

    out: dict = {}
    for flag, key, owned in (("--sbatch-option", "sbatch_options", OWNED_SBATCH),
                             ("--srun-option", "srun_options", OWNED_SRUN)):
        items = getattr(args, key.replace("_options", "_option"), None)
        if items:
            given = normalize(f"{flag}", parse_cli(flag, items), owned)
            out[key] = {**getattr(cfg.job, key), **given}
    if getattr(args, "setup", None):
        out["setup"] = [*cfg.job.setup, *args.setup]
    return out


def _job_dir(args, cfg, job_id: str) -> str:
    return os.path.abspath(args.job_dir or cfg.job.job_dir.format(job_id=job_id))


def cmd_supervise(args) -> int:
    """Inside the allocation: the batch step keeps the store and (re)starts the supervisor.
    Both end with ``exit_now`` once ``result.json`` is written: a requeue's next job
    waits on this one's end (``exits.py``)."""
    from .exits import exit_now
    from .launch.allocation import keep_allocation, supervise_allocation
    from .supervisor.executors.keeper import read_store_address

    cfg, command = _load(args)
    if not args.child:
        _no_reattach(args)
        exit_now(keep_allocation(cfg, command, args.job_dir, started=getattr(args, "started", None)))
    # the keeper wrote its store's port before starting this process (keeper.bind_store);
    # torch is imported only after the workers' launches (online.StoreLink)
    from .run_identity import from_environ

    run_id = from_environ(os.environ)  # the keeper's (keeper.keep_supervisor)
    _, port = read_store_address(args.job_dir, keeper_pid=os.getppid())
    exit_now(supervise_allocation(cfg, command, args.job_dir, run_id=run_id, store_port=port,
                                  reattach=args.reattach))


def cmd_local(args) -> int:
    """No Slurm: workers are local processes on named pseudo-nodes (for development)."""
    from .launch.allocation import write_result
    from .launch.localhost import LocalLauncher
    from .supervisor.executors.online import Supervisor

    from .supervisor.executors.keeper import keep_supervisor, read_store_address

    cfg, command = _load(args)
    if cfg.container.runtime != "none":
        raise ResilienceError(f"container.runtime={cfg.container.runtime} applies to Slurm jobs (submit, run); "
                              "`local` starts plain processes on this host: set runtime: none")
    nodes = [f"local{i}" for i in range(1, cfg.job.nodes + cfg.job.spares + 1)]
    from .run_identity import RUN_ID_ENV, from_environ

    if not args.child:
        _no_reattach(args)
        job_dir = _job_dir(args, cfg, f"local-{os.getpid()}")
        # run again in an existing job directory, a local job resumes (its run id is kept)
        return keep_supervisor(cfg, command, job_dir, "127.0.0.1", mode="local",
                               run_id=os.environ.get(RUN_ID_ENV) or None,
                               resumed=args.job_dir is not None and os.path.isdir(job_dir))
    job_id = f"local-{os.getppid()}"  # the keeper's pid, as in the job dir's default name
    run_id = from_environ(os.environ)  # the keeper's (keeper.keep_supervisor)
    _, port = read_store_address(args.job_dir, keeper_pid=os.getppid())
    sup = Supervisor(config=cfg, command=command, job_dir=args.job_dir, nodes=nodes,
                     launcher=LocalLauncher(), store_host="127.0.0.1", job_id=job_id, run_id=run_id,
                     store_port=port, reattach=args.reattach)
    return write_result(args.job_dir, sup.run())


def cmd_submit(args) -> int:
    """Render the sbatch script and submit it; with --wait, return the job's exit code."""
    from .launch.sbatch import render
    from .slurm import commands

    from .run_identity import continued, new_run_id

    cfg, command = _load(args)
    # every start of this submission (requeues, resubmissions of job.sbatch) is one run;
    # --continue-run makes it a start of an earlier submission's run (its checkpoints)
    given = getattr(args, "continue_run", None)
    run_id = continued(given) if given else new_run_id()
    job_dir = os.path.abspath(args.job_dir or cfg.job.job_dir.format(job_id=f"{int(time.time())}"))
    makedirs_private(job_dir)
    import yaml

    from .config import config_to_dict
    from .files import write_private

    cfg_path = write_private(os.path.join(job_dir, "submitted-config.yaml"),
                             yaml.safe_dump(config_to_dict(cfg)))
    script = render(cfg, command=command, config_path=cfg_path, job_dir=job_dir, hetjob=args.hetjob,
                    run_id=run_id)
    script_path = write_private(os.path.join(job_dir, "job.sbatch"), script, mode=0o700)
    job_id = commands.sbatch(script_path)
    print(f"submitted job {job_id}; job dir {job_dir}", flush=True)
    if not args.wait:
        return 0
    from .slurm.resubmit import successor

    while True:  # a job requeued by resubmitting (recovery.requeue_by) continues as its successor
        while commands.job_state(job_id) is not None:
            time.sleep(0.5)
        nxt = successor(job_dir, job_id)
        if nxt is None:
            break
        print(f"job {job_id} resubmitted as job {nxt}", flush=True)
        job_id = nxt
    try:
        with open(os.path.join(job_dir, "result.json")) as f:
            return int(json.load(f)["exit_code"])
    except FileNotFoundError:
        raise ResilienceError(f"job {job_id} ended without a result: see {job_dir}/supervisor.log") from None


def cmd_run(args) -> int:
    """Submit an unmodified program with job-level recovery (relaunch on a spare)."""
    from .launch.restart import submit_restart, wait_result

    cfg, command = _load(args)
    mpi_path = getattr(args, "mpi_path", "auto")
    if args.mpi:  # said before the job is queued; the batch host checks again where it runs
        from .launch.restart import mpi_choice

        print(mpi_choice(cfg, command, mpi_path)[0].line(), flush=True)
    elif mpi_path != "auto":
        raise ResilienceError(f"--mpi-path {mpi_path} applies to MPI programs: add --mpi")
    job_dir = os.path.abspath(args.job_dir or cfg.job.job_dir.format(job_id=f"{int(time.time())}"))
    job_id = submit_restart(cfg, command, job_dir, mpi=args.mpi, mpi_path=mpi_path)
    print(f"submitted job {job_id}; job dir {job_dir}", flush=True)
    return wait_result(job_id, job_dir) if args.wait else 0


def cmd_restart_supervise(args) -> int:
    """Inside the allocation: the batch host relaunches the program's step on faults."""
    from .launch.restart import supervise_restart

    cfg, command = _load(args)
    return supervise_restart(cfg, command, args.job_dir, mpi=args.mpi, mpi_path=args.mpi_path)


def cmd_timeline(args) -> int:
    """Print the job's recovery timeline from events.jsonl; with --png, draw it too."""
    from .events import format_timeline, read_events

    path = os.path.join(args.job_dir, "events.jsonl")
    if not os.path.exists(path):
        raise ResilienceError(f"no event log at {path}: is {args.job_dir} a job directory?")
    if args.png:  # checked before anything is printed or drawn
        folder = os.path.dirname(os.path.abspath(args.png))
        if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
            raise ResilienceError(f"--png {args.png}: {folder} is not a writable directory")
        if importlib.util.find_spec("matplotlib") is None:
            raise ResilienceError("--png needs matplotlib: pip install 'slurm-resilience[plot]'")
    events = read_events(path)
    if args.png and not events:
        raise ResilienceError(f"--png: {path} holds no events to draw")
    print(format_timeline(events))
    if args.png:
        from .inject import read_injections
        from .timeline_lanes import injected_fault_times
        from .timeline_plot import plot_timeline

        given = injected_fault_times(events, read_injections(args.job_dir))  # else: each fault's first sign
        print(f"plot: {plot_timeline(events, args.png, fault_times=given)}")
    return 0


def cmd_status(args) -> int:
    """Show the job's status.json (with --watch, until it ends)."""
    from .views import watch_status

    return watch_status(args.job_dir, interval=args.interval, once=not args.watch, out=sys.stdout)


def cmd_inject(args) -> int:
    """Inject a fault into a running job (see :mod:`slurm_resilience.inject`)."""
    from .inject import inject

    print(json.dumps(inject(args.fault, args.job, rank=args.rank, seconds=args.seconds,
                            path=args.path, probability=args.probability, rate=args.rate,
                            delay_ms=args.delay_ms)))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``slurm-resilience`` argument parser, one subcommand per ``cmd_*``."""
    ap = argparse.ArgumentParser(prog="slurm-resilience", description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("submit", help="submit a resilient job with sbatch")
    _common(p)
    p.add_argument("--wait", action="store_true", help="wait for the job; exit with its code")
    p.add_argument("--hetjob", action="store_true",
                   help="heterogeneous job: the supervisor on component 0, workers and spares on component 1")
    p.add_argument("--continue-run", metavar="JOBDIR|RUN_ID",
                   help="continue an earlier submission's run: restore its checkpoints (its job directory, "
                        "or the run id `ckpt list` shows); by default a submission is a run of its own")
    _site_flags(p)
    p.set_defaults(func=cmd_submit)
    p = sub.add_parser("supervise", help="(inside an allocation) run the supervisor")
    _common(p)
    _supervisor_flags(p)
    p.set_defaults(func=cmd_supervise)
    p = sub.add_parser("local", help="run the supervisor with local processes instead of Slurm")
    _common(p)
    _supervisor_flags(p)
    p.set_defaults(func=cmd_local)
    p = sub.add_parser("run", help="submit an unmodified (torchrun-style or MPI) program; relaunch on faults")
    _common(p)
    p.add_argument("--wait", action="store_true", help="wait for the job; exit with its code")
    p.add_argument("--mpi", action="store_true", help="MPI program: in-place repair (ULFM) when it can be "
                   "trusted, else relaunch through srun --mpi=pmix; one line says which and why")
    p.add_argument("--mpi-path", choices=("auto", "in-place", "relaunch"), default="auto",
                   help="with --mpi: auto (default) decides; in-place is an error where ULFM cannot be trusted")
    _site_flags(p)
    p.set_defaults(func=cmd_run)
    p = sub.add_parser("restart-supervise", help="(inside an allocation) the supervisor of `run`")
    _common(p)
    p.add_argument("--mpi", action="store_true")
    p.add_argument("--mpi-path", choices=("auto", "in-place", "relaunch"), default="auto")
    p.set_defaults(func=cmd_restart_supervise)
    from .checkpoint.inspect import add_parser as add_ckpt

    add_ckpt(sub)
    p = sub.add_parser("timeline", help="events and recovery phases of a job")
    p.add_argument("job_dir")
    p.add_argument("--png", help="also draw the picture: rank lanes, steps over time, each recovery zoomed in "
                   "(measured from the injected fault when JOBDIR/injected.jsonl has it)")
    p.set_defaults(func=cmd_timeline)
    p = sub.add_parser("status", help="nodes, ranks, generation, steps, checkpoints, spares")
    p.add_argument("job_dir")
    p.add_argument("--watch", action="store_true", help="refresh until the job ends")
    p.add_argument("--interval", type=float, default=1.0)
    p.set_defaults(func=cmd_status)
    from .inject import FAULTS

    import argparse as _ap
    from .inject import __doc__ as faults_doc

    p = sub.add_parser("inject", help="inject a fault into a running job (tests, drills)",
                       description=faults_doc, formatter_class=_ap.RawDescriptionHelpFormatter)
    p.add_argument("fault", choices=FAULTS)
    p.add_argument("--job", required=True, help="the job directory")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--seconds", type=float, default=5.0, help="slow-rank: how long; flap-node: how long cut off")
    p.add_argument("--probability", type=float, default=0.05, help="lossy-node: of dropping each packet")
    p.add_argument("--rate", default="1mbit", help="slow-node: its links' rate (800kbit, 2mbit, ...)")
    p.add_argument("--delay-ms", type=float, default=20.0, help="delay-node: how long each of its packets is held")
    p.add_argument("--path", help="corrupt-checkpoint: tier root; fill-disk: directory to fill")
    p.set_defaults(func=cmd_inject)
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    """``slurm-resilience``: run one subcommand; a ResilienceError is one line on stderr and exit 2."""
    started = time.time()  # the batch step's start, in a requeue's breakdown (store.json)
    args = build_parser().parse_args(argv)
    args.started = started
    try:
        return args.func(args)
    except ResilienceError as exc:
        print(f"slurm-resilience: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
