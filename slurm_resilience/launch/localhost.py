"""Workers as plain subprocesses on this host: the recovery logic without Slurm.

Nodes are names only; ``fail_node`` kills every process launched "on" a node and
marks it unreachable, which is what a lost node looks like to the supervisor.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
from typing import Mapping, Sequence


__all__ = ["LocalStep", "AttachedLocalStep", "LocalLauncher"]


@dataclasses.dataclass
class LocalStep:
    """A worker this launcher started as a local process."""

    name: str
    node: str
    process: subprocess.Popen
    pid: int | None = None

    def exit_code(self) -> int | None:
        return self.process.poll()


@dataclasses.dataclass
class AttachedLocalStep:
    """A worker started by an earlier (killed) supervisor: watched and ended by pid."""

    name: str
    node: str
    pid: int | None
    process: None = None

    def exit_code(self) -> int | None:
        if self.pid is None:
            return -1
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            return -1  # gone: its exit status went to its (dead) parent
        return -1 if state in ("Z", "X") else None

    def ours(self) -> bool:
        """The pid still runs the worker this job started (not a reused pid)."""
        try:
            with open(f"/proc/{self.pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            return False
        return f"SR_WORKER_ID={self.name.removeprefix('sr-')}".encode() in env


class LocalLauncher:
    """The launcher with no Slurm: workers are local processes on named pseudo-nodes (``local``)."""

    def __init__(self) -> None:
        self.steps: list[LocalStep] = []
        self.lost: set[str] = set()
        self.isolated: dict[str, str] = {}

    def launch(self, *, name: str, node: str, argv: Sequence[str],
               env: Mapping[str, str], log_path: str) -> LocalStep:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            proc = subprocess.Popen(list(argv), env={**os.environ, **env}, stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        step = LocalStep(name=name, node=node, process=proc, pid=proc.pid)
        self.steps.append(step)
        return step

    def attach(self, *, name: str, node: str, pid: int | None) -> AttachedLocalStep:
        step = AttachedLocalStep(name=name, node=node, pid=pid)
        self.steps.append(step)
        return step

    def kill(self, handle) -> None:
        if isinstance(handle, AttachedLocalStep):
            if handle.exit_code() is None and handle.ours():
                os.kill(handle.pid, signal.SIGKILL)
        elif handle.process.poll() is None:
            handle.process.kill()

    def fail_node(self, node: str) -> None:
        self.lost.add(node)
        for step in self.steps:
            if step.node == node:
                self.kill(step)

    def node_reachable(self, node: str, timeout_s: float) -> bool:
        return node not in self.lost

    def probe_slurmd(self, node: str, step_names: Sequence[str], deadline_s: float) -> tuple[bool | None, str]:
        """No slurmd here: a node is silent once ``fail_node`` took it."""
        return (False, "node failed") if node in self.lost else (True, "local")

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        return {n: ("DOWN*" if n in self.lost else "ALLOCATED") for n in nodes}

    def isolate(self, node: str, state: str, reason: str) -> None:
        self.isolated[node] = reason

    def address(self, node: str) -> str:
        return "127.0.0.1"

    def run_check(self, node: str, argv: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
        """On this host, with ``SLURMD_NODENAME`` set to the pseudo-node (as srun would)."""
        if node in self.lost:
            return None, f"node {node} is unreachable"
        try:
            out = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout_s, check=False,
                                 env={**os.environ, "SLURMD_NODENAME": node}, stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired:
            return None, f"the health check did not end within {timeout_s:g}s"
        return out.returncode, out.stdout + out.stderr
