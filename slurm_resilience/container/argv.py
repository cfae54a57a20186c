"""Pure: the command lines that put a job's steps into its container, and take it away.

One builder per runtime (the table in docs/containers.md)::

    pyxis      srun ... --container-image=IMG --container-name=sr-JOB --container-mounts=...  CMD
    apptainer  srun ... apptainer exec [--nv] --bind ... --pwd DIR IMG CMD
    podman     srun ... PY -m slurm_resilience.container.enter -- podman run --rm --network=host
                   --ipc=host --pid=host --name=sr-JOB-NODE-WORKER -e NAME ... -v ... -w DIR IMG CMD

Host networking in every runtime: the store, the liveness channel and gloo/NCCL
connect to node addresses. Shared IPC: NCCL's shared-memory transport between the
ranks of one node. Host PID namespace (podman): pids a worker reports are the
node's, so fault drills and the supervisor's records name real processes.

Names: a podman container is ``sr-<job>-<node>-<worker>`` (a relaunch step's:
``sr-<job>-{node}-restart<N>-{task}``, filled in on the node by ``enter``); a pyxis
named container is ``sr-<job>``, which enroot stores as ``pyxis_<job>_sr-<job>`` under
pyxis' default ``container_scope=job``. Cleanup removes only names with the job's
prefix on the node it runs on.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Iterable, Sequence

from ..config.container import ContainerConfig, Runtime, parse_mount


__all__ = [
    "ENTER", "StepContainer", "for_job", "container_name", "node_prefix", "pyxis_name", "srun_options", "wrap",
    "cleanup_argv", "stale_cleanup_argv"
]


ENTER = "slurm_resilience.container.enter"


@dataclasses.dataclass(frozen=True)
class StepContainer:
    """The container of every step of one job (built once, by :func:`for_job`).

    ``mounts``: (src, dst, mode), the section's own plus the job directory and the
    working directory. ``python``: the node's interpreter that runs ``enter``
    (the supervisor's, which every node has at the same path).
    """

    config: ContainerConfig
    job_id: str
    mounts: tuple[tuple[str, str, str], ...]
    workdir: str
    python: str

    @property
    def runtime(self) -> Runtime:
        return self.config.kind


def for_job(config: ContainerConfig, *, job_id: str, job_dir: str, cwd: str,
            python: str = sys.executable) -> StepContainer | None:
    """The job's step container, or None for ``runtime: none``."""
    if config.kind is Runtime.NONE:
        return None
    workdir = config.workdir or cwd
    mounts = [parse_mount(m) for m in config.mounts]
    for path in (job_dir, workdir):
        if not any(dst == path for _, dst, _ in mounts):
            mounts.append((path, path, "rw"))
    return StepContainer(config=config, job_id=job_id, mounts=tuple(mounts), workdir=workdir, python=python)


def container_name(job_id: str, node: str, worker: str) -> str:
    """A podman container's name: ``sr-<job>-<node>-<worker>``."""
    return f"sr-{job_id}-{node}-{worker}"


def node_prefix(job_id: str, node: str) -> str:
    """Every podman container this job created on ``node`` starts with this."""
    return f"sr-{job_id}-{node}-"


def pyxis_name(job_id: str) -> str:
    """The job's pyxis container name (``--container-name``), one per job."""
    return f"sr-{job_id}"


def _mount_list(sc: StepContainer) -> list[str]:
    return [f"{src}:{dst}" + (":ro" if mode == "ro" else "") for src, dst, mode in sc.mounts]


def srun_options(sc: StepContainer | None) -> list[str]:
    """srun's own options for the step (pyxis); empty for the other runtimes."""
    if sc is None or sc.runtime is not Runtime.PYXIS:
        return []
    cfg = sc.config
    opts = [f"--container-image={cfg.image}", f"--container-name={pyxis_name(sc.job_id)}",
            f"--container-mounts={','.join(_mount_list(sc))}", f"--container-workdir={sc.workdir}"]
    if cfg.env:
        opts.append(f"--container-env={','.join(cfg.env)}")
    return [*opts, *cfg.extra_args]


def wrap(sc: StepContainer | None, command: Sequence[str], *, name: str, env_names: Iterable[str] = ()) -> list[str]:
    """The step's command, run inside the container (apptainer, podman); unchanged
    for pyxis (srun enters the container) and for no container.

    ``name``: the podman container's name (may hold ``{node}``/``{task}``, filled in
    by ``enter`` on the node). ``env_names``: variables of the step's environment the
    command needs (the worker's ``SR_*``); passed by name, never by value (the job's
    token is among them and argv is world-readable).
    """
    if sc is None or sc.runtime in (Runtime.NONE, Runtime.PYXIS):
        return list(command)
    cfg = sc.config
    if sc.runtime is Runtime.APPTAINER:
        # apptainer shares the host's network, IPC and PID namespaces and passes the
        # environment through unless told otherwise (--cleanenv in extra_args).
        argv = ["apptainer", "exec", *(["--nv"] if cfg.gpus else [])]
        argv += ["--bind", ",".join(_mount_list(sc)), "--pwd", sc.workdir]
        return [*argv, *cfg.extra_args, cfg.image, *command]
    argv = [sc.python, "-m", ENTER, "--", "podman", "run", "--rm", "--network=host", "--ipc=host", "--pid=host",
            f"--name={name}"]
    if cfg.gpus:
        argv += ["--device", "nvidia.com/gpu=all"]
    for env in sorted({*env_names, *cfg.env}):
        argv += ["-e", env]
    for mount in _mount_list(sc):
        argv += ["-v", mount]
    return [*argv, "-w", sc.workdir, *cfg.extra_args, cfg.image, *command]


def cleanup_argv(sc: StepContainer | None) -> list[str] | None:
    """What removes this job's containers on the node it runs on (run as a step on
    every node to clean; ``{node}`` is filled in there), or None when the runtime
    keeps nothing (apptainer exec, no container)."""
    if sc is None or sc.runtime in (Runtime.NONE, Runtime.APPTAINER):
        return None
    if sc.runtime is Runtime.PODMAN:
        return [sc.python, "-m", ENTER, "--clean", "podman", node_prefix(sc.job_id, "{node}")]
    return [sc.python, "-m", ENTER, "--clean", "enroot", f"pyxis_{sc.job_id}_{pyxis_name(sc.job_id)}"]


def stale_cleanup_argv(sc: StepContainer | None) -> list[str] | None:
    """What removes, on the node it runs on, podman containers that ended jobs left
    there (a job that ended while the node was lost): run at a job's start, so a node
    back in service starts clean. None for the other runtimes (pyxis removes named
    containers at the end of their job; apptainer keeps none)."""
    if sc is None or sc.runtime is not Runtime.PODMAN:
        return None
    return [sc.python, "-m", ENTER, "--clean-stale", "podman"]
