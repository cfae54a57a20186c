"""Online executor: carries the decisions out for ``Session`` programs.

One job step per worker (ranks and warm standbys), the job's TCPStore (hosted by the
batch step, ``keeper.py``, or here), the liveness socket, the Slurm node-state
thread. Observations come from ``watch.py``; decisions from ``decide.py``; the loop
is ``loop.py``. The supervisor runs on a node of its own (the batch host): under
``--no-kill`` a job whose batch host dies is left headless, so that node is never a
worker or a spare.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import secrets
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Sequence

import yaml

from ...config import ResilienceConfig, config_to_dict
from ...config.timeouts import nccl_environ, slurm_warnings, timing_warnings
from ...errors import ConfigError, SlurmCommandError
from ...events import EventLog
from ...exits import FAST_EXIT_ENV
from ...files import makedirs_private, write_private
from ...health import health_argv
from ...lifecycle import JobPhase
from ...model import RankTable
from ...protocol import EventKind, Plan, Role, StoreKey, WorkerEnv, WorkerEvent, read_token, write_token
from ...run_identity import check_run_id
from . import loop, reattach
from ..decide.classify import node_unhealthy
from ..observe.detect import LivenessServer, NodeWatcher
from ..observe.checker import SpareChecker
from ..adapters.isolate import Isolator
from ..adapters.launcher import CleansContainers, Launcher, ReadsSlurmTimeouts, Requeues, StepHandle
from ..decide.messages import (
    Action, CheckSpare, DrainEvents, Emit, Exit, Isolate, Kill, Launch, Observation, Phase, Publish, Published, Reap,
    Requeue, Say, ShutDownStandbys, Start,
)
from ..observe.metrics import Metrics
from ..adapters.status import StatusMode, status_dict, write_status
from ..decide.state import Mode, Policy, SupervisorState
from ..adapters.publish import publish_plan, shut_down_standbys
from ..observe.sweep import Sweeper
from ..observe.watch import Watch

__all__ = ["StoreLink", "Supervisor", "checkpoint_notice", "status_interval_s"]

log = logging.getLogger(__name__)


class StoreLink:
    """The job's store client, connected at its first use (``connect`` or any store
    method, which it forwards: ``link.get(key)`` is the store's ``get``).

    A fresh start's first actions launch every worker step and only then publish plan 0
    (``decide._start``); with the store hosted by the keeper (its port known at once),
    the supervisor issues those launches before it imports torch for its client, so its
    own start-up overlaps the workers' (srun, ``import torch``) instead of preceding it."""

    def __init__(self, connect: Callable[[], Any]) -> None:
        self._connect, self._store, self._lock = connect, None, threading.Lock()

    def connect(self) -> Any:
        """The connected client (connects it the first time)."""
        with self._lock:
            if self._store is None:
                self._store = self._connect()
            return self._store

    def __getattr__(self, name: str) -> Any:
        return getattr(self.connect(), name)


