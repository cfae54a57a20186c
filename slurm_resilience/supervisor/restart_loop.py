"""Job-level recovery for unmodified programs: relaunch the whole step, on a spare.

For scripts that do not use ``Session`` (an ordinary torchrun-style script, an
mpi4py program) nothing can be repaired in-process: the unit of recovery is the
job step. All ranks run as ONE step::

    srun --no-kill --overlap -N W -n W --ntasks-per-node=1 -w NODES --jobid=J [--mpi=pmix] -- cmd

and on a fault the step is cancelled and launched again, on the same nodes (a
process died on a healthy node) or with each lost node's slot given to a spare
(the node is isolated with ``scontrol update state=DOWN``). The program resumes
from its own snapshot; ``SR_RESTART`` tells it how many relaunches came before.

    watch (step exit, slurmd probe, Slurm node state)
      -> find_faults (pure, classify.py)  -> plan_restart (pure)
      -> isolate (thread) + cancel step   -> relaunch | done | fail (exit 3)

Open MPI 4.1 as shipped by Debian has no ULFM, so MPI recovery is relaunch-based too.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import subprocess
import sys
import threading
import time
from typing import Callable, Collection, Mapping, Sequence

from ..config import ResilienceConfig
from ..errors import ResilienceError, SlurmCommandError
from ..events import EventLog
from ..files import makedirs_private, write_private
from ..lifecycle import JobPhase, Lifecycle
from ..model import Fault, FaultKind
from ..slurm.parse import compress_hostlist, node_state_flags, validate_node_name
from .classify import UNHEALTHY_FLAGS, classify_fault, is_node_fault
from .replace import choose_spares

__all__ = ["Layout", "layout", "next_nodes", "find_faults", "Action", "RestartPlan", "plan_restart",
           "master_port", "master_node", "srun_argv", "RestartSupervisor", "EXIT_NO_RECOVERY"]

EXIT_NO_RECOVERY = 3
PORT_BASE = 20000  # below Linux's ephemeral range (32768-60999), above the usual services


# ---------------------------------------------------------------- pure decisions

@dataclasses.dataclass(frozen=True)
class Layout:
    """Who runs where: the batch host only supervises; workers, then spares."""

    supervisor: str | None
    workers: tuple[str, ...]
    spares: tuple[str, ...]


def layout(nodelist: Sequence[str], me: str | None, nodes: int, *, supervisor_node: bool = True) -> Layout:
    """Split the allocation (in job order) into supervisor, ``nodes`` workers and spares.

    Raises:
        ResilienceError: fewer usable nodes than ``nodes``.
    """
    pool = [n for n in nodelist if n != me] if supervisor_node else list(nodelist)
    if len(pool) < nodes:
        raise ResilienceError(f"allocation has {len(pool)} node(s) for {nodes} worker(s): "
                              f"submit with --nodes {nodes} (1 + nodes + spares are allocated)")
    return Layout(me if supervisor_node else None, tuple(pool[:nodes]), tuple(pool[nodes:]))


def next_nodes(current: Sequence[str], lost: Collection[str], spares: Sequence[str],
               excluded: Collection[str]) -> list[str] | None:
    """Node list of the relaunched step: each lost node's slot goes to a distinct spare.

    Spares in ``current`` (already in use) or ``excluded`` (isolated, unreachable)
    are never chosen. None when some lost node finds no spare.
    """
    failed = [n for n in current if n in lost]
    mapping = choose_spares(spares, set(excluded) | set(current), failed)
    if any(node is None for node in mapping.values()):
        return None
    return [mapping.get(n) or n for n in current]


def find_faults(nodes: Sequence[str], *, exit_code: int | None, reachable: Mapping[str, bool | None],
                states: Mapping[str, str], now: float) -> list[Fault]:
    """Classify what was observed about one step on ``nodes`` (pure).

    Every unreachable or unhealthy node is a node fault; otherwise a non-zero exit
    is one PROCESS_DIED fault of the whole step (which rank is unknown). A clean
    exit on healthy nodes, or a running step on healthy nodes, is no fault.
    """
    faults = []
    for node in nodes:
        if reachable.get(node) is False or _unhealthy_flags(states.get(node)):
            faults.append(classify_fault(rank=None, node=node, process_exited=exit_code is not None,
                                         slurmd_reachable=reachable.get(node), heartbeat_stale=False,
                                         slurm_node_state=states.get(node), now=now))
    if not faults and exit_code not in (None, 0):
        fault = classify_fault(rank=None, node=compress_hostlist(nodes), process_exited=True,
                               slurmd_reachable=True, heartbeat_stale=False, slurm_node_state=None, now=now)
        faults.append(dataclasses.replace(fault, detail=f"{fault.detail}; step exit code {exit_code}"))
    return faults


def _unhealthy_flags(state: str | None) -> frozenset[str]:
    return node_state_flags(state) & UNHEALTHY_FLAGS if state else frozenset()


class Action(enum.Enum):
    DONE = "done"
    RELAUNCH = "relaunch"
    FAIL = "fail"


@dataclasses.dataclass(frozen=True)
class RestartPlan:
    """What to do after a step ended or a fault was seen; ``nodes`` for a relaunch."""

    action: Action
    nodes: tuple[str, ...] = ()
    isolate: tuple[str, ...] = ()
    reason: str = ""


def plan_restart(faults: Sequence[Fault], *, current: Sequence[str], spares: Sequence[str],
                 excluded: Collection[str], restarts_used: int, budget: int) -> RestartPlan:
    """Pure: done, relaunch (in place or on spares) or fail, with the reason."""
    if not faults:
        return RestartPlan(Action.DONE, tuple(current), reason="step exited 0 on healthy nodes")
    lost = tuple(sorted({f.node for f in faults if is_node_fault(f.kind)}))
    if restarts_used >= budget:
        return RestartPlan(Action.FAIL, isolate=lost,
                           reason=f"restart budget spent ({restarts_used}/{budget} relaunches, "
                                  "recovery.fault_retry_times)")
    if not lost:
        return RestartPlan(Action.RELAUNCH, tuple(current),
                           reason=f"process died on healthy nodes: relaunch in place "
                                  f"({restarts_used + 1}/{budget})")
    new = next_nodes(current, lost, spares, excluded)
    if new is None:
        return RestartPlan(Action.FAIL, isolate=lost,
                           reason=f"node {', '.join(lost)} lost and no spare left "
                                  f"(spares: {', '.join(spares) or 'none'})")
    moved = ", ".join(f"{a}->{b}" for a, b in zip(current, new) if a != b)
    return RestartPlan(Action.RELAUNCH, tuple(new), isolate=lost,
                       reason=f"relaunch on spare(s) {moved} ({restarts_used + 1}/{budget})")


def master_port(job_id: str, restart: int) -> int:
    """Rendezvous port: fixed per (job, relaunch), in [20000, 30000).

    Derived, not probed: the master runs on a worker node, where the supervisor
    cannot test a port. A new port per relaunch keeps a new rendezvous clear of a
    socket of the previous step that the kernel has not released yet.
    """
    return PORT_BASE + (int(job_id) % 100) * 100 + restart % 100


def master_node(nodes: Sequence[str], allocation: Sequence[str]) -> str:
    """Slurm gives task 0 to the step's first node in allocation order, not ``-w`` order."""
    return min(nodes, key=lambda n: allocation.index(n) if n in allocation else len(allocation))


