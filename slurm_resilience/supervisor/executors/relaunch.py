"""Relaunch executor: carries the same decisions out for unmodified programs.

For scripts that do not use ``Session`` (an ordinary torchrun-style script, an
mpi4py program) nothing can be repaired in-process: the unit of recovery is the
job step. All ranks run as ONE step (``slurm.steps.srun_argv``)::

    srun --no-kill --overlap -N W -n W --ntasks-per-node=1 -w NODES --jobid=J
         --kill-on-bad-exit={0|1} [--mpi=pmix] -- cmd

An MPI step (``--mpi``) runs with ``--kill-on-bad-exit=1``: an MPI without ULFM tells
the survivors nothing when a rank dies, and they block in their next collective for
ever, so Slurm ends the whole step at the first task that exits non-zero or by a
signal, ``srun`` exits non-zero, and that exit is the fault (``srun: error: n3: task 1:
Killed`` in the step's output names the rank: ``observe/step_output.py``). A torch
step keeps ``=0``. A stopped MPI rank (SIGSTOP, a dead loop) ends nothing: an MPI
step whose progress lines stop past the hard step timeout (``detect.progress_hard_s``,
or ``progress_factor`` x its longest recent step) is a PROCESS_HUNG fault
(``step_output.stalled_step``), its step killed and relaunched like a dead one.

``decide`` answers a fault with PROCESS_RESTART (a process died on healthy nodes:
the step again, in place, within ``recovery.fault_retry_times``) or NODE_REPLACEMENT
(each lost node's slot given to a spare; the node is isolated), both carried out
here as :class:`~.messages.Relaunch`. The program resumes from its own snapshot;
``SR_RESTART`` tells it how many relaunches came before.

    watch (step exit, slurmd probe, Slurm node state, an MPI step's progress) → StepFaults / AllDone
      → decide (the ladder, without ONLINE and SCALE_IN) → Relaunch | Isolate | Exit

The recovery ends at the relaunched program's first step: each step's tasks get
``SR_PROGRESS_FILE`` (``JOBDIR/progress-NNN.log``, one per relaunch), and the first line
the program appends there (``STEP UNIX_TIME`` per completed step) is a
:class:`~.messages.StepTrained` (``relaunch_recovery.py`` logs the phases and
``recovery_done``). The lines the supervisor writes go to its output,
``JOBDIR/supervisor.log``, in the online supervisor's format.

Open MPI 4.1 as shipped by Debian has no ULFM, so MPI recovery is relaunch-based too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from ...config import ResilienceConfig
from ...config.timeouts import nccl_environ
from ...container import argv as container
from ...errors import ResilienceError, SlurmCommandError
from ...events import EventLog
from ...files import makedirs_private
from ...lifecycle import JobPhase
from ...model import RankTable
from ...protocol import RUN_JOB_DIR_VAR, PlanAction
from ...zygote_protocol import warm_entry
from ...slurm.options import srun_args
from ...slurm.steps import srun_argv
from . import loop, relaunch_preempt
from ..decide.classify import find_faults, lost_nodes, node_unhealthy
from ..adapters.isolate import Isolator
from ..adapters.launcher import CleansContainers
from ..decide.messages import (
    Action, AllDone, DrainEvents, Emit, Exit, Isolate, Observation, Phase, Preempted, Publish, Published, Reap,
    Relaunch, Requeue, Say, ShutDownStandbys, Start, StepFaults, StepTrained,
)
from ..adapters.status import StatusMode, status_dict, write_status
from ..observe.step_output import (
    PROGRESS_VAR, ProgressTail, first_progress, name_first_exit, progress_path, read_from, read_tail,
    stalled_step, step_in_output,
)
from ..decide.state import Mode, Policy, SupervisorState
from ..adapters.warm import WarmStep, ZygotePool


__all__ = ["PORT_BASE", "Layout", "layout", "master_port", "master_node", "step_argv", "RelaunchExecutor"]


PORT_BASE = 20000  # below Linux's ephemeral range (32768-60999), above the usual services


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


def master_port(job_id: str, attempt: int) -> int:
    """Rendezvous port: fixed per (job, relaunch), in [20000, 30000).

    Derived, not probed: the master runs on a worker node, where the supervisor
    cannot test a port. A new port per relaunch keeps a new rendezvous clear of a
    socket of the previous step that the kernel has not released yet.
    """
    return PORT_BASE + (int(job_id) % 100) * 100 + attempt % 100


def master_node(nodes: Sequence[str], allocation: Sequence[str]) -> str:
    """Slurm gives task 0 to the step's first node in allocation order, not ``-w`` order."""
    return min(nodes, key=lambda n: allocation.index(n) if n in allocation else len(allocation))


