"""Runs inside a step, on the node, just before the container runtime.

    python -m slurm_resilience.container.enter -- podman run ... IMAGE CMD
    python -m slurm_resilience.container.enter --clean podman|enroot PREFIX

Run: fills in what only the node knows and ``exec``s the runtime (same pid, so
Slurm's signals reach it): ``{node}``/``{task}`` in the container's name
(``SLURMD_NODENAME``, ``SLURM_PROCID``); ``-e NAME`` for each ``SLURM_*`` variable
(``launch.rankenv`` reads them inside); and ``--cgroup-parent`` = this step's cgroup,
so that the container is one of the step's processes for Slurm: a cancelled step, a
failed node (and the lab's ``kill-node``) end it too; podman would otherwise start it
under its own ``libpod_parent``, outside the job.

Clean: removes the containers whose name starts with PREFIX (``{node}`` filled in),
only those; prints one line. Exit 1 when the runtime's command failed.
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Mapping, Sequence

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


def _clean(runtime: str, prefix: str) -> int:
    prefix = fill([prefix], os.environ)[0]
    listing = (["podman", "ps", "-a", "--format", "{{.Names}}"] if runtime == "podman" else ["enroot", "list"])
    try:
        out = subprocess.run(listing, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
    except FileNotFoundError:
        print(f"clean: {runtime} is not installed on {os.environ.get('SLURMD_NODENAME', 'this node')}")
        return 1
    if out.returncode != 0:
        print(f"clean: {' '.join(listing)} failed: {out.stderr.strip()}")
        return 1
    names = sorted({n.strip() for n in out.stdout.split() if n.strip().startswith(prefix)})
    if names:
        remove = (["podman", "rm", "-f", "-t", "0", *names] if runtime == "podman"
                  else ["enroot", "remove", "--force", *names])
        rm = subprocess.run(remove, capture_output=True, text=True, timeout=TIMEOUT_S, check=False)
        if rm.returncode != 0:
            print(f"clean: {' '.join(remove[:4])} failed: {rm.stderr.strip()}")
            return 1
    print(f"clean: removed {len(names)} container(s) {prefix}*: {' '.join(names)}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) == 3 and args[0] == "--clean" and args[1] in ("podman", "enroot"):
        return _clean(args[1], args[2])
    if len(args) < 2 or args[0] != "--":
        print("usage: enter -- RUNTIME ARGS... | enter --clean podman|enroot PREFIX", file=sys.stderr)
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