def srun_argv(*, job_id: str, name: str, nodes: Sequence[str], command: Sequence[str], mpi: bool,
              master_addr: str, port: int, restart: int, python: str = sys.executable) -> list[str]:
    """The step's argv (never a shell). torch mode wraps ``command`` in ``launch.rankenv``."""
    for n in nodes:
        validate_node_name(n)
    w = str(len(nodes))
    argv = ["srun", "--no-kill", "--overlap", "-N", w, "-n", w, "--ntasks-per-node=1",
            "-w", ",".join(nodes), f"--jobid={job_id}", f"--job-name={name}", "--kill-on-bad-exit=0"]
    if mpi:
        return [*argv, "--mpi=pmix", "--", *command]
    return [*argv, "--", python, "-m", "slurm_resilience.launch.rankenv", "--master-addr", master_addr,
            "--master-port", str(port), "--restart", str(restart), "--", *command]


# ---------------------------------------------------------------- the loop

@dataclasses.dataclass
class _Step:
    name: str
    node: str  # SrunLauncher.kill's handle shape
    process: subprocess.Popen


class RestartSupervisor:
    """Launch, watch and relaunch one all-ranks step; ``run()`` returns the exit code.

    ``launcher`` is a ``slurm.steps.SrunLauncher`` (or a fake with ``kill``,
    ``node_reachable``, ``node_states``, ``isolate``, ``address``).
    """

    def __init__(self, *, config: ResilienceConfig, command: Sequence[str], job_dir: str, job_id: str,
                 layout: Layout, allocation: Sequence[str], launcher, mpi: bool = False,
                 poll_s: float = 0.1, probe_every_s: float = 0.5,
                 clock: Callable[[], float] = time.time) -> None:
        if not command:
            raise ResilienceError("no command given: add `-- python train.py ...`")
        self.cfg, self.command, self.job_id, self.mpi = config, list(command), job_id, mpi
        self.layout, self.allocation, self.launcher = layout, list(allocation), launcher
        self.poll_s, self.probe_every_s, self.clock = poll_s, probe_every_s, clock
        self.job_dir = job_dir
        makedirs_private(job_dir)
        self.events = EventLog(os.path.join(job_dir, "events.jsonl"), clock=clock)
        self.lifecycle = Lifecycle(clock=clock)
        self.nodes = list(layout.workers)
        self.excluded: set[str] = set()
        self.restarts = 0
        self._isolations: list[threading.Thread] = []
        self._isolated: list[dict] = []

    def run(self) -> int:
        self.events.emit("job_start", job_id=self.job_id, mode="mpi" if self.mpi else "torch",
                         nodes=self.nodes, spares=list(self.layout.spares), command=self.command)
        try:
            return self._loop()
        finally:
            for t in self._isolations:
                t.join(timeout=20)
            for rec in self._isolated:
                self.events.emit("isolated", **rec)
            self.events.close()

    def _loop(self) -> int:
        while True:
            step = self._launch()
            self._phase(JobPhase.RUNNING, f"step {step.name} on {','.join(self.nodes)}")
            faults = self._watch(step)
            plan = plan_restart(faults, current=self.nodes, spares=self.layout.spares,
                                excluded=self.excluded, restarts_used=self.restarts,
                                budget=self.cfg.recovery.fault_retry_times)
            if plan.action is Action.DONE:
                self._phase(JobPhase.FINISHING, plan.reason)
                self._phase(JobPhase.SUCCEEDED, plan.reason)
                self.events.emit("job_done", restarts=self.restarts, nodes=self.nodes)
                return 0
            self.events.emit("fault_detected", faults=faults, step=step.name, action=plan.action,
                             reason=plan.reason)
            self._phase(JobPhase.RECOVERING, plan.reason)
            for node in plan.isolate:
                self._isolate(node, faults)
            self._cancel(step)
            if plan.action is Action.FAIL:
                self._phase(JobPhase.FAILED, plan.reason)
                self.events.emit("job_failed", reason=plan.reason, restarts=self.restarts)
                print(f"slurm-resilience: error: {plan.reason}; the program's own snapshots are kept",
                      file=sys.stderr, flush=True)
                return EXIT_NO_RECOVERY
            self.restarts += 1
            self.events.emit("relaunch", restart=self.restarts, nodes=list(plan.nodes),
                             previous=self.nodes, reason=plan.reason)
            self.nodes = list(plan.nodes)

    def _launch(self) -> _Step:
        name = f"sr-restart-{self.restarts}"
        master = master_node(self.nodes, self.allocation)
        argv = srun_argv(job_id=self.job_id, name=name, nodes=self.nodes, command=self.command,
                         mpi=self.mpi, master_addr=self.launcher.address(master),
                         port=master_port(self.job_id, self.restarts), restart=self.restarts)
        log_path = os.path.join(self.job_dir, f"step-{self.restarts:03d}.log")
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            proc = subprocess.Popen(argv, env={**os.environ, "SR_RESTART": str(self.restarts)},
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        return _Step(name=name, node=master, process=proc)

    def _watch(self, step: _Step) -> list[Fault]:
        """Block until the step exits or a node fault shows; returns the faults (maybe none)."""
        next_probe = next_states = 0.0
        reachable: dict[str, bool | None] = {}
        states: dict[str, str] = {}
        while True:
            code = step.process.poll()
            now = time.monotonic()
            if code is not None or now >= next_probe:
                reachable = self._probe(self.nodes)
                next_probe = now + self.probe_every_s
            if code is not None or now >= next_states:
                states = self._states(self.nodes)
                next_states = now + self.cfg.detect.node_poll_s
            faults = find_faults(self.nodes, exit_code=code, reachable=reachable, states=states,
                                 now=self.clock())
            if code is not None or faults:
                self._probe_spares()
                return faults
            time.sleep(self.poll_s)

    def _probe(self, nodes: Sequence[str]) -> dict[str, bool | None]:
        return {n: self.launcher.node_reachable(n, self.cfg.detect.probe_timeout_s) for n in nodes}

    def _states(self, nodes: Sequence[str]) -> dict[str, str]:
        try:
            return self.launcher.node_states(nodes)
        except SlurmCommandError as exc:  # the controller is slow: the probe still decides
            print(f"slurm-resilience: warning: node state unavailable: {exc}", file=sys.stderr, flush=True)
            return {}

    def _probe_spares(self) -> None:
        """A spare that is down or unreachable is never chosen."""
        free = [s for s in self.layout.spares if s not in self.nodes and s not in self.excluded]
        reachable, states = self._probe(free), self._states(free)
        self.excluded |= {s for s in free if reachable.get(s) is False or _unhealthy_flags(states.get(s))}

    def _isolate(self, node: str, faults: Sequence[Fault]) -> None:
        """``scontrol update state=DOWN`` off the critical path; the node is excluded at once."""
        self.excluded.add(node)
        kind = next((f.kind.value for f in faults if f.node == node), FaultKind.NODE_LOST.value)
        reason = f"slurm_resilience:{kind}:job{self.job_id}"

        def work() -> None:
            start = time.time()
            try:
                self.launcher.isolate(node, self.cfg.recovery.isolate_state, reason)
                error = None
            except (SlurmCommandError, ValueError) as exc:
                error = str(exc)
            self._isolated.append({"node": node, "start": start, "end": time.time(), "error": error})

        t = threading.Thread(target=work, name=f"isolate-{node}", daemon=True)
        t.start()
        self._isolations.append(t)

    def _cancel(self, step: _Step) -> None:
        """``scancel --signal=KILL J.S`` (step found by name), then the srun client itself."""
        self.launcher.kill(step)
        try:
            step.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            print(f"slurm-resilience: warning: srun of {step.name} did not exit", file=sys.stderr, flush=True)

    def _phase(self, to: JobPhase, reason: str) -> None:
        self.lifecycle.transition(to, reason)
        # the keys of the online supervisor's status too, so `slurm-resilience status` reads it
        order = sorted(self.nodes, key=lambda n: self.allocation.index(n) if n in self.allocation else 0)
        free = [s for s in self.layout.spares if s not in self.nodes and s not in self.excluded]
        write_private(os.path.join(self.job_dir, "status.json"), json.dumps({
            "job_id": self.job_id, "phase": to.value, "generation": self.restarts,
            "recoveries": self.restarts, "nodes": self.nodes,
            "ranks": [{"rank": r, "node": n, "pid": None, "step": None} for r, n in enumerate(order)],
            "spares": [{"node": s, "pid": None} for s in free], "excluded": sorted(self.excluded),
            "mode": "mpi" if self.mpi else "torch", "reason": reason, "t": self.clock()}))