def step_argv(*, job_id: str, name: str, nodes: Sequence[str], command: Sequence[str], mpi: bool,
              master_addr: str, port: int, attempt: int, tasks_per_node: int = 1,
              python: str = sys.executable, srun_options: Sequence[str] = (),
              step_container: "container.StepContainer | None" = None) -> list[str]:
    """The all-ranks step's argv (never a shell): G tasks on each of ``nodes``; torch
    mode wraps ``command`` in ``rankenv`` (the torchrun environment per task).
    ``srun_options``: the site's step options as argv (``job.srun_options``).
    ``step_container``: every task runs in it (``rankenv`` then runs as the image's
    ``python3``; a podman container per task, ``sr-JOB-{node}-restartN-{task}``)."""
    argv = srun_argv(job_id=job_id, name=name, nodes=nodes, tasks_per_node=tasks_per_node, mpi=mpi,
                     end_on_bad_exit=mpi, options=[*srun_options, *container.srun_options(step_container)])
    if mpi:
        inner = list(command)
    else:
        inner = [python if step_container is None else "python3", "-m", "slurm_resilience.rankenv",
                 "--master-addr", master_addr, "--master-port", str(port), "--restart", str(attempt), "--",
                 *command]
    cname = container.container_name(job_id, "{node}", f"restart{attempt}-{{task}}")
    return [*argv, "--", *container.wrap(step_container, inner, name=cname,
                                         env_names=["SR_RESTART", PROGRESS_VAR, RUN_JOB_DIR_VAR])]


@dataclasses.dataclass
class _Step:
    name: str
    node: str  # SrunLauncher.kill's handle shape
    process: subprocess.Popen


