"""Workers as plain subprocesses on this host: the recovery logic without Slurm.

Nodes are names only; ``fail_node`` kills every process launched "on" a node and
marks it unreachable, which is what a lost node looks like to the supervisor.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
from typing import Mapping, Sequence


@dataclasses.dataclass
class LocalStep:
    name: str
    node: str
    process: subprocess.Popen

    def exit_code(self) -> int | None:
        return self.process.poll()


class LocalLauncher:
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
        step = LocalStep(name=name, node=node, process=proc)
        self.steps.append(step)
        return step

    def kill(self, handle: LocalStep) -> None:
        if handle.process.poll() is None:
            handle.process.kill()

    def fail_node(self, node: str) -> None:
        self.lost.add(node)
        for step in self.steps:
            if step.node == node:
                self.kill(step)

    def node_reachable(self, node: str, timeout_s: float) -> bool:
        return node not in self.lost

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        return {n: ("DOWN*" if n in self.lost else "ALLOCATED") for n in nodes}

    def isolate(self, node: str, state: str, reason: str) -> None:
        self.isolated[node] = reason

    def address(self, node: str) -> str:
        return "127.0.0.1"
