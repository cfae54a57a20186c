"""Job steps inside the allocation: one ``srun --no-kill`` step per worker.

``--no-kill`` keeps a step alive when another node of the job fails; ``--overlap``
lets a restarted step share a node with a dead step that Slurm has not reaped yet
(otherwise ``srun`` loops on "Requested nodes are busy").
"""

from __future__ import annotations

import dataclasses
import os
import socket
import subprocess
from typing import Mapping, Sequence

from . import commands
from .parse import validate_node_name


@dataclasses.dataclass
class SrunStep:
    name: str
    node: str
    process: subprocess.Popen

    def exit_code(self) -> int | None:
        return self.process.poll()


class SrunLauncher:
    """Launch workers as job steps of ``job_id``; probe and isolate nodes through Slurm."""

    def __init__(self, job_id: str, nodes: Sequence[str]) -> None:
        self.job_id = job_id
        info = commands.show_nodes(list(nodes))
        self._addr = {n: commands.node_address(info[n]) for n in nodes}

    def launch(self, *, name: str, node: str, argv: Sequence[str],
               env: Mapping[str, str], log_path: str) -> SrunStep:
        validate_node_name(node)
        srun = ["srun", "--no-kill", "--overlap", "-N1", "-n1", "-w", node,
                f"--jobid={self.job_id}", f"--job-name={name}", "--kill-on-bad-exit=0"]
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            proc = subprocess.Popen([*srun, *argv], env={**os.environ, **env},
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        return SrunStep(name=name, node=node, process=proc)

    def kill(self, handle: SrunStep) -> None:
        for step_id in self._step_ids(handle.name):
            try:
                commands.cancel_step(self.job_id, step_id, signal="KILL")
            except commands.SlurmCommandError:
                pass  # the step already ended
        if handle.process.poll() is None:
            handle.process.kill()  # the srun client we started, by its Popen

    def _step_ids(self, name: str) -> list[str]:
        out = commands.run(["squeue", "-h", "-s", "-j", self.job_id, "-o", "%i %j"], timeout=5).stdout
        ids = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == name and "." in parts[0]:
                ids.append(parts[0].split(".", 1)[1])
        return ids

    def node_reachable(self, node: str, timeout_s: float) -> bool:
        addr, port = self._addr[node]
        try:
            with socket.create_connection((addr, port or 6818), timeout=timeout_s):
                return True
        except OSError:
            return False

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        info = commands.show_nodes(list(nodes))
        return {n: info[n].get("State", "UNKNOWN") for n in nodes if n in info}

    def isolate(self, node: str, state: str, reason: str) -> None:
        commands.set_node_state(node, state, reason)

    def address(self, node: str) -> str:
        return self._addr[node][0]

    def requeue(self) -> None:
        """Job-level: put the whole job back in the queue (it resumes from checkpoints)."""
        commands.run(["scontrol", "requeue", self.job_id], timeout=15)
