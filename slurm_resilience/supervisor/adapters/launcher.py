"""What the supervisor needs from whatever starts processes on nodes.

``Launcher`` is what every launcher does; ``Requeues``, ``CleansContainers`` and
``ReadsSlurmTimeouts`` are what only a launcher inside a scheduler can, checked with
``isinstance`` (the local launcher has none of them). Two adapters implement it:
:class:`~slurm_resilience.slurm.steps.SrunLauncher` (one ``srun --no-kill`` job step per worker inside the allocation) and
:class:`~slurm_resilience.launch.localhost.LocalLauncher` (plain subprocesses on
this host, for tests of the recovery logic without Slurm).
"""

from __future__ import annotations

import subprocess
from typing import Mapping, Protocol, Sequence, runtime_checkable


__all__ = ["StepHandle", "Launcher", "Requeues", "CleansContainers", "ReadsSlurmTimeouts"]


class StepHandle(Protocol):
    """One launched worker process (or the job step that hosts it). A handle taken
    over by a restarted supervisor (``Launcher.attach``) has no Popen of its own."""

    name: str
    node: str
    process: subprocess.Popen | None

    def exit_code(self) -> int | None:
        """None while running."""


class Launcher(Protocol):
    """Starts, attaches to and kills worker processes on nodes (Slurm steps, or local processes)."""

    def launch(self, *, name: str, node: str, argv: Sequence[str],
               env: Mapping[str, str], log_path: str) -> StepHandle:
        """Start ``argv`` on ``node`` with ``env`` added; output to ``log_path``."""

    def attach(self, *, name: str, node: str, pid: int | None) -> StepHandle:
        """A handle on a worker an earlier supervisor launched (``name``; ``pid`` where
        the launcher tracks processes) that is not a child of this process."""

    def kill(self, handle: StepHandle) -> None:
        """End the worker process(es) of ``handle`` now (SIGKILL)."""

    def node_reachable(self, node: str, timeout_s: float) -> bool:
        """Is the node's agent (slurmd) answering? False means the node is lost."""

    def probe_slurmd(self, node: str, step_names: Sequence[str], deadline_s: float) -> tuple[bool | None, str]:
        """Does the node's agent answer a real request (not only a TCP connect) within
        ``deadline_s``? (True/False/None unknown, why). Blocking: run off the loop."""

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        """Resource manager's state per node (e.g. ``IDLE``, ``DOWN*``)."""

    def isolate(self, node: str, state: str, reason: str) -> None:
        """Take the node out of service with a reason (may be slow: run off the critical path)."""

    def address(self, node: str) -> str:
        """Address other nodes use to reach ``node``."""

    def run_check(self, node: str, argv: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
        """Run ``argv`` on ``node`` to its end (a short step); (exit code or None on a
        time-out, its output)."""


@runtime_checkable
class Requeues(Protocol):
    """A launcher inside a scheduler: it can requeue (or resubmit) the job."""

    def requeue(self) -> None:
        """Requeue this job; the scheduler then ends this process."""


@runtime_checkable
class CleansContainers(Protocol):
    """A launcher that runs steps in containers and can remove what a job left on nodes."""

    def clean_containers(self, nodes: Sequence[str], *, stale: bool = False) -> dict[str, object]:
        """Remove this job's containers on ``nodes`` (``stale``: ended jobs' too)."""


@runtime_checkable
class ReadsSlurmTimeouts(Protocol):
    """A launcher that can read the site's Slurm timeouts (``scontrol show config``)."""

    def slurm_timeouts(self) -> tuple[float | None, float | None]:
        """(SlurmdTimeout, KillWait) in seconds (None: not known)."""
