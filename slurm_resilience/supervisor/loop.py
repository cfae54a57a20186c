"""The supervisor's only loop: watch → decide → act.

    observations (liveness socket, step exits, heartbeats, node states)
        → classify (pure)        → Fault
        → choose spare / restart (pure) → Replacement
        → regenerate rank table (pure)  → Plan for generation g+1
        → publish plan (stop)  → ranks re-form, restore, roll back, continue
    a recovery not finished by ``online_timeout_s`` falls back to relaunching every
    rank on healthy nodes from node-local snapshots.

The supervisor hosts the store and runs on a node of its own (the batch host):
under ``--no-kill`` a job whose batch host dies is left headless, so that node is
never a worker or a spare.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import queue
import secrets
import signal
import sys
import threading
import time
from datetime import timedelta
from typing import Sequence

import yaml

from ..config import ResilienceConfig, config_to_dict
from ..errors import ConfigError
from ..events import EventLog
from ..files import makedirs_private, write_private
from ..lifecycle import JobPhase, Lifecycle
from ..model import RankTable
from ..protocol import (
    EVENT_COUNTER, Plan, PlanAction, Role, WorkerEnv, done_key, event_key,
    heartbeat_key, LIVENESS_PORT_KEY, PERSIST_REQUEST_KEY, read_token, write_token,
)
from .detect import LivenessServer, NodeWatcher, Observation, read_heartbeats, stale_workers
from .launcher import Launcher, StepHandle
from .act import EXIT_FAILED, EXIT_OK, EXIT_REQUEUED, Actions, _unhealthy  # noqa: F401 (re-exported)
from . import reattach
from .metrics import Metrics
from .report import Recovery, recovery_phases, status_dict
from .straggler import StragglerPolicy, StragglerWatch
from .ranktable import initial_table
from .stop import publish_plan, shut_down_standbys

log = logging.getLogger(__name__)

EVENT_HOLE_S = 1.0  # an event counted but unwritten this long is skipped (its writer died)



@dataclasses.dataclass
class Worker:
    """A worker process the supervisor started (a rank or a warm standby)."""

    worker_id: str
    node: str
    handle: StepHandle
    connected_at: float | None = None
    pid: int | None = None
    dead: bool = False
    step: int = 0


class Supervisor(Actions):
    def __init__(self, *, config: ResilienceConfig, command: Sequence[str], job_dir: str,
                 nodes: Sequence[str], launcher: Launcher, store_host: str,
                 job_id: str = "local", restart_count: int = 0, out=sys.stdout,
                 store_port: int | None = None, reattach: bool = False) -> None:
        """``store_port``: the job's store is hosted elsewhere (the batch step, see
        ``keeper.py``), else in this process. ``reattach``: take over the running
        workers of a killed supervisor from ``JOBDIR/supervisor.json``."""
        self.cfg = config
        self.command = list(command)
        self.job_dir = job_dir
        self.launcher = launcher
        self.store_host = store_host
        self.job_id = job_id
        self.restart_count = restart_count
        self.out = out
        self.store_port, self.reattaching = store_port, reattach
        self._preempted = threading.Event()
        self._stragglers = StragglerWatch(StragglerPolicy(
            threshold=config.detect.straggler_threshold, window=config.detect.straggler_window))
        need = config.job.nodes + config.job.spares
        if len(nodes) < need:
            raise ConfigError(
                f"the allocation has {len(nodes)} node(s) for workers and spares but "
                f"nodes={config.job.nodes} + spares={config.job.spares} need {need}: "
                "allocate more nodes or lower the counts")
        self.target_world = config.job.nodes
        self.returning: set[str] = set()
        self.worker_nodes = list(nodes[: config.job.nodes])
        self.spare_nodes = list(nodes[config.job.nodes: need])
        self.lifecycle = Lifecycle()
        self.workers: dict[str, Worker] = {}
        self.standbys: dict[str, str] = {}  # node -> worker_id of its warm standby
        self.excluded: set[str] = set()
        self.restarts: dict[int, int] = {}
        self.recovery: Recovery | None = None
        self.recoveries = 0
        self._obs: "queue.Queue[Observation]" = queue.Queue()
        self._ids = 0
        self._ev_seen = 0
        self._ev_hole: tuple[int, float] | None = None  # (event number, since) not yet written
        self._ev_late: dict[int, float] = {}  # skipped holes still looked for (number → since)
        self._t0 = time.time()

    # -- set-up --------------------------------------------------------------
    def _setup(self) -> None:
        import torch.distributed as dist  # the store; imported here so the CLI stays light

        makedirs_private(os.path.join(self.job_dir, "logs"))
        self.config_path = os.path.join(self.job_dir, "config.yaml")
        if self.reattaching:
            self.token = read_token(self.job_dir)
        else:
            self.token = secrets.token_hex(16)
            write_token(self.job_dir, self.token)
            write_private(self.config_path, yaml.safe_dump(config_to_dict(self.cfg)))
        self.metrics = Metrics()
        self.events = EventLog(os.path.join(self.job_dir, "events.jsonl"), on_event=self.metrics.observe)
        hosted_here = self.store_port is None
        self._raw_store = dist.TCPStore(self.store_host, self.store_port or 0, None, hosted_here,
                                        timedelta(seconds=30), wait_for_workers=False)
        self.store = dist.PrefixStore(self.token + "/", self._raw_store)
        self.liveness = LivenessServer(self.store_host, self.token, self._obs).start()
        self.store.set(LIVENESS_PORT_KEY, str(self.liveness.port))
        self.addresses = {n: self.launcher.address(n) for n in self.worker_nodes + self.spare_nodes}

    def _worker_env(self, worker_id: str, node: str, role: Role, generation: int) -> WorkerEnv:
        return WorkerEnv(
            store_addr=self.store_host, store_port=self._raw_store.port,
            liveness_port=self.liveness.port, token=self.token, job_dir=self.job_dir,
            worker_id=worker_id, node=node, role=role, generation=generation,
            config_path=self.config_path, job_id=self.job_id)

    def _new_id(self, node: str) -> str:
        self._ids += 1
        return f"{node}.{self._ids}"

    def _launch(self, node: str, role: Role, generation: int, worker_id: str | None = None) -> Worker:
        wid = worker_id or self._new_id(node)
        env = self._worker_env(wid, node, role, generation).to_environ()
        log_path = os.path.join(self.job_dir, "logs", f"{wid}.log")
        handle = self.launcher.launch(name=f"sr-{wid}", node=node, argv=self.command,
                                      env=env, log_path=log_path)
        w = Worker(worker_id=wid, node=node, handle=handle)
        self.workers[wid] = w
        reattach.save(self)
        return w

    # -- public ----------------------------------------------------------------
    def run(self) -> int:
        """Run the job to its end. Returns the exit code (0 done, 3 failed)."""
        self._setup()
        if self.reattaching:
            self._reattach()
        else:
            self._start()
        self._install_preempt_handler()
        self.watcher = NodeWatcher(self.launcher.node_states, self._watched_nodes,
                                   self.cfg.detect.node_poll_s, self._obs, _unhealthy).start()
        try:
            return self._watch()
        finally:
            self.watcher.close()
            self.liveness.close()
            self._write_status()
            self.events.close()

    def _start(self) -> None:
        ids = [self._new_id(n) for n in self.worker_nodes]
        self.table: RankTable = initial_table(self.worker_nodes, ids, self.addresses)
        self._publish(Plan(generation=0, action=PlanAction.RUN, table=self.table,
                           joining=tuple(range(self.table.world_size)), reason="start"))
        for slot in self.table.slots:
            self._launch(slot.node, Role.RANK, 0, slot.worker_id)
        for node in self.spare_nodes:
            self.standbys[node] = self._launch(node, Role.STANDBY, 0).worker_id
        self._say(f"job started: {self.table.world_size} ranks on {','.join(self.worker_nodes)}; "
                  f"spares {','.join(self.spare_nodes) or 'none'}")
        self.events.emit("job_start", ranks=list(self.worker_nodes), spares=self.spare_nodes)
        self.lifecycle.transition(JobPhase.RUNNING, "all ranks launched")

    def _reattach(self) -> None:
        """Take over a killed supervisor's workers (reattach.py); nothing is restarted."""
        state = reattach.load(self.job_dir)
        self.addresses = {n: self.launcher.address(n) for n in state["worker_nodes"] + state["spare_nodes"]}
        taken = reattach.reattach(self, state)
        self.events.emit("supervisor_reattached", generation=self.table.generation, workers=taken,
                         previous_state_age_s=round(time.time() - state["t"], 3))
        self._say(f"re-attached to {len(taken)} running worker(s) at generation {self.table.generation}")

    def _install_preempt_handler(self) -> None:
        spec = self.cfg.job.preempt_signal
        if not spec or threading.current_thread() is not threading.main_thread():
            return
        name = spec.split("@")[0]
        sig = getattr(signal, name if name.startswith("SIG") else "SIG" + name)
        signal.signal(sig, lambda *_: self._preempted.set())

    # -- the loop --------------------------------------------------------------
    def _watch(self) -> int:
        last_hb = last_status = last_return = 0.0
        while True:
            if not self._preempted.is_set() and self.store.check([PERSIST_REQUEST_KEY]):
                self._preempted.set()  # a rank got the preemption signal (sent to the steps)
            if self._preempted.is_set():
                return self._requeue(f"preempted ({self.cfg.job.preempt_signal.split('@')[0]} "
                                     "before the time limit or by the scheduler)", persist=True)
            faults = self._drain_observations(0.02)
            faults.update(self._poll_steps())
            now = time.time()
            if now - last_hb >= self.cfg.detect.heartbeat_period_s:
                last_hb = now
                faults.update(self._check_heartbeats(now))
            faults = {wid: o for wid, o in faults.items() if not self._finished(wid)}
            if faults:
                code = self._recover(faults)
                if code is not None:
                    return code
            self._poll_worker_events()
            if self._all_done():
                return self._finish()
            if self.recovery is not None and time.time() > self.recovery.deadline:
                code = self._fallback()
                if code is not None:
                    return code
            if now - last_status >= 0.5:
                last_status = now
                self._write_status()
            if now - last_return >= self.cfg.detect.node_poll_s:
                last_return = now
                self._check_returned_nodes()

    def _drain_observations(self, timeout: float) -> dict[str, dict]:
        """Liveness and node-state observations → {worker_id: observation flags}."""
        faults: dict[str, dict] = {}
        try:
            obs = self._obs.get(timeout=timeout)
        except queue.Empty:
            return faults
        while True:
            if obs.kind == "connected" and obs.worker_id in self.workers:
                w = self.workers[obs.worker_id]
                w.connected_at, w.pid = obs.time, obs.pid
                if w.node in self.returning and self.standbys.get(w.node) == w.worker_id:
                    self._grow(w.node)
            elif obs.kind == "closed" and self._watched(obs.worker_id):
                faults.setdefault(obs.worker_id, {"t": obs.time})["process_exited"] = True
            elif obs.kind == "node_state" and obs.node not in self.excluded:
                for w in self.workers.values():
                    if w.node == obs.node and self._watched(w.worker_id):
                        faults.setdefault(w.worker_id, {"t": obs.time})["state"] = obs.detail
            try:
                obs = self._obs.get_nowait()
            except queue.Empty:
                return faults

    def _poll_steps(self) -> dict[str, dict]:
        faults = {}
        for w in self.workers.values():
            if self._watched(w.worker_id) and w.handle.exit_code() is not None:
                faults[w.worker_id] = {"t": time.time(), "process_exited": True}
        return faults

    def _check_heartbeats(self, now: float) -> dict[str, dict]:
        live = {wid: w for wid, w in self.workers.items() if self._watched(wid) and w.connected_at}
        if not live:
            return {}
        beats = read_heartbeats(self.store, {wid: heartbeat_key(wid) for wid in live})
        for wid, beat in beats.items():
            if beat is not None:
                live[wid].step = int(beat.get("step", 0))
        self._watch_stragglers(beats)
        times = {wid: (b["t"] if b else None) for wid, b in beats.items()}
        started = {wid: w.connected_at for wid, w in live.items()}
        stale = stale_workers(times, now, self.cfg.detect.heartbeat_timeout_s, started)
        return {wid: {"t": now, "heartbeat_stale": True} for wid in stale}

    def _watched(self, worker_id: str | None) -> bool:
        """A live rank of the current table, or a standby still in the pool."""
        w = self.workers.get(worker_id) if worker_id else None
        if w is None or w.dead:
            return False
        in_table = any(s.worker_id == worker_id for s in self.table.slots)
        return in_table or self.standbys.get(w.node) == worker_id

    def _finished(self, worker_id: str) -> bool:
        """A rank that reported done may exit: that is not a fault."""
        slot = next((s for s in self.table.slots if s.worker_id == worker_id), None)
        if slot is not None and self.store.check([done_key(slot.rank)]):
            self.workers[worker_id].dead = True
            return True
        return False

    def _watched_nodes(self) -> list[str]:
        return [n for n in set(self.table.nodes) | set(self.standbys) if n not in self.excluded]

    # -- plans ---------------------------------------------------------------------
    def _publish(self, plan: Plan) -> None:
        publish_plan(self.store, plan, self.job_dir)
        self._stragglers.reset()  # ranks may be renumbered
        self.table = plan.table
        reattach.save(self)
        self.events.emit("plan", generation=plan.generation, action=plan.action.value,
                         nodes=list(plan.table.nodes), joining=list(plan.joining),
                         reason=plan.reason)

    # -- worker events -------------------------------------------------------------
    def _poll_worker_events(self) -> None:
        n = self.store.add(EVENT_COUNTER, 0)
        while self._ev_seen < n:
            key = event_key(self._ev_seen + 1)
            if not self.store.check([key]):
                # Counted but not yet written: wait a little. A worker killed between
                # counting and writing never writes it; without this every later event
                # (recovery marks included) would wait behind the hole forever.
                now = time.monotonic()
                if self._ev_hole is None or self._ev_hole[0] != self._ev_seen + 1:
                    self._ev_hole = (self._ev_seen + 1, now)
                if now - self._ev_hole[1] < EVENT_HOLE_S:
                    return
                self._ev_late[self._ev_seen + 1] = now  # taken late if it still comes
                self._ev_seen += 1
                continue
            self._ev_seen += 1
            self._take_event(key)
        for k, since in list(self._ev_late.items()):
            if self.store.check([event_key(k)]):
                del self._ev_late[k]
                self._take_event(event_key(k))
            elif time.monotonic() - since > 60:
                del self._ev_late[k]
                self.events.emit("event_lost", n=k)

    def _take_event(self, key: str) -> None:
        ev = json.loads(self.store.get(key))
        self.store.delete_key(key)
        kind = ev.pop("kind")
        self.events.emit(f"rank_{kind}", **ev)
        self._track_recovery(kind, ev)

    def _track_recovery(self, kind: str, ev: dict) -> None:
        rec = self.recovery
        if rec is None or ev.get("generation") != rec.generation or ev.get("rank") is None:
            return
        if kind in ("reconnected", "restored", "first_step", "done"):
            key = "first_step" if kind == "done" else kind
            rec.worker_marks.setdefault(key, {}).setdefault(ev["rank"], ev["t"])
        if len(rec.worker_marks.get("first_step", {})) == self.table.world_size:
            self._recovery_done(rec)

    def _recovery_done(self, rec: Recovery) -> None:
        for phase, start, end in recovery_phases(rec):
            self.events.emit("phase", recovery=rec.number, phase=phase, start=start, end=end,
                             duration_ms=round((end - start) * 1000, 3))
        last = {k: max(v.values()) for k, v in rec.worker_marks.items()}
        m = rec.marks
        total = last["first_step"] - m["detected"]
        self.events.emit("recovery_done", t=last["first_step"], recovery=rec.number, level=rec.level,
                         generation=rec.generation, detected=m["detected"],
                         first_step=last["first_step"], detect_to_step_s=total)
        self._say(f"recovery {rec.number} done: generation {rec.generation} trained a step "
                  f"{total * 1000:.0f} ms after detection")
        self.recovery = None
        self.lifecycle.transition(JobPhase.RUNNING, f"recovery {rec.number} done")

    # -- endings -------------------------------------------------------------------
    def _all_done(self) -> bool:
        if not self.store.check([done_key(s.rank) for s in self.table.slots]):
            return False
        if self.recovery is not None:
            self._poll_worker_events()  # "done" events also close a recovery in flight
        return self.recovery is None

    def _finish(self) -> int:
        self.lifecycle.transition(JobPhase.FINISHING, "every rank finished")
        shut_down_standbys(self.store)
        self._reap()
        self._poll_worker_events()
        self.lifecycle.transition(JobPhase.SUCCEEDED)
        self.events.emit("job_done", recoveries=self.recoveries, generation=self.table.generation)
        self._say(f"job finished after {self.recoveries} recover{'y' if self.recoveries == 1 else 'ies'}")
        return EXIT_OK

    def _reap(self, grace_s: float = 30.0) -> None:
        deadline = time.time() + grace_s
        for w in self.workers.values():
            while w.handle.exit_code() is None and time.time() < deadline:
                time.sleep(0.05)
            if w.handle.exit_code() is None and not w.dead:
                self.launcher.kill(w.handle)

    # -- reporting -----------------------------------------------------------------
    def _say(self, text: str) -> None:
        print(f"[sr +{time.time() - self._t0:8.3f}s] {text}", file=self.out, flush=True)

    def _write_status(self) -> None:
        reattach.save(self)
        status = status_dict(self, self.workers)
        write_private(os.path.join(self.job_dir, "status.json"), json.dumps(status))
        write_private(os.path.join(self.job_dir, "metrics.prom"), self.metrics.render(status))
