"""The in-place path of ``slurm-resilience run --mpi``: run the job under the bundled
``mpirun --with-ft ulfm`` on the batch host and watch it.

    launch mpirun (workers, then spare nodes; SR_ULFM_SPARES = spare ranks)
      -> while it runs: the ranks' repairs (their event files) become ``ulfm_repaired``
         events of the job's log (the job repairs itself); a node whose processes all
         went quiet (their beat files, ``mpi/beat.py``) for ``detect.silence_s`` has its
         slurmd asked; silent too → ``ulfm_node_silent``, mpirun is ended, the node lost
      -> mpirun ends: probe the nodes, ``fallback.after_exit`` (pure) decides
         DONE | RELAUNCH (a node lost: PRRTE ended the job; a spare node takes its
         place and the program resumes from its own snapshot) | FAIL

The ranks get ``SR_ULFM_SPARES``, ``SR_ULFM_EVENTS`` (this launch's event
directory, ``JOBDIR/ulfm-NNN``), ``SR_ULFM_BEAT_S`` (``detect.heartbeat_period_s``),
``SR_PROGRESS_FILE`` (``JOBDIR/progress-NNN.log``) and ``SR_RESTART``. ``launcher`` is a
``slurm.steps.SrunLauncher`` (``address``, ``node_reachable``, ``probe_slurmd``);
``after_exit``, ``quiet_nodes`` and ``choose_path`` hold the decisions.
"""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..config import ResilienceConfig
from ..events import EventLog
from ..protocol import EventKind
from .beat import BEAT_ENV, quiet_nodes, read_beats
from .fallback import ExitAction, after_exit
from .launch import UlfmLaunch, mpirun_argv

__all__ = ["loopback_only", "build_launch", "UlfmSupervisor"]


@dataclass(frozen=True)
class DaemonStep:
    """``SrunLauncher.kill``'s handle for PRRTE's daemon steps (srun names them ``prted``)."""

    name: str = "prted"
    process: None = None


EXPORTED = ("SR_ULFM_SPARES", "SR_ULFM_EVENTS", BEAT_ENV, "SR_PROGRESS_FILE", "SR_RESTART")


def loopback_only(addresses: Sequence[str]) -> bool:
    """Pure: every node answers on 127.0.0.0/8 (the local lab): ranks talk over ``lo``."""
    return bool(addresses) and all(a.startswith("127.") for a in addresses)


def build_launch(*, prefix: str, workers: Sequence[str], spares: Sequence[str], per_node: int,
                 addresses: Sequence[str]) -> UlfmLaunch:
    """Pure: the launch of one attempt (``-x`` for the variables the ranks need).

    PRRTE starts its daemons as one srun step; ``plm_slurm_args --overlap`` lets a
    relaunch's step start while the aborted one (its node dead) still holds the
    nodes' memory (PRRTE reads ``plm_slurm_args`` from ``--mca``, not from the
    environment, measured)."""
    return UlfmLaunch(venv=prefix, workers=tuple(workers), spares=tuple(spares), per_node=per_node,
                      tcp_if="lo" if loopback_only(addresses) else "", export=EXPORTED,
                      mca=(("plm_slurm_args", "--overlap"),))


