"""Job steps inside the allocation: one ``srun --no-kill`` step per worker.

``--no-kill`` keeps a step alive when another node of the job fails; ``--overlap``
lets a restarted step share a node with a dead step that Slurm has not reaped yet
(otherwise ``srun`` loops on "Requested nodes are busy").

In a heterogeneous job (docs/hetjob.md) every step names its component
(``--jobid=LEADER --het-group=1``; srun refuses the component's own job id), the
steps are listed and cancelled under the component's job id, and an isolated node
is first released from the component: Slurm 22.05 requeues the *whole* hetjob when
a node still in any component fails, ``--no-kill`` notwithstanding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import subprocess
import threading
import time
from typing import Mapping, Sequence

from ..container import argv as container
from ..errors import RecoveryError
from . import commands
from .parse import config_seconds, expand_hostlist, validate_node_name
from .reach import port_reachable
from .rights import uses_slurmdbd

__all__ = ["SrunStep", "AttachedSrunStep", "srun_argv", "nodes_after_release", "SrunLauncher", "deferred"]

log = logging.getLogger(__name__)


@dataclasses.dataclass
class SrunStep:
    """A worker step this supervisor started (``SrunLauncher.launch``); ``process``: its srun client."""

    name: str
    node: str
    process: subprocess.Popen

    def exit_code(self) -> int | None:
        return self.process.poll()


@dataclasses.dataclass
class AttachedSrunStep:
    """A worker step started by an earlier (killed) supervisor: its srun client is
    not our child, so it is watched through Slurm's step list (cached, see
    ``SrunLauncher._running_steps``) and ended with ``scancel``."""

    name: str
    node: str
    launcher: "SrunLauncher"
    process: None = None

    def exit_code(self) -> int | None:
        running = self.launcher._running_steps()
        return None if running is None or self.name in running else -1


def srun_argv(*, job_id: str, name: str, nodes: Sequence[str], tasks_per_node: int = 1,
              het_group: int | None = None, mpi: bool = False, options: Sequence[str] = (),
              end_on_bad_exit: bool = False) -> list[str]:
    """Pure: the ``srun`` prefix of a job step on ``nodes`` (the one builder: a worker's
    step on one node, and the all-ranks step of relaunch mode). The command follows.

    ``end_on_bad_exit``: Slurm ends the whole step when one task exits non-zero or by a
    signal (``--kill-on-bad-exit=1``), and ``srun`` then exits non-zero; otherwise
    (``=0``, whatever the site's ``KillOnBadExit``) the other tasks run on.

    ``options``: the site's step options (``job.srun_options`` as argv, see
    ``slurm.options.srun_args``), after the toolkit's own; with ``mpi`` an
    ``--mpi=...`` among them replaces the default ``--mpi=pmix``.

    Raises:
        ValueError: invalid node name, no node, ``tasks_per_node`` < 1 or a negative ``het_group``.
    """
    if not nodes:
        raise ValueError("a step needs at least one node")
    for n in nodes:
        validate_node_name(n)
    if tasks_per_node < 1:
        raise ValueError(f"tasks_per_node={tasks_per_node} must be >= 1")
    n = len(nodes)
    argv = ["srun", "--no-kill", "--overlap", "-N", str(n), "-n", str(n * tasks_per_node),
            f"--ntasks-per-node={tasks_per_node}", "-w", ",".join(nodes), f"--jobid={job_id}"]
    if het_group is not None:
        if het_group < 0:
            raise ValueError(f"het_group={het_group} must be >= 0")
        argv.append(f"--het-group={het_group}")
    argv += [f"--job-name={name}", f"--kill-on-bad-exit={int(end_on_bad_exit)}", *options]
    own_mpi = any(o == "--mpi" or o.startswith("--mpi=") for o in options)
    return [*argv, "--mpi=pmix"] if mpi and not own_mpi else argv


def nodes_after_release(job: Mapping[str, str], node: str) -> list[str] | None:
    """Pure: the node list that releases ``node`` from a running job (``scontrol show
    job`` fields), or None when ``node`` is no longer in it.

    Raises:
        RecoveryError: ``node`` is the job's BatchHost, which Slurm never releases
            (for a hetjob component: its first node).
    """
    nodelist = job.get("NodeList", "")
    nodes = [] if nodelist in ("", "(null)") else expand_hostlist(nodelist)
    if node not in nodes:
        return None
    if node == job.get("BatchHost"):
        raise RecoveryError(f"{node} is the first node (BatchHost) of job {job.get('JobId')}: Slurm cannot "
                            "release it, so its loss ends the heterogeneous job (docs/hetjob.md)")
    return [n for n in nodes if n != node]


class SrunLauncher:
    """Launch workers as job steps of ``job_id``; probe and isolate nodes through Slurm.

    ``het_group``/``het_job_id``: in a heterogeneous job, the worker component every
    step runs on and that component's own job id; None for an ordinary job.
    ``srun_options``: the site's step options as argv (``job.srun_options``).
    ``container``: the image every worker and standby step runs in (None: the node).
    ``step_nodes``: the nodes steps may run on, cleaned before a requeue (default:
    ``nodes``, which may also hold the supervisor's own node, probed only).
    """

    CLEAN_TIMEOUT_S = 30.0

    def __init__(self, job_id: str, nodes: Sequence[str], het_group: int | None = None,
                 het_job_id: str | None = None, srun_options: Sequence[str] = (),
                 container: "container.StepContainer | None" = None,
                 step_nodes: Sequence[str] | None = None) -> None:
        if (het_group is None) != (het_job_id is None):
            raise ValueError("het_group and het_job_id go together (a hetjob's worker component)")
        self.job_id, self.het_group, self.het_job_id = job_id, het_group, het_job_id
        self.srun_options, self.container = tuple(srun_options), container
        self.step_nodes = tuple(nodes if step_nodes is None else step_nodes)
        self._steps_job = het_job_id or job_id  # the job record that holds our steps
        self._release_lock = threading.Lock()
        self._launched: list[SrunStep] = []  # srun clients still running (hetjob release ends them)
        self._steps_cache: tuple[float, set[str] | None] = (0.0, None)
        self._isolated: set[str] = set()  # excluded from a requeue (ExcNodeList)
        self._rights: tuple[bool, str] | None = None
        self._slurm_config: dict[str, str] | None = None  # scontrol show config, read once
        info = commands.show_nodes(list(nodes))
        self._addr = {n: commands.node_address(info[n]) for n in nodes}

    def launch(self, *, name: str, node: str, argv: Sequence[str],
               env: Mapping[str, str], log_path: str) -> SrunStep:
        srun = srun_argv(job_id=self.job_id, name=name, nodes=[node], het_group=self.het_group,
                         options=[*self.srun_options, *container.srun_options(self.container)])
        cname = container.container_name(self.job_id, node, name.removeprefix("sr-"))
        argv = container.wrap(self.container, argv, name=cname, env_names=env)
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "ab") as log:
            proc = subprocess.Popen([*srun, *argv], env={**os.environ, **env},
                                    stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        step = SrunStep(name=name, node=node, process=proc)
        self._launched = [s for s in self._launched if s.exit_code() is None] + [step]
        return step

    def attach(self, *, name: str, node: str, pid: int | None = None) -> AttachedSrunStep:
        return AttachedSrunStep(name=name, node=node, launcher=self)

    def _running_steps(self, ttl_s: float = 1.0) -> set[str] | None:
        """Names of this job's running steps, from one ``squeue`` at most every ``ttl_s``
        (None when squeue fails: unknown, so nothing is declared ended)."""
        t, names = self._steps_cache
        if time.monotonic() - t < ttl_s:
            return names
        try:
            out = commands.run(["squeue", "-h", "-s", "-j", self._steps_job, "-o", "%j"], timeout=5).stdout
            names = {ln.strip() for ln in out.splitlines() if ln.strip()}
        except commands.SlurmCommandError:
            names = None
        self._steps_cache = (time.monotonic(), names)
        return names

    def kill(self, handle) -> None:
        for step_id in self._step_ids(handle.name):
            try:
                commands.cancel_step(self._steps_job, step_id, signal="KILL")
            except commands.SlurmCommandError:
                pass  # the step already ended
        if handle.process is not None and handle.process.poll() is None:
            handle.process.kill()  # the srun client we started, by its Popen

    def _step_ids(self, name: str) -> list[str]:
        out = commands.run(["squeue", "-h", "-s", "-j", self._steps_job, "-o", "%i %j"], timeout=5).stdout
        ids = []
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and parts[1] == name and "." in parts[0]:
                ids.append(parts[0].split(".", 1)[1])
        return ids

    def node_reachable(self, node: str, timeout_s: float) -> bool:
        """Does ``node``'s slurmd port take a connection within ``timeout_s`` (a fresh SYN
        every ``reach.CONNECT_RETRY_S``)?"""
        addr, port = self._addr[node]
        return port_reachable(addr, port or 6818, timeout_s)

    def probe_slurmd(self, node: str, step_names: Sequence[str], deadline_s: float) -> tuple[bool | None, str]:
        """Does ``node``'s slurmd answer a Slurm request within ``deadline_s``?

        (True, how) answered; (False, why) refused or silent past the deadline; (None,
        why) nothing to ask (none of ``step_names`` runs there: the step list comes
        from slurmctld). The request is ``sstat`` of one of our steps on the node
        (``commands.step_stat``): slurmd must relay it to the step's slurmstepd. A
        TCP connect alone is no proof: a stopped slurmd's port still accepts
        (``node_reachable`` is asked first). Blocks up to ``deadline_s``: call it off the supervisor's loop (``probe.py``).
        """
        t0 = time.monotonic()
        try:
            out = commands.run(["squeue", "-h", "-s", "-j", self._steps_job, "-o", "%i %j"],
                               timeout=max(0.05, deadline_s - (time.monotonic() - t0))).stdout
        except commands.SlurmCommandError as exc:
            return None, f"step list unavailable ({exc})"
        ids = {}
        for line in out.splitlines():
            parts = line.split()
            if len(parts) == 2 and "." in parts[0]:
                ids[parts[1]] = parts[0].split(".", 1)[1]
        step = next((ids[n] for n in step_names if n in ids and ids[n].isdigit()), None)
        if step is None:
            return None, "no step of ours runs there to ask about"
        left = deadline_s - (time.monotonic() - t0)
        if left <= 0:
            return None, "the step list took the whole deadline"
        try:
            commands.step_stat(self._steps_job, step, timeout=left)
        except commands.SlurmCommandError as exc:
            if exc.returncode is None and "timed out" in exc.stderr:
                return False, f"slurmd did not answer sstat of step {self._steps_job}.{step} within {deadline_s:g}s"
            return None, f"sstat of step {self._steps_job}.{step} failed ({exc})"
        return True, f"slurmd answered sstat of step {self._steps_job}.{step}"

    def node_states(self, nodes: Sequence[str]) -> dict[str, str]:
        info = commands.show_nodes(list(nodes))
        return {n: info[n].get("State", "UNKNOWN") for n in nodes if n in info}

    def isolate(self, node: str, state: str, reason: str) -> dict[str, object]:
        """Take ``node`` out of this job, and out of service where ``state`` says so.

        ``state`` DOWN or DRAIN (operator rights): in a hetjob the node is first
        released from the worker component, so that Slurm never sees a failed node
        inside the job; then marked. ``state`` "none" (an ordinary user): never
        marked; released from the job (the owner may shrink a running job) in a
        hetjob, and in an ordinary job where accounting runs through slurmdbd —
        without it Slurm refuses every later update of a shrunk job ("the DB index
        is being set"), the requeue's ``ExcNodeList`` included, so the node stays in
        the job, unused, until Slurm itself takes it out. In every case it is kept
        for :meth:`requeue`'s exclude list. Returns ``{"released": bool, "state":
        state, "note": str}``.

        Raises:
            SlurmCommandError; RecoveryError (the job's BatchHost, which Slurm cannot
            release). If the release fails the node is left unmarked: marking a node
            that is still in a component DOWN would requeue the whole hetjob.
        """
        self._isolated.add(validate_node_name(node))
        if self.container is not None and self.node_reachable(node, 1.0):
            self.clean_containers([node])  # before the release: a released node takes no step of ours
        released, note = False, ""
        if self.het_job_id is not None:
            released = self._release(node)
        elif state == "none":
            if self._may_shrink():
                released = self._release(node)
            else:
                note = "kept in the job (no slurmdbd: a shrunk job's ExcNodeList could not be set)"
        if state != "none":
            commands.set_node_state(node, state, reason)
        return {"released": released, "state": state, "note": note}

    def _config(self) -> dict[str, str]:
        if self._slurm_config is None:
            self._slurm_config = commands.slurm_config()
        return self._slurm_config

    def slurm_timeouts(self) -> tuple[float | None, float | None]:
        """(SlurmdTimeout, KillWait) in seconds (None: not known); see ``config.timeouts``.

        Raises:
            SlurmCommandError: ``scontrol show config`` failed.
        """
        cfg = self._config()
        return config_seconds(cfg.get("SlurmdTimeout")), config_seconds(cfg.get("KillWait"))

    def _may_shrink(self) -> bool:
        try:
            return uses_slurmdbd(self._config())
        except commands.SlurmCommandError:
            return False

    def exclude_at_requeue(self, node: str) -> None:
        """Keep ``node`` for the exclude list of a later :meth:`requeue` (at once,
        before the isolation's thread runs)."""
        self._isolated.add(validate_node_name(node))

    def may_set_node_state(self) -> tuple[bool, str]:
        """May this user mark nodes DOWN/DRAIN? Asked once (see :mod:`slurm.rights`).

        Raises:
            SlurmCommandError: ``scontrol show config`` failed.
        """
        if self._rights is None:
            self._rights = commands.operator_rights(self._config())
        return self._rights

    def _release(self, node: str) -> bool:
        with self._release_lock:  # two isolations at once must not resurrect each other's node
            remaining = nodes_after_release(commands.show_job(self._steps_job), node)
            if remaining is not None:
                commands.set_job_nodes(self._steps_job, remaining)
        # A resize, unlike a node failure, does not tell the step's srun client: it
        # would wait for the lost task forever. End the clients of steps on the node.
        for step in list(self._launched):
            if step.node == node and step.exit_code() is None:
                step.process.kill()
        return remaining is not None

    def address(self, node: str) -> str:
        return self._addr[node][0]

    def run_check(self, node: str, argv: Sequence[str], timeout_s: float) -> tuple[int | None, str]:
        """A short step on ``node`` (the spare health check): (exit code, output), or
        (None, why) when it did not end within ``timeout_s`` (the step is cancelled)."""
        name = f"sr-health-{node}"
        srun = srun_argv(job_id=self.job_id, name=name, nodes=[node], het_group=self.het_group)
        try:
            out = subprocess.run([*srun, *argv], capture_output=True, text=True, timeout=timeout_s,
                                 stdin=subprocess.DEVNULL, check=False)
        except subprocess.TimeoutExpired:
            for step_id in self._step_ids(name):
                try:
                    commands.cancel_step(self._steps_job, step_id, signal="KILL")
                except commands.SlurmCommandError:
                    pass  # it ended meanwhile
            return None, f"the health check step did not end within {timeout_s:g}s"
        # the check prints its one line on stdout; srun's own complaints go to stderr
        return out.returncode, out.stdout if out.stdout.strip() else out.stderr

    def clean_containers(self, nodes: Sequence[str], *, stale: bool = False) -> dict[str, object]:
        """Remove this job's containers on those of ``nodes`` that answer (one step on
        them all, ``container.cleanup_argv``); ``stale``: instead, those that ended
        jobs left there (``container.stale_cleanup_argv``, at the job's start). Never
        raises: a failure is logged and returned (``{"nodes", "code", "output"}``)."""
        argv = (container.stale_cleanup_argv if stale else container.cleanup_argv)(self.container)
        live = [n for n in nodes if self.node_reachable(n, 1.0)] if argv else []
        if not live:
            return {"nodes": [], "code": 0, "output": ""}
        srun = srun_argv(job_id=self.job_id, name=f"sr-clean-{self.job_id}", nodes=live, het_group=self.het_group)
        try:
            out = subprocess.run([*srun, *argv], capture_output=True, text=True, timeout=self.CLEAN_TIMEOUT_S,
                                 stdin=subprocess.DEVNULL, check=False)
            code, text = out.returncode, (out.stdout + out.stderr).strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            code, text = None, str(exc)
        (log.info if code == 0 else log.warning)("job %s: container cleanup on %s: %s", self.job_id,
                                                 ",".join(live), text)
        return {"nodes": live, "code": code, "output": text}

    def requeue(self) -> None:
        """Job-level: put the whole job back in the queue (it resumes from checkpoints),
        excluding every node this job isolated (``ExcNodeList``, see
        :func:`commands.requeue_excluding`; a failed exclusion is logged, not raised).
        Slurm's SIGTERM for the requeue is held back until the exclusion is set.

        Raises:
            SlurmCommandError: the requeue failed.
        """
        self.clean_containers([n for n in self.step_nodes if n not in self._isolated])
        with deferred(signal.SIGTERM), self._release_lock:  # after a release in flight
            problem = commands.requeue_excluding(self.job_id, sorted(self._isolated))
        if problem:
            log.warning("job %s: %s", self.job_id, problem)


@contextlib.contextmanager
def deferred(signum: int):
    """Hold ``signum`` while the block runs (main thread only), then re-deliver it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    previous = signal.signal(signum, lambda s, _f: got.append(s))
    try:
        yield
    finally:
        signal.signal(signum, previous)
        if got:
            os.kill(os.getpid(), signum)