class RelaunchExecutor:
    """Launch, watch and relaunch one all-ranks step; ``run()`` returns the exit code.

    ``launcher`` is a ``slurm.steps.SrunLauncher`` (or a fake with ``kill``,
    ``node_reachable``, ``node_states``, ``isolate``, ``address``).
    """

    # Publish (but PERSIST's request file), ShutDownStandbys and DrainEvents are no-ops
    # here: no rank reads a plan, there are no standbys and no worker events.
    HANDLES = frozenset({Relaunch, Publish, Reap, Requeue, Isolate, Emit, Phase, Exit, Say, ShutDownStandbys,
                         DrainEvents})

    def __init__(self, *, config: ResilienceConfig, command: Sequence[str], job_dir: str, job_id: str,
                 layout: Layout, allocation: Sequence[str], launcher, mpi: bool = False,
                 poll_s: float = 0.1, probe_every_s: float = 0.5,
                 clock: Callable[[], float] = time.time, out=None) -> None:
        if not command:
            raise ResilienceError("no command given: add `-- python train.py ...`")
        self.cfg, self.command, self.job_id, self.mpi = config, list(command), job_id, mpi
        self.status_mode = StatusMode.MPI if mpi else StatusMode.TORCH  # status.json's and job_start's "mode"
        self.allocation, self.launcher = list(allocation), launcher
        self.poll_s, self.probe_every_s, self.clock = poll_s, probe_every_s, clock
        self.job_dir = job_dir
        self.out, self._t0 = out or sys.stdout, clock()  # out: the supervisor's lines (supervisor.log)
        self._nccl_env = nccl_environ(config.reconnect, os.environ)  # NCCL's watchdog, unless the user set it
        makedirs_private(job_dir)
        self.events = EventLog(os.path.join(job_dir, "events.jsonl"), clock=clock)
        self.isolator = Isolator(launcher, self.events.emit, config.recovery, job_id=job_id, say=self._say)
        self.policy = Policy.from_config(config, mode=Mode.RELAUNCH, can_requeue=False)
        nodes = [*layout.workers, *layout.spares]
        self.state = SupervisorState(
            job_id=job_id, phase=JobPhase.STARTING, table=RankTable(generation=0, slots=()),
            target_world=len(layout.workers), worker_nodes=layout.workers, spare_nodes=layout.spares,
            addresses={n: launcher.address(n) for n in nodes}, tasks_per_node=config.job.tasks_per_node)
        self.step: _Step | WarmStep | None = None
        self.attempt = self.generation = 0  # the running step's relaunch number and table generation
        self.trained = False  # its first progress line was reported
        self.out_pos = self.log_start = 0  # step-NNN.log: searched for run.step_pattern to here; this step's from
        self.step_pattern = re.compile(config.run.step_pattern) if config.run.step_pattern else None
        self.lost: set[str] = set()  # unreachable or unhealthy at the last look: a warm kill does not wait on them
        self.pace: ProgressTail | None = None  # an MPI step's progress lines (a hang ends nothing)
        self.zygotes: ZygotePool | None = None
        self.preempted = threading.Event()  # job.preempt_signal reached the supervisor (relaunch_preempt.py)
        self._preempt_seen = False
        # The zygotes run on the host: ranks in a container (container.runtime) start cold.
        if (config.run.warm and not mpi and config.container.runtime == "none"
                and warm_entry(self.command, sys.executable) is not None):
            self.zygotes = ZygotePool(job_dir=job_dir, nodes=nodes, launcher=launcher, preload=config.run.preload,
                                      env=self._nccl_env)

    def run(self) -> int:
        """Run the job to its end under ``decide``; returns the supervisor's exit code."""
        start = Start(info={"job_id": self.job_id, "mode": self.status_mode.value,
                            "nodes": list(self.state.worker_nodes), "command": self.command})
        signum = self.cfg.job.preempt_signum
        if signum is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signum, lambda *_: self.preempted.set())
        try:
            code, self.state = loop.run(self, self.state, self.policy, [start], clock=self.clock)
            return code
        finally:
            if self.zygotes is not None:
                self.zygotes.close()
            self.isolator.join()
            if isinstance(self.launcher, CleansContainers):
                self.launcher.clean_containers([*self.state.worker_nodes, *self.state.spare_nodes])
            self.events.close()

    # -- the executor's side of loop.run -----------------------------------------------
    def changed(self, state: SupervisorState) -> None:
        """Keep the newest state (the relaunch path saves nothing per change)."""
        self.state = state

    def observe(self, state: SupervisorState) -> list[Observation]:
        """Block until the step exits or a node fault shows."""
        next_probe = next_states = 0.0
        reachable: dict[str, bool | None] = {}
        states: dict[str, str] = {}
        nodes = list(state.table.node_list)
        while True:
            if self.preempted.is_set() and not self._preempt_seen:
                self._preempt_seen = True
                return [Preempted(self.cfg.job.preempt_signal_name)]
            code = self.step.process.poll()
            trained = self._progress()  # before the exit or the fault that may follow it
            if trained:
                return trained
            now = time.monotonic()
            if code is not None or now >= next_probe:
                reachable = self._probe(nodes)
                next_probe = now + self.probe_every_s
            if code is not None or now >= next_states:
                states = self._states(nodes)
                next_states = now + self.cfg.detect.node_poll_s
            faults = find_faults(nodes, exit_code=code, reachable=reachable, states=states, now=self.clock())
            if code is None and not faults and self.pace is not None:  # an MPI step: hung ranks end nothing
                self.pace.poll(now)
                quiet = None if self.pace.seen_at is None else now - self.pace.seen_at
                hung = stalled_step(nodes, quiet_s=quiet, steps=self.pace.steps, now=self.clock(),
                                    hard_s=self.cfg.detect.progress_hard_s, factor=self.cfg.detect.progress_factor)
                faults = [hung] if hung else []
            if code is not None or faults:
                self.lost = set(lost_nodes(nodes, reachable, states))  # unreachable, or frozen (Slurm says)
                if not faults:
                    return [AllDone()]
                if code is not None:  # srun's last lines name the task that ended it
                    faults = name_first_exit(faults, read_tail(self._step_log(self.attempt), self.log_start))
                return [StepFaults(tuple(faults), self.clock(), step=self.step.name, bad_spares=self._bad_spares(state))]
            time.sleep(self.poll_s)

    def execute(self, state: SupervisorState, action: Action) -> list[Observation]:
        """Carry out one action (``contract.carry_out`` refuses those this executor does not handle)."""
        if isinstance(action, Relaunch):
            if self.step is not None:
                self._cancel(self.step)
            self.step = self._launch(action.table, action.attempt)
            self.attempt, self.generation, self.trained = action.attempt, action.table.generation, False
            return [Published(action.table.generation, self.clock())]  # the relaunched step runs
        elif isinstance(action, Publish) and action.plan.action is PlanAction.PERSIST:
            relaunch_preempt.write_request(self.job_dir, signal_name=self.cfg.job.preempt_signal_name)
        elif isinstance(action, Reap):
            if self.step is not None and self._preempt_seen:  # the program persists and exits by itself
                wait = relaunch_preempt.persist_wait_s(action.grace_s, self.cfg.job.preempt_signal)
                t0 = time.monotonic()
                while self.step.process.poll() is None and time.monotonic() < t0 + wait:  # warm: poll() only
                    time.sleep(self.poll_s)
                self._say(f"the step exited by itself {time.monotonic() - t0:.1f} s after the persist request"
                          if self.step.process.poll() is not None else
                          f"the step did not exit within {wait:g} s of the persist request: cancelled")
            if self.step is not None and self.step.process.poll() is None:
                self._cancel(self.step)
        elif isinstance(action, Requeue):
            self.launcher.requeue()  # Slurm then ends this process (SIGTERM); the job restarts here
        elif isinstance(action, Isolate):
            self.isolator.start(action.node, action.state, action.reason)
        elif isinstance(action, Emit):
            self.events.emit(action.kind, **action.fields)
        elif isinstance(action, Phase):
            write_status(self.job_dir, status_dict(state, mode=self.status_mode,
                                                   retry_budget=self.cfg.recovery.fault_retry_times))
        elif isinstance(action, Exit) and action.error:
            print(f"slurm-resilience: error: {action.error}", file=sys.stderr, flush=True)
        elif isinstance(action, Say):
            self._say(action.text)  # the program's output is in step-NNN.log, not here
        return []

    def _say(self, text: str) -> None:
        print(f"[sr +{self.clock() - self._t0:8.3f}s] {text}", file=self.out, flush=True)

    def _progress(self) -> list[Observation]:
        """The running step's first progress line (``first_progress``) or, with
        ``run.step_pattern``, the first line of its output that matches, once."""
        if self.trained or self.step is None:
            return []
        data = read_from(progress_path(self.job_dir, self.attempt), 0)
        got = None if data is None else first_progress(data)
        if got is None and self.step_pattern is not None:
            data = read_from(self._step_log(self.attempt), self.out_pos) or b""
            whole = data[:data.rfind(b"\n") + 1]  # complete lines only: the rest is read again
            self.out_pos += len(whole)
            got = step_in_output(whole, self.step_pattern)
        if got is None:
            return []
        self.trained = True
        step, t = got
        return [StepTrained(self.generation, t if t is not None else self.clock(), step)]

    # -- adapters ------------------------------------------------------------------------
    def _step_log(self, attempt: int) -> str:
        return os.path.join(self.job_dir, f"step-{attempt:03d}.log")

    def _launch(self, table: RankTable, attempt: int) -> _Step | WarmStep:
        name = f"sr-restart-{attempt}"
        nodes = list(table.node_list)
        master = master_node(nodes, self.allocation)
        log_path = self._step_log(attempt)
        # run.step_pattern: its output is searched from here (a reused job dir's log has older lines)
        self.out_pos = self.log_start = os.path.getsize(log_path) if os.path.exists(log_path) else 0
        progress = progress_path(self.job_dir, attempt)
        with contextlib.suppress(FileNotFoundError):  # a reused job dir's: never this step's first step
            os.unlink(progress)
        relaunch_preempt.clear_request(self.job_dir)
        self.pace = ProgressTail(progress) if self.mpi else None
        if self.zygotes is not None:
            if attempt == 0:  # the zygotes started with the job; later ones are long up
                self.zygotes.wait_ready(nodes, self.cfg.run.zygote_start_s)
            order = sorted(nodes, key=lambda n: self.allocation.index(n) if n in self.allocation else len(nodes))
            warm = self.zygotes.fork_step(name=name, nodes=order, tasks_per_node=table.tasks_per_node,
                                          command=self.command, master_addr=self.launcher.address(master),
                                          port=master_port(self.job_id, attempt), attempt=attempt,
                                          log_path=log_path, progress_file=progress, job_dir=self.job_dir)
            if warm is not None:
                return warm
        argv = step_argv(job_id=self.job_id, name=name, nodes=nodes, command=self.command, mpi=self.mpi,
                         master_addr=self.launcher.address(master), port=master_port(self.job_id, attempt),
                         attempt=attempt, tasks_per_node=table.tasks_per_node,
                         srun_options=srun_args(self.cfg.job.srun_options),
                         step_container=getattr(self.launcher, "container", None))
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            proc = subprocess.Popen(argv, env={**os.environ, **self._nccl_env, "SR_RESTART": str(attempt),
                                               PROGRESS_VAR: progress, RUN_JOB_DIR_VAR: self.job_dir},
                                    stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    start_new_session=True)
        return _Step(name=name, node=master, process=proc)

    def _probe(self, nodes: Sequence[str]) -> dict[str, bool | None]:
        return {n: self.launcher.node_reachable(n, self.cfg.detect.probe_timeout_s) for n in nodes}

    def _states(self, nodes: Sequence[str]) -> dict[str, str]:
        try:
            return self.launcher.node_states(nodes)
        except SlurmCommandError as exc:  # the controller is slow: the probe still decides
            print(f"slurm-resilience: warning: node state unavailable: {exc}", file=sys.stderr, flush=True)
            return {}

    def _bad_spares(self, state: SupervisorState) -> frozenset[str]:
        """A spare that is down or unreachable is never chosen."""
        free = state.free_spares(Mode.RELAUNCH)
        reachable, states = self._probe(free), self._states(free)
        return frozenset(s for s in free if reachable.get(s) is False or node_unhealthy(states.get(s)))

    def _cancel(self, step: _Step | WarmStep) -> None:
        """``scancel --signal=KILL J.S`` (step found by name), then the srun client itself;
        a warm step: SIGKILL through the zygotes, lost nodes fenced by Slurm (``warm.py``)."""
        if isinstance(step, WarmStep):
            step.kill(skip=tuple(self.lost))
            return
        self.launcher.kill(step)
        try:
            step.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            print(f"slurm-resilience: warning: srun of {step.name} did not exit", file=sys.stderr, flush=True)
