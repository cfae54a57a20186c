"""Runs inside a step, on the node, just before the container runtime.

    python -m slurm_resilience.container.enter -- podman run ... IMAGE CMD
    python -m slurm_resilience.container.enter --clean podman|enroot PREFIX
    python -m slurm_resilience.container.enter --clean-stale podman

Run: fills in what only the node knows and ``exec``s the runtime (same pid, so
Slurm's signals reach it): ``{node}``/``{task}`` in the container's name
(``SLURMD_NODENAME``, ``SLURM_PROCID``); ``-e NAME`` for each ``SLURM_*`` variable
(``rankenv`` reads them inside); and ``--cgroup-parent`` = this step's cgroup,
so that the container is one of the step's processes for Slurm: a cancelled step, a
failed node (and the lab's ``kill-node``) end it too; podman would otherwise start it
under its own ``libpod_parent``, outside the job.

Clean: removes the containers whose name starts with PREFIX (``{node}`` filled in),
only those; prints one line. Exit 1 when the runtime's command failed.
Clean-stale: removes ``sr-<job>-<this node>-…`` containers of jobs Slurm no longer
runs (a job that ended while this node was lost): a node back in service starts
clean at the next job (run by every podman job at its start).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping, Sequence


__all__ = ["TIMEOUT_S", "step_cgroup", "fill", "podman_run", "stale_names", "live_jobs", "main"]


TIMEOUT_S = 60


def step_cgroup(proc_cgroup: str) -> str | None:
    """Pure: the step's cgroup (v1 freezer, which Slurm's proctrack/cgroup tracks; or the
    v2 unified path) from ``/proc/self/cgroup``; None outside a Slurm step."""
    unified = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "freezer" and "/job_" in parts[2]:
            return parts[2]
        if parts[0] == "0" and "/job_" in parts[2]:
            unified = parts[2]
    return unified


def fill(argv: Sequence[str], environ: Mapping[str, str]) -> list[str]:
    """Pure: ``{node}``/``{task}`` in every argument, from Slurm's task variables."""
    node = environ.get("SLURMD_NODENAME", "")
    task = environ.get("SLURM_PROCID", "0")
    return [a.replace("{node}", node).replace("{task}", task) for a in argv]


def podman_run(argv: Sequence[str], environ: Mapping[str, str], cgroup: str | None) -> list[str]:
    """Pure: ``podman run`` with the step's cgroup and Slurm's variables added."""
    argv = fill(argv, environ)
    if argv[:2] != ["podman", "run"]:
        return argv
    extra = [f"--cgroup-parent={cgroup}"] if cgroup else []
    for name in sorted(environ):
        if name.startswith("SLURM_"):
            extra += ["-e", name]
    return [*argv[:2], *extra, *argv[2:]]


_LIVE = {"RUNNING", "PENDING", "REQUEUED", "SUSPENDED", "CONFIGURING", "COMPLETING", "RESIZING",
         "REQUEUE_HOLD", "REQUEUE_FED", "STOPPED", "SIGNALING", "STAGE_OUT"}


def stale_names(names: Sequence[str], node: str, live_jobs: set[str]) -> list[str]:
    """Pure: this toolkit's podman containers on ``node`` (``sr-<job>-<node>-…``) whose
    job is not alive any more: what a job that ended while the node was lost left."""
    out = []
    for name in names:
        job, sep, rest = name.removeprefix("sr-").partition("-")
        if name.startswith("sr-") and sep and job.isdigit() and rest.startswith(f"{node}-") and job not in live_jobs:
            out.append(name)
    return sorted(out)


def live_jobs(job_ids: Sequence[str]) -> set[str] | None:
    """Which of ``job_ids`` Slurm still has alive (one ``squeue``); None when unknown."""
    if not job_ids:
        return set()
    try:
        out = subprocess.run(["squeue", "-h", "-j", ",".join(job_ids), "-o", "%i %T"], capture_output=True,
                             text=True, timeout=TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return set() if "Invalid job id" in out.stderr else None
    return {ln.split()[0].split("_")[0] for ln in out.stdout.splitlines() if len(ln.split()) == 2
            and ln.split()[1] in _LIVE}


def _names(runtime: str) -> tuple[list[str] | None, str]:
    listing = (["podman", "ps", "-a", "--format", "{{.Names}}"] if runtime == "podman" else ["enroot", "list"])
    try:
        out = subprocess.run(listing, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except FileNotFoundError:
        return None, f"{runtime} is not installed on {os.environ.get('SLURMD_NODENAME', 'this node')}"
    if out.returncode != 0:
        return None, f"{' '.join(listing)} failed: {out.stderr.strip()}"
    return [n.strip() for n in out.stdout.split() if n.strip()], ""


def _remove(runtime: str, names: Sequence[str]) -> str:
    if not names:
        return ""
    remove = (["podman", "rm", "-f", "-t", "0", *names] if runtime == "podman"
              else ["enroot", "remove", "--force", *names])
    rm = subprocess.run(remove, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    return "" if rm.returncode == 0 else f"{' '.join(remove[:4])} failed: {rm.stderr.strip()}"


def _clean_stale() -> int:
    node = os.environ.get("SLURMD_NODENAME", "")
    names, why = _names("podman")
    if names is None or not node:
        print(f"clean-stale: {why or 'no SLURMD_NODENAME: not a Slurm step'}")
        return 1
    candidates = stale_names(names, node, set())
    alive = live_jobs(sorted({n.removeprefix("sr-").partition("-")[0] for n in candidates}))
    if alive is None:
        print("clean-stale: squeue failed: nothing removed")
        return 1
    stale = stale_names(candidates, node, alive)
    why = _remove("podman", stale)
    print(f"clean-stale: {why or f'removed {len(stale)} container(s) of ended jobs on {node}: ' + ' '.join(stale)}")
    return 1 if why else 0


def _clean(runtime: str, prefix: str) -> int:
    prefix = fill([prefix], os.environ)[0]
    names, why = _names(runtime)
    if names is None:
        print(f"clean: {why}")
        return 1
    names = sorted({n for n in names if n.startswith(prefix)})
    why = _remove(runtime, names)
    print(f"clean: {why or f'removed {len(names)} container(s) {prefix}*: ' + ' '.join(names)}")
    return 1 if why else 0


def main(argv: Sequence[str] | None = None) -> int:
    """``enter -- RUNTIME ARGS...`` (exec the runtime), ``--clean`` or ``--clean-stale``; 2 on bad usage."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "--clean" and args[1] in ("podman", "enroot"):
        return _clean(args[1], args[2])
    if args == ["--clean-stale", "podman"]:
        return _clean_stale()
    if len(args) < 2 or args[0] != "--":
        print("usage: enter -- RUNTIME ARGS... | enter --clean podman|enroot PREFIX | enter --clean-stale podman",
              file=sys.stderr)
        return 2
    try:
        with open("/proc/self/cgroup") as f:
            cgroup = step_cgroup(f.read())
    except OSError:
        cgroup = None
    run = podman_run(args[1:], os.environ, cgroup)
    try:
        os.execvp(run[0], run)
    except OSError as exc:
        print(f"slurm-resilience: error: cannot start {run[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    sys.exit(main())