class UlfmSupervisor:
    """Run, watch and (after a node loss) relaunch one ULFM job; ``run()`` returns the exit code."""

    def __init__(self, *, config: ResilienceConfig, command: Sequence[str], job_dir: str, prefix: str,
                 workers: Sequence[str], spares: Sequence[str], launcher, events: EventLog,
                 poll_s: float = 0.2, settle_s: float = 3.0, out=None,
                 clock: Callable[[], float] = time.time) -> None:
        self.cfg, self.command, self.job_dir, self.prefix = config, list(command), job_dir, prefix
        self.workers, self.spares = tuple(workers), tuple(spares)
        self.per_node = config.job.tasks_per_node
        self.launcher, self.events, self.poll_s, self.settle_s = launcher, events, poll_s, settle_s
        self.out, self.clock, self._t0 = out or sys.stdout, clock, clock()
        self._seen: dict[str, int] = {}  # event file -> bytes read
        self._repairs = 0
        self._node_of: dict[int, str] = {}  # world rank -> node, from the ranks' start events
        self._silent: dict[str, str] = {}  # node -> why it counts as lost (its slurmd was silent)
        self._asked: dict[str, float] = {}  # node -> when its slurmd last answered a quiet-node probe

    def say(self, text: str) -> None:
        print(f"[sr +{self.clock() - self._t0:8.3f}s] {text}", file=self.out, flush=True)

    def run(self) -> int:
        attempt, retries = 0, 0
        while True:
            proc = self._launch(attempt)
            while proc.poll() is None:
                self._forward(attempt)
                if self._watch(attempt):
                    _end(proc)  # a silent node: PRRTE would wait on it for good
                    break
                time.sleep(self.poll_s)
            self._forward(attempt)
            code, finished = proc.returncode, self._finished
            self.events.emit(EventKind.ULFM_EXIT, attempt=attempt, exit_code=code, finished=finished)
            lost = self._lost(code == 0 and finished)
            plan = after_exit(code, finished=finished, lost=lost, workers=self.workers, spares=self.spares, retries=retries,
                              retry_budget=self.cfg.recovery.fault_retry_times)
            if plan.action is ExitAction.DONE:
                self.events.emit(EventKind.JOB_DONE, path="in-place", attempts=attempt + 1)
                self.say("job done")
                return 0
            if plan.action is ExitAction.FAIL:
                self.events.emit(EventKind.JOB_FAILED, path="in-place", reason=plan.reason, exit_code=plan.code)
                print(f"slurm-resilience: error: {plan.reason}", file=sys.stderr, flush=True)
                return plan.code
            # a daemon step whose node died keeps its CPUs until Slurm marks the node down
            # (docs/mpi-ulfm.md): cancelled, or the next launch waits on "nodes are busy"
            self.launcher.kill(DaemonStep())
            attempt, retries = attempt + 1, plan.retries
            self.workers, self.spares = plan.workers, plan.spares
            self.events.emit(EventKind.RELAUNCH, path="in-place", attempt=attempt, reason=plan.reason,
                             lost=list(plan.lost), workers=list(plan.workers), spares=list(plan.spares))
            self.say(f"relaunch {attempt}: {plan.reason}")

    # -- adapters ------------------------------------------------------------------------
    def _launch(self, attempt: int) -> subprocess.Popen:
        nodes = [*self.workers, *self.spares]
        launch = build_launch(prefix=self.prefix, workers=self.workers, spares=self.spares,
                              per_node=self.per_node, addresses=[self.launcher.address(n) for n in nodes])
        argv = mpirun_argv(launch, self.command)
        ev_dir = os.path.join(self.job_dir, f"ulfm-{attempt:03d}")
        env = {**os.environ, "SR_ULFM_SPARES": str(launch.spare_ranks), "SR_ULFM_EVENTS": ev_dir,
               "SR_PROGRESS_FILE": os.path.join(self.job_dir, f"progress-{attempt:03d}.log"),
               "SR_RESTART": str(attempt)}
        if os.geteuid() == 0:  # Open MPI refuses root without both
            env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
        self.events.emit(EventKind.ULFM_LAUNCH, attempt=attempt, workers=list(self.workers),
                         spares=list(self.spares), spare_ranks=launch.spare_ranks, argv=argv)
        self._repairs, self._finished = 0, False
        self._node_of, self._silent, self._asked = {}, {}, {}
        env[BEAT_ENV] = f"{self.cfg.detect.heartbeat_period_s:g}"
        self.say(f"launch {attempt}: {' '.join(argv[:len(argv) - len(self.command)])} PROGRAM...")
        fd = os.open(os.path.join(self.job_dir, f"step-{attempt:03d}.log"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            return subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)

    def _lost(self, succeeded: bool) -> frozenset[str]:
        """Nodes whose slurmd does not answer (after a failed mpirun, checked twice
        ``settle_s`` apart: a node being killed may still answer the first time)."""
        if succeeded:
            return frozenset()
        nodes = [*self.workers, *self.spares]
        if self._silent:  # a stopped slurmd's port still takes connections: the probe's verdict holds
            return frozenset(n for n in nodes if n in self._silent)
        timeout = self.cfg.detect.probe_timeout_s
        lost = {n for n in nodes if not self.launcher.node_reachable(n, timeout)}
        if not lost:
            time.sleep(self.settle_s)
            lost = {n for n in nodes if not self.launcher.node_reachable(n, timeout)}
        return frozenset(lost)

    def _watch(self, attempt: int) -> bool:
        """Ask the slurmd of each node gone quiet (``beat.quiet_nodes``); True when one did
        not answer (it is then in ``_silent``). A node that answered is asked again only
        after another ``silence_s`` of quiet (a rank that died alone: the ranks repair it)."""
        det = self.cfg.detect
        silence = det.silence_s or det.heartbeat_timeout_s
        now = self.clock()
        beats = read_beats(os.path.join(self.job_dir, f"ulfm-{attempt:03d}"))
        for node in quiet_nodes(beats, self._node_of, now, silence):
            if now - self._asked.get(node, float("-inf")) <= silence:
                continue
            answered, why = self.launcher.probe_slurmd(node, [DaemonStep.name], det.slurmd_probe_deadline_s)
            if answered is False:
                quiet_s = now - max(t for w, t in beats.items() if self._node_of.get(w) == node)
                self._silent[node] = why
                self.events.emit(EventKind.ULFM_NODE_SILENT, attempt=attempt, node=node, quiet_s=round(quiet_s, 3),
                                 evidence=why)
                self.say(f"node {node} silent for {quiet_s:.2f} s and {why}: ending mpirun")
                return True
            self._asked[node] = self.clock()
        return False

    def _forward(self, attempt: int) -> None:
        """The ranks' ``repaired`` records, once per repair, into the job's event log;
        rank 0's ``done`` marks the run finished."""
        for path in sorted(glob.glob(os.path.join(self.job_dir, f"ulfm-{attempt:03d}", "events-w*.jsonl"))):
            for rec in self._new_records(path):
                if rec.get("kind") == "start" and rec.get("node"):
                    self._node_of[int(rec["wid"])] = str(rec["node"])
                if rec.get("kind") == "done" and rec.get("rank") == 0:
                    self._finished = True
                if rec.get("kind") != "repaired":
                    continue
                n = self._seen.setdefault(f"{path}#repairs", 0) + 1
                self._seen[f"{path}#repairs"] = n
                if n > self._repairs:  # the first process to report this repair
                    self._repairs = n
                    fields = {k: rec[k] for k in ("lost", "promoted", "step", "size", "ms", "attempts") if k in rec}
                    self.events.emit(EventKind.ULFM_REPAIRED, attempt=attempt, **fields)
                    self.say(f"repaired in place: lost rank(s) {rec.get('lost')}, promoted {rec.get('promoted')}, "
                             f"{rec.get('ms')} ms")

    def _new_records(self, path: str) -> list[dict[str, Any]]:
        start = self._seen.get(path, 0)
        with open(path, "rb") as f:
            f.seek(start)
            data = f.read()
        whole = data[:data.rfind(b"\n") + 1]
        self._seen[path] = start + len(whole)
        out = []
        for line in whole.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # a line torn by a killed writer
        return out


def _end(proc: subprocess.Popen) -> None:
    """End ``mpirun`` and what it started on this host (its own session: start_new_session)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
