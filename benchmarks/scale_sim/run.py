"""One run of the harness at one size: start, steady window, a killed node, a silent
node, finish. Every process is this run's child, ended by its pid."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

from .common import Channel, raise_fd_limit
from .launcher import KILLED, SILENT, host_of, node_name
from .measure import EventTail, cpu_s, false_alarms, loadavg, rss_mb

SUPERSEDED = "superseded"
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunSpec:
    """One harness run. ``pulse`` None: on where the supervisor's open-file limit holds
    two sockets per worker."""

    ranks: int
    tasks_per_node: int = 8
    spares: int = 2
    hosts: int = 2
    threads: int = 2
    steady_s: float = 10.0
    settle_s: float = 3.0
    step_s: float = 0.5
    pulse: bool | None = None
    detect: dict = dataclasses.field(default_factory=dict)
    reconnect: dict = dataclasses.field(default_factory=dict)
    cases: tuple[str, ...] = (KILLED, SILENT)
    drain: bool = True  # wait until the supervisor has logged generation 0's events before the window
    finish: bool = True  # end the job cleanly (every rank done) rather than by killing the processes
    wait_recovery: bool = True  # after each fault, wait until the supervisor logs the recovery done
    max_wait_s: float | None = None  # cap of each wait (None: 60 s + N/40 s)
    profile: str | None = None  # cProfile the supervisor's loop into this file
    start_rate: float = 1000.0  # simulated ranks started per second (all hosts together)
    skip_save: bool = False  # diagnostic: the supervisor does not persist its state (supervisor.json)

    def __post_init__(self) -> None:
        if self.ranks % self.tasks_per_node or self.ranks < 2 * self.tasks_per_node:
            raise ValueError(f"ranks={self.ranks} must be a multiple of tasks_per_node={self.tasks_per_node}, "
                             "at least two nodes")

    @property
    def nodes(self) -> int:
        return self.ranks // self.tasks_per_node

    def use_pulse(self, fd_limit: int) -> bool:
        workers = self.ranks + self.spares * self.tasks_per_node
        from .ranks import NODE_PULSE  # one pulse connection per node (and driver), or per rank before
        pulses = 2 * workers // self.tasks_per_node if NODE_PULSE else workers
        return self.pulse if self.pulse is not None else workers + pulses + 512 <= fd_limit


class Run:
    """``with Run(spec) as run: result = run.measure()``."""

    def __init__(self, spec: RunSpec, root: str | None = None, keep: bool = False) -> None:
        self.spec, self.keep = spec, keep
        self._threads: list[dict[str, float]] = []  # the supervisor's CPU seconds per thread, at each stats read
        self.root = tempfile.mkdtemp(prefix=f"sr-scale-{spec.ranks}-", dir=root)
        self.job_dir = os.path.join(self.root, "job")
        self.procs: dict[str, subprocess.Popen] = {}
        self.hosts: list[Channel] = []
        self.result: dict[str, Any] = {"ranks": spec.ranks, "nodes": spec.nodes, "errors": []}

    # -- processes ---------------------------------------------------------------------
    def _start(self, name: str, module: str, *args: str) -> int:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), BENCH_DIR) if p)
        err = open(os.path.join(self.root, f"{name}.err"), "wb")
        p = subprocess.Popen([sys.executable, "-m", f"scale_sim.{module}", *args], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=err, env=env, cwd=self.root)
        self.procs[name] = p
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{name} did not start: {self.tail(name)}")
        return int(line)

    def tail(self, name: str) -> str:
        try:
            with open(os.path.join(self.root, f"{name}.err"), "rb") as f:
                return f.read()[-3000:].decode(errors="replace")
        except OSError:
            return ""

    def __enter__(self) -> "Run":
        s = self.spec
        self.pulse = s.use_pulse(raise_fd_limit())
        self.result.update(pulse=self.pulse, hosts=s.hosts, threads=s.threads, step_s=s.step_s)
        store_port = self._start("store", "store_host")
        host_spec = {"store_port": store_port, "threads": s.threads, "pulse": self.pulse, "step_s": s.step_s,
                     "heartbeat_period_s": s.detect.get("heartbeat_period_s", 0.25),
                     "poll_interval_ms": s.reconnect.get("poll_interval_ms", 20.0),
                     "start_rate": s.start_rate / s.hosts}
        ports = [self._start(f"ranks{i}", "rank_host", json.dumps(host_spec)) for i in range(s.hosts)]
        self.hosts = [Channel.connect(p) for p in ports]
        sup_spec = {"job_dir": self.job_dir, "store_port": store_port, "hosts": ports, "nodes": s.nodes,
                    "spares": s.spares, "tasks_per_node": s.tasks_per_node, "detect": s.detect,
                    "reconnect": s.reconnect, "profile": s.profile,
                    "skip_save": s.skip_save}
        self.ctl = Channel.connect(self._start("supervisor", "supervisor_host", json.dumps(sup_spec)))
        self.events = EventTail(os.path.join(self.job_dir, "events.jsonl"))
        return self

    def __exit__(self, *exc) -> None:
        for name, p in self.procs.items():
            if p.stdin:
                p.stdin.close()
        deadline = time.monotonic() + 5
        for name, p in self.procs.items():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()  # our own child, by its pid
                p.wait(timeout=10)
        if not self.keep:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- looks ---------------------------------------------------------------------------
    def host_stats(self) -> list[dict]:
        return [h.ask(("stats",)) for h in self.hosts]

    def _times(self, stats: list[dict], kind: str, gen: int) -> tuple[int, float | None]:
        got = [s["times"][kind][gen] for s in stats if gen in s["times"].get(kind, {})]
        return sum(c[0] for c in got), max((c[2] for c in got), default=None)

    def wait_for(self, what: str, check, timeout_s: float, poll_s: float = 0.05):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = check()
            if got is not None:
                return got
            if self.procs["supervisor"].poll() is not None:
                raise RuntimeError(f"supervisor exited while waiting for {what}: {self.tail('supervisor')}")
            time.sleep(poll_s)
        self.result["errors"].append(f"timed out after {timeout_s:.0f} s waiting for {what}")
        return None

    def _all(self, kind: str, gen: int):
        """The last time of ``kind`` once every rank of ``gen`` did it; ``SUPERSEDED`` when a
        later plan came first (a second fault: not every rank of ``gen`` ever joins it)."""
        def check():
            n, last = self._times(self.host_stats(), kind, gen)
            if n >= self.spec.ranks:
                return last
            self.events.poll()
            return SUPERSEDED if self.events.first("plan", generation=gen + 1) else None
        return check

    def _done(self, gen: int):
        """The recovery that brought generation ``gen`` or a later one is logged done."""
        def check():
            self.events.poll()
            return next((e for e in self.events.events if e["kind"] == "recovery_done"
                         and e.get("generation", -1) >= gen), None)
        return check

    def generation(self) -> int:
        """The newest generation the supervisor published."""
        self.events.poll()
        return max(e["generation"] for e in self.events.events if e["kind"] == "plan")

    def _event(self, kind: str, **match):
        def check():
            self.events.poll()
            return self.events.first(kind, **match)
        return check

    def _drained(self, gen: int):
        """Every rank's first_step of ``gen`` is in the supervisor's log (it has read them)."""
        def check():
            self.events.poll()
            n = sum(1 for e in self.events.events if e["kind"] == "rank_first_step" and e.get("generation") == gen)
            return True if n >= self.spec.ranks else None
        return check

    def _procs_cpu(self) -> dict[str, float]:
        return {n: cpu_s(p.pid) for n, p in self.procs.items()}

    # -- the run -------------------------------------------------------------------------
    def measure(self) -> dict[str, Any]:
        s, r = self.spec, self.result
        big = s.max_wait_s or 60 + s.ranks / 40  # start-up and drains grow with N
        t0 = time.time()
        if self.wait_for("generation 0 joined", self._all("join", 0), big) is None:
            return r
        r["start_to_joined_s"] = time.time() - t0
        if s.drain:  # a supervisor that cannot catch up is measured anyway (the error says so)
            if self.wait_for("generation 0 events logged", self._drained(0), big, 0.5) is not None:
                r["start_to_logged_s"] = time.time() - t0
        time.sleep(s.settle_s)
        self.steady(s.steady_s)
        for i, case in enumerate(s.cases):
            node = node_name((i + 1) * s.nodes // (len(s.cases) + 1))
            if not self.fault(case, node, self.generation(), big):
                break
        if s.finish:
            self.finish()
        return r

    def steady(self, window_s: float) -> None:
        r = self.result
        self.events.poll()
        cpu0, (calls0, stats0), t0 = self._procs_cpu(), self._calls(), time.time()
        time.sleep(window_s)
        cpu1, (calls1, stats), t1 = self._procs_cpu(), self._calls(), time.time()
        self.events.poll()
        wall = t1 - t0
        share = {n: round(100 * (cpu1[n] - cpu0[n]) / wall, 1) for n in cpu1}
        alarms = false_alarms(self.events.events, t0, t1)
        before, after = self._threads[-2:]
        r.update(steady_window_s=round(wall, 1),
                 supervisor_cpu_pct=share["supervisor"], store_cpu_pct=share["store"],
                 supervisor_threads_cpu_pct={n: round(100 * (c - before.get(n, 0.0)) / wall, 1)
                                             for n, c in sorted(after.items())},
                 ranks_cpu_pct=round(sum(v for n, v in share.items() if n.startswith("ranks")), 1),
                 supervisor_rss_mb=round(rss_mb(self.procs["supervisor"].pid), 1),
                 store_rss_mb=round(rss_mb(self.procs["store"].pid), 1),
                 store_ops_per_s=round((calls1["total"] - calls0["total"]) / wall),
                 supervisor_store_ops_per_s=round((calls1["supervisor"] - calls0["supervisor"]) / wall),
                 false_alarms=len(alarms), false_alarm_kinds=sorted({e["kind"] for e in alarms}),
                 sim_lag_max_s=round(max(st["lag_max_s"] for st in stats), 3),
                 sim_poll_lag_max_s=round(max(st["poll_lag_max_s"] for st in stats), 3),
                 sim_late_timers=sum(st["late"] for st in stats) - sum(st["late"] for st in stats0),
                 pulse_drops=sum(st["pulse_drops"] for st in stats), load_during=loadavg())

    def _calls(self) -> tuple[dict[str, int], list[dict]]:
        """Store calls so far (the supervisor's, everyone's) and the rank hosts' stats."""
        sup = self.ctl.ask(("stats",))
        self._threads.append(sup.get("threads", {}))
        stats = self.host_stats()
        calls = sup["store_calls"]
        return {"supervisor": calls, "total": calls + sum(st["store_calls"] for st in stats)}, stats

    def fault(self, case: str, node: str, gen: int, timeout_s: float) -> bool:
        """Kill or silence ``node`` in generation ``gen``; measure until generation gen+1 trains."""
        r, nxt = self.result, gen + 1
        self.ctl.ask(("fate", node, case))
        owner = self.hosts[host_of(node, len(self.hosts))]
        owner.ask(("kill_node" if case == KILLED else "silence_node", node))
        for h in self.hosts:  # the survivors' next collective never completes: they poll for a plan
            h.ask(("block", gen))
        t_fault = self.wait_for(f"{case} node: its ranks stopped",
                                lambda: owner.ask(("stats",))["closed_at"].get(node), 30, 0.01)
        if t_fault is None:
            return False
        plan = self.wait_for(f"{case} node: plan {nxt}", self._event("plan", generation=nxt), timeout_s, 0.01)
        if plan is None:
            return False
        res: dict[str, Any] = {"node": node, "fault_to_plan_s": plan["t"] - t_fault,
                               "plan_excludes_node": node not in plan["nodes"]}
        detected = [e for e in self.events.events if e["kind"] == "fault_detected" and e["t"] >= t_fault]
        if detected:
            res["fault_to_detected_s"] = detected[0]["t"] - t_fault
            res["fault_kinds"] = sorted({e["fault"]["kind"] for e in detected})
        read = self.wait_for(f"{case} node: every rank read plan {nxt}", self._all("read", nxt), timeout_s)
        res["plan_to_all_read_s"] = None if read in (None, SUPERSEDED) else read - plan["t"]
        res["fault_to_all_read_s"] = None if read in (None, SUPERSEDED) else read - t_fault
        told = self._times(self.host_stats(), "told", nxt)  # the node pulses that got the plan itself
        res["nodes_told"], res["fault_to_all_told_s"] = told[0], None if told[1] is None else told[1] - t_fault
        joined = self.wait_for(f"{case} node: every rank joined {nxt}", self._all("join", nxt), timeout_s)
        res["plan_to_all_joined_s"] = None if joined in (None, SUPERSEDED) else joined - plan["t"]
        if SUPERSEDED in (read, joined):
            res["superseded"] = True  # another plan followed before every rank had this one
        r[case] = res
        if not self.spec.wait_recovery:
            return True
        done = self.wait_for(f"{case} node: recovery done", self._done(nxt), timeout_s)
        res["recovery_done"] = done is not None
        if done is not None:  # its t is the last rank's first step; the phase events' t is when it was logged
            res["detect_to_step_s"] = done.get("detect_to_step_s")
            logged = [e["t"] for e in self.events.events
                      if e["kind"] == "phase" and e.get("recovery") == done.get("recovery")]
            res["plan_to_recovery_logged_s"] = max(logged) - plan["t"] if logged else None
            out = [e["start"] + e["duration_ms"] / 1000 for e in self.events.events if e["kind"] == "phase"
                   and e.get("recovery") == done.get("recovery") and e.get("phase") == "ranktable"]
            # when the plan was in the store and sent to the pulses (the "plan" event follows the
            # rank table files): the recovery's ranktable phase ends there
            res["fault_to_plan_out_s"] = out[0] - t_fault if out else None
        r[case] = res
        time.sleep(self.spec.settle_s)
        return done is not None

    def finish(self) -> None:
        for h in self.hosts:
            h.ask(("finish",))
        try:
            self.result["supervisor_exit"] = self.procs["supervisor"].wait(timeout=60 + self.spec.ranks / 200)
        except subprocess.TimeoutExpired:
            self.result["errors"].append("the supervisor did not end after every rank finished")