class Supervisor:
    """The job's supervisor for ``Session`` programs; ``run()`` returns the exit code."""

    HANDLES = frozenset({Launch, Kill, Publish, Isolate, CheckSpare, Emit, Say, Phase, ShutDownStandbys, Reap,
                         DrainEvents, Requeue, Exit})  # not Relaunch: the relaunch executor's

    def __init__(self, *, config: ResilienceConfig, command: Sequence[str], job_dir: str,
                 nodes: Sequence[str], launcher: Launcher, store_host: str,
                 run_id: str, job_id: str = "local", requeue_count: int = 0, out=sys.stdout,
                 store_port: int | None = None, reattach: bool = False) -> None:
        """``run_id``: the run's id (``run_identity.establish``), handed to every worker:
        which checkpoints are this run's. ``store_port``: the job's store is hosted
        elsewhere (the batch step, see ``keeper.py``), else in this process.
        ``reattach``: take over the running workers of a killed supervisor from
        ``JOBDIR/supervisor.json``."""
        need = config.job.nodes + config.job.spares
        if len(nodes) < need:
            raise ConfigError(
                f"the allocation has {len(nodes)} node(s) for workers and spares but "
                f"nodes={config.job.nodes} + spares={config.job.spares} need {need}: "
                "allocate more nodes or lower the counts")
        self.cfg, self.command, self.job_dir = config, list(command), job_dir
        self.launcher, self.store_host, self.job_id = launcher, store_host, job_id
        self.run_id, self.requeue_count, self.out = check_run_id(run_id), requeue_count, out
        self.store_port, self.reattaching = store_port, reattach
        self.nodes = list(nodes[:need])
        self.policy = Policy.from_config(config, mode=Mode.ONLINE, can_requeue=isinstance(launcher, Requeues))
        self.handles: dict[str, StepHandle] = {}
        self._nccl_env = nccl_environ(config.reconnect, os.environ)  # NCCL's watchdog, unless the user set it
        self._signalled, self._t0, self._last_status = threading.Event(), time.time(), 0.0
        self._saved_shape: tuple | None = None  # what the last state save held (_shape)
        self._unsaved = False  # a change not in the state file yet (saved with the next status)

    # -- set-up ----------------------------------------------------------------------
    def _setup(self) -> None:
        makedirs_private(os.path.join(self.job_dir, "logs"))
        self.config_path = os.path.join(self.job_dir, "config.yaml")
        if self.reattaching:
            self.token = read_token(self.job_dir)
        else:
            self.token = secrets.token_hex(16)
            write_token(self.job_dir, self.token)
            write_private(self.config_path, yaml.safe_dump(config_to_dict(self.cfg)))
        self.metrics, self.events = Metrics(), EventLog(os.path.join(self.job_dir, "events.jsonl"), on_event=self._observe)
        self.seen: queue.Queue = queue.Queue()
        self.liveness = LivenessServer(self.store_host, self.token, self.seen).start()
        self.store = StoreLink(self._connect_store)
        self._sweeper = Sweeper(self._sweeper_store)  # removes read event keys off the loop
        if self.store_port is None:  # hosted here: its port is known once it listens
            self.store.connect()
        # a warning only, and `scontrol show config` is a subprocess: not before the first launch
        threading.Thread(target=self._check_timeouts, name="sr-timeouts", daemon=True).start()
        self.isolator = Isolator(self.launcher, self.events.emit, self.cfg.recovery, job_id=self.job_id, say=self._say)
        self.checker = SpareChecker(
            self.launcher.run_check,
            lambda node: health_argv(self.cfg, job_id=self.job_id, run_id=self.run_id, job_dir=self.job_dir,
                                     node=node),
            self.cfg.recovery.health_check_timeout_s)

    def _connect_store(self):
        """The job's store (a client of the keeper's, or hosted here), prefixed with the
        job's token; publishes where the liveness socket listens."""
        import torch.distributed as dist  # ~1 s: after generation 0's launches (StoreLink)

        hosted_here = self.store_port is None
        self._raw_store = dist.TCPStore(self.store_host, self.store_port or 0, None, hosted_here,
                                        timedelta(seconds=30), wait_for_workers=False)
        self.store_port = self._raw_store.port
        store = dist.PrefixStore(self.token + "/", self._raw_store)
        store.set(StoreKey.LIVENESS_PORT.value, str(self.liveness.port))
        return store

    def _sweeper_store(self):
        """A second client of the job's store, for the sweeper's thread (``sweep.py``)."""
        import torch.distributed as dist

        raw = dist.TCPStore(self.store_host, self.store_port, None, False, timedelta(seconds=30),
                            wait_for_workers=False)
        return dist.PrefixStore(self.token + "/", raw)

    def _check_timeouts(self) -> None:
        """Racing timeouts, SlurmdTimeout and KillWait (the site's): a warning line each, never fatal."""
        for line in timing_warnings(self.cfg):
            self._say(f"warning: {line}")
        if not isinstance(self.launcher, ReadsSlurmTimeouts):
            return  # no Slurm (local mode)
        try:
            slurmd, kill_wait = self.launcher.slurm_timeouts()
        except SlurmCommandError as exc:
            log.warning("scontrol show config failed: %s", exc)
            return
        for line in slurm_warnings(self.cfg, slurmd_timeout_s=slurmd, kill_wait_s=kill_wait):
            self._say(f"warning: {line}")

    def run(self) -> int:
        """Run the job to its end. Returns the exit code (0 done, 3 failed, 4 requeued)."""
        self._setup()
        first: list[Observation] = []
        if self.reattaching:
            state, seen = self._reattach()
        else:
            w, n = self.cfg.job.nodes, self.cfg.job.nodes + self.cfg.job.spares
            state = SupervisorState(
                job_id=self.job_id, phase=JobPhase.STARTING, table=RankTable(generation=0, slots=()),
                target_world=w, worker_nodes=tuple(self.nodes[:w]), spare_nodes=tuple(self.nodes[w:n]),
                addresses={x: self.launcher.address(x) for x in self.nodes}, requeue_count=self.requeue_count,
                tasks_per_node=self.cfg.job.tasks_per_node,
                device="cuda" if self.cfg.reconnect.backend == "nccl" else "cpu")
            seen, first = 0, [Start()]
        self.watch = Watch(cfg=self.cfg, store=self.store, seen=self.seen, launcher=self.launcher,
                           handles=self.handles, events=self.events, preempted=self._signalled.is_set,
                           events_seen=seen, pulses=self.liveness.pulses, sweep=self._sweeper.put,
                           heard=self.liveness.heard, peers=self.liveness)
        self._install_preempt_handler()
        self.state = state
        self.watcher = NodeWatcher(self.launcher.node_states, lambda: self.state.watched_nodes(),
                                   self.cfg.detect.node_poll_s, self.seen, node_unhealthy).start()
        try:
            code, self.state = loop.run(self, state, self.policy, first)
            return code
        finally:
            self.watcher.close()
            self.liveness.close()
            self._sweeper.close()
            self.isolator.join()
            if isinstance(self.launcher, CleansContainers):  # the spares' too: a node leaves the job clean
                self.launcher.clean_containers(self.nodes)
            self._write_status(self.state, force=True)
            self.events.close()

    def _reattach(self) -> tuple[SupervisorState, int]:
        """Take over a killed supervisor's workers (reattach.py); nothing is restarted."""
        state, seen, written = reattach.load(self.job_dir)
        plans = []
        while self.store.check([StoreKey.PLAN.of(state.table.generation + 1 + len(plans))]):
            plans.append(Plan.from_json(self.store.get(StoreKey.PLAN.of(state.table.generation + 1 + len(plans)))))
        state = reattach.adopt_plans(state, plans)
        for w in state.workers.values():
            self.handles[w.worker_id] = self.launcher.attach(name=w.step_name, node=w.node, pid=w.pid)
        n = self.store.add(StoreKey.EVENT_COUNTER.value, 0)
        while seen < n and not self.store.check([StoreKey.EVENT.of(seen + 1)]):
            seen += 1  # events the old supervisor had read (and deleted) after its last write
        taken = [w.worker_id for w in state.workers.values() if not w.dead]
        self.events.emit(EventKind.SUPERVISOR_REATTACHED, generation=state.table.generation, workers=taken,
                         previous_state_age_s=round(time.time() - written, 3))
        self._say(f"re-attached to {len(taken)} running worker(s) at generation {state.table.generation}")
        return state, seen

    def _install_preempt_handler(self) -> None:
        signum = self.cfg.job.preempt_signum
        if signum is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signum, lambda *_: self._signalled.set())

    # -- the executor's side of loop.run -----------------------------------------------
    def observe(self, state: SupervisorState) -> list[Observation]:
        self.state = state
        obs = self.watch.observe(state)
        self._write_status(state)
        return [*self.checker.drain(), *obs]

    def changed(self, state: SupervisorState) -> None:
        """Persist a change for a re-attach: at once when the job's shape moved (phase,
        generation, workers, recovery, budgets); a recovery's marks and other small
        changes go with the next status write (``status_interval_s``: 0.5 s up to 2,048
        workers). Saving the whole state at every worker event cost O(N) per event,
        O(N²) per recovery (benchmarks/scale.py)."""
        self.state = state
        if _shape(state) != self._saved_shape:
            self._save(state)
        else:
            self._unsaved = True

    def execute(self, state: SupervisorState, action: Action) -> list[Observation]:
        if isinstance(action, Launch):
            self._launch(state, action)
        elif isinstance(action, Kill):
            if action.worker_id in self.handles:
                self._kill(action.worker_id)
        elif isinstance(action, Publish):
            out = publish_plan(self.store, action.plan, self.job_dir, tell=self.liveness.tell)
            if action.recovery:  # out when the ranks could see it, not after the table files
                return [Published(action.plan.generation, out.t)]
        elif isinstance(action, Isolate):
            self.isolator.start(action.node, action.state, action.reason)
        elif isinstance(action, CheckSpare):
            self.checker.start(action.node)
        elif isinstance(action, Emit):
            self.events.emit(action.kind, **action.fields)
        elif isinstance(action, Say):
            self._say(action.text)
        elif isinstance(action, Phase):
            log.info("job phase %s -> %s: %s", action.old.name, action.new.name, action.reason)
        elif isinstance(action, ShutDownStandbys):
            shut_down_standbys(self.store, tell=self.liveness.tell)
        elif isinstance(action, Reap):
            self._reap(state, action.grace_s, action.end_unready)
        elif isinstance(action, DrainEvents):
            self.watch.poll_events(state)
        elif isinstance(action, Requeue):
            if isinstance(self.launcher, Requeues):
                self.launcher.requeue()
            else:  # no scheduler (local mode): the user reruns the same job directory to resume
                self._say("no scheduler to requeue with: run the job again in the same job directory to resume")
        elif isinstance(action, Exit):
            if action.error:
                print(f"slurm-resilience: error: {action.error}", file=sys.stderr, flush=True)
        return []

    # -- adapters ------------------------------------------------------------------------
    def _launch(self, state: SupervisorState, a: Launch) -> None:
        env = WorkerEnv(
            store_addr=self.store_host, store_port=self.store_port, liveness_port=self.liveness.port,
            token=self.token, job_dir=self.job_dir, worker_id=a.worker_id, node=a.node, role=a.role,
            generation=a.generation, config_path=self.config_path, job_id=self.job_id,
            run_id=self.run_id).to_environ()
        env = {**self._nccl_env, **env, FAST_EXIT_ENV: "1"}  # a stopped rank skips torch's tear-down
        log_path = os.path.join(self.job_dir, "logs", f"{a.worker_id}.log")
        self.handles[a.worker_id] = self.launcher.launch(
            name=state.workers[a.worker_id].step_name, node=a.node, argv=self.command, env=env, log_path=log_path)
        self._unsaved = True  # its pid goes with the next status write: one save per start, not per launch

    def _kill(self, worker_id: str) -> None:
        """End a worker's step in a thread: the step may sit on a node that answers
        nothing, and no recovery may wait on the faulty node (its replacement is
        published right after). A failed kill is logged; Slurm ends the step with
        the node at the latest."""
        handle = self.handles[worker_id]

        def work() -> None:
            try:
                self.launcher.kill(handle)
            except Exception as exc:
                log.warning("killing worker %s failed: %s", worker_id, exc)

        threading.Thread(target=work, name=f"sr-kill-{worker_id}", daemon=True).start()

    def _reap(self, state: SupervisorState, grace_s: float, end_unready: bool = False) -> None:
        deadline = time.time() + grace_s
        for wid, h in self.handles.items():
            w = state.workers[wid]
            if w.dead or w.node in state.excluded:
                continue  # its node may answer nothing: never waited on (Slurm ends its step)
            if end_unready and w.role is Role.STANDBY and not w.connected:
                self.launcher.kill(h)
                continue
            while h.exit_code() is None and time.time() < deadline:
                time.sleep(0.05)
            if h.exit_code() is None:
                self.launcher.kill(h)

    def _save(self, state: SupervisorState) -> None:
        self._saved_shape, self._unsaved = _shape(state), False
        pids = {wid: getattr(h, "pid", None) or (h.process.pid if getattr(h, "process", None) else None)
                for wid, h in self.handles.items()}
        workers = {wid: w if w.pid or not pids.get(wid) else dataclasses.replace(w, pid=pids[wid])
                   for wid, w in state.workers.items()}
        reattach.save(self.job_dir, dataclasses.replace(state, workers=workers), self.watch.events_seen)

    def _write_status(self, state: SupervisorState, force: bool = False) -> None:
        now = time.time()
        if not force and now - self._last_status < status_interval_s(len(state.workers)):
            return
        self._last_status = now
        if self._unsaved:
            self._save(state)
        status = status_dict(state, mode=StatusMode.ONLINE, steps=self.watch.steps,
                             retry_budget=self.cfg.recovery.fault_retry_times,
                             endpoints={"host": self.store_host, "store_port": self.store_port,
                                        "liveness_port": self.liveness.port,
                                        "rejected_connections": self.liveness.rejected})
        for r in status["ranks"]:  # the watchdog's verdict: ok, suspect, slow, waiting, hung, silent
            r["liveness"] = self.watch.liveness(r["worker_id"])
        write_status(self.job_dir, status)
        write_private(os.path.join(self.job_dir, "metrics.prom"), self.metrics.render(status), durable=False)

    def _observe(self, event: dict) -> None:
        """Every logged event: the metrics; a line in the log where a user must see it."""
        self.metrics.observe(event)
        line = checkpoint_notice(event)
        if line is not None:
            self._say(line)

    def _say(self, text: str) -> None:
        print(f"[sr +{time.time() - self._t0:8.3f}s] {text}", file=self.out, flush=True)


