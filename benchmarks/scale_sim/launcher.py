"""The supervisor's launcher adapter over simulated nodes (the ``Launcher`` contract of
``slurm_resilience/supervisor/adapters/launcher.py``).

``launch`` hands the worker's environment to the rank host that holds its node, which
starts a simulated rank there; ``kill`` ends it. Node probes answer by the node's fate,
set by the orchestrator (``fates``):

* alive: reachable, slurmd answers;
* ``killed``: slurmd refuses the connection (unreachable, at once);
* ``silent``: the connect succeeds (a frozen node's kernel still queues it) but the
  Slurm request is never answered: ``probe_slurmd`` returns after its whole deadline.

Slurm's node states stay ``ALLOCATED`` (slurmctld has not noticed within the run), and
a spare's health check passes at once.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Mapping, Sequence

from .common import Channel

log = logging.getLogger(__name__)

KILLED, SILENT = "killed", "silent"


def node_name(i: int) -> str:
    return f"sim{i:05d}"


def host_of(node: str, hosts: int) -> int:
    """Which rank host holds ``node`` (round robin over the node number)."""
    return int(node[3:]) % hosts


@dataclasses.dataclass
class SimStep:
    """A simulated worker's step; its exit code arrives from its rank host."""

    name: str
    node: str
    worker_id: str
    codes: Mapping[str, int]
    process: None = None

    def exit_code(self) -> int | None:
        return self.codes.get(self.worker_id)


class SimLauncher:
    def __init__(self, host_ports: Sequence[int]) -> None:
        self.hosts = [Channel.connect(p) for p in host_ports]
        self.codes: dict[str, int] = {}
        self.fates: dict[str, str] = {}
        self.isolated: dict[str, str] = {}
        self.launched = 0
        for i, ch in enumerate(self.hosts):
            ch.send(("hello", "launcher"))
            threading.Thread(target=self._exits, args=(ch,), name=f"sim-exits-{i}", daemon=True).start()

    def _exits(self, ch: Channel) -> None:
        while True:
            try:
                kind, wid, code = ch.recv()
            except (EOFError, OSError):
                return
            if kind == "exit":
                self.codes[wid] = code

    def _host(self, node: str) -> Channel:
        return self.hosts[host_of(node, len(self.hosts))]

    def launch(self, *, name: str, node: str, argv: Sequence[str], env: Mapping[str, str],
               log_path: str) -> SimStep:
        wid = env["SR_WORKER_ID"]
        self._host(node).send(("launch", dict(env)))
        self.launched += 1
        return SimStep(name=name, node=node, worker_id=wid, codes=self.codes)

    def attach(self, *, name: str, node: str, pid: int | None) -> SimStep:
        raise NotImplementedError("the scale harness never re-attaches a supervisor")

    def kill(self, handle: SimStep) -> None:
        self._host(handle.node).send(("kill", handle.worker_id))

    def node_reachable(self, node: str, timeout_s: float) -> bool:
        return self.fates.get(node) != KILLED

    def probe_slurmd(self, node: str, step_names: Sequence[str], deadline_s: float) -> tuple[bool | None, str]:
        fate = self.fates.get(node)
        if fate == KILLED:
            return False, "slurmd port refused (simulated)"
        if fate == SILENT:
            time.sleep(deadline_s)
            return False, f"slurmd silent past {deadline_s:g} s (simulated)"
        return True, "answered (simulated)"

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        return {n: "ALLOCATED" for n in nodes}

    def isolate(self, node: str, state: str, reason: str) -> None:
        self.isolated[node] = reason

    def address(self, node: str) -> str:
        return "127.0.0.1"

    def run_check(self, node: str, argv: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
        return 0, "healthy (simulated)"