def checkpoint_notice(event: dict) -> str | None:
    """Pure: the log line for a rank's checkpoint-ownership event (another run's steps
    ignored, ended runs' directories removed), or None for any other event."""
    who = f"rank {event.get('rank')} on {event.get('node')}"
    if event.get("kind") == WorkerEvent.CHECKPOINT_FOREIGN.logged:
        found = event.get("found") or []
        where = "; ".join(f"{e.get('tier')} {e.get('root')} steps {e.get('steps')}" for e in found)
        return (f"{who}: ignored {sum(int(e.get('count', 0)) for e in found)} checkpoint step(s) of another run "
                f"(not restored): {where}")
    if event.get("kind") == WorkerEvent.CHECKPOINT_CLEANED.logged:
        removed, failed = event.get("removed") or [], event.get("failed") or []
        return (f"{who}: removed {len(removed)} checkpoint directory(ies) of ended runs"
                + (f", {len(failed)} could not be removed" if failed else "") + f": {', '.join(removed)}")
    return None


def status_interval_s(workers: int) -> float:
    """How often the status file (and a pending state save) is written: every 0.5 s up to
    2,048 workers, then in proportion (2 s at 8,192), so its O(N) cost stays a fixed
    share of the loop."""
    return max(0.5, workers / 4096)


def _shape(state: SupervisorState) -> tuple:
    """What a re-attach must not miss (saved at once when it changes): O(1) to compute."""
    rec = state.recovery
    return (state.phase, state.table.generation, state.next_id, len(state.workers), state.excluded,
            None if rec is None else (rec.number, rec.level, rec.generation), state.fault_retries_used,
            state.requeue_count, state.relaunches, state.failure is not None)

