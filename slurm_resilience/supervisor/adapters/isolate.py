"""Isolate: keep a bad node out, off the recovery's critical path.

The node is already excluded in the supervisor's state when this runs (``decide``
did that: no step starts there again in this job). Telling Slurm may take seconds,
so it runs in a thread and reports ``isolated`` / ``isolate_failed`` when it ends.
Both executors use this one routine.

What Slurm is told depends on ``recovery.isolate_state`` and on this user's rights
(docs/unprivileged.md):

    isolate_state   operator rights     node state       released from the job
    DOWN | DRAIN    (assumed)           that state       hetjob only (first)
    auto            yes                 DOWN (stragglers DRAIN)  hetjob only
    auto            no                  untouched        with slurmdbd, or hetjob
    none            any                 untouched        with slurmdbd, or hetjob

In every case the node is kept for the job's ``ExcNodeList`` at a requeue, a log
line says what was done, and ``recovery.isolate_hook`` (a site command, argv list,
time-out; never a shell) runs with the node, the reason and the job id appended;
its failure is an ``isolate_hook`` event with the error, never fatal.
"""

from __future__ import annotations

import logging
import subprocess
import threading
import time
from typing import Callable

from ...config import RecoveryConfig
from ...protocol import EventKind


__all__ = ["MARKS", "node_state_for", "Isolator"]


log = logging.getLogger(__name__)
MARKS = ("DOWN", "DRAIN")


def node_state_for(configured: str, requested: str, operator: bool) -> str:
    """Pure: the Slurm state actually given to a node (``"none"``: untouched).

    ``configured``: ``recovery.isolate_state``; ``requested``: the action's state (the
    configured one, or DRAIN for a straggler); ``operator``: may this user mark nodes.
    """
    if configured == "none":
        return "none"
    if configured == "auto":
        if not operator:
            return "none"
        return requested if requested in MARKS else "DOWN"
    return requested if requested in MARKS else configured


class Isolator:
    """Runs isolations in background threads; ``join`` waits for them (job end).

    ``launcher``: has ``isolate(node, state, reason)``; optionally
    ``may_set_node_state() -> (bool, why)`` (asked only for ``auto``; absent: yes)
    and ``exclude_at_requeue(node)``. ``say``: the log line (default: logging).
    """

    def __init__(self, launcher, emit: Callable[..., object], recovery: RecoveryConfig | None = None,
                 *, job_id: str = "", say: Callable[[str], None] | None = None) -> None:
        self._launcher, self._emit = launcher, emit
        self._cfg = recovery or RecoveryConfig()
        self._job_id = job_id
        self._say = say or log.warning
        self._threads: list[threading.Thread] = []

    def start(self, node: str, state: str, reason: str) -> None:
        """Take ``node`` out of the job (and of service per ``state``) in a thread of its own; remembered at once for a requeue's exclude list."""
        remember = getattr(self._launcher, "exclude_at_requeue", None)
        if remember is not None:  # now, not in the thread: a requeue may follow at once
            remember(node)
        t = threading.Thread(target=self._work, args=(node, state, reason), name=f"sr-isolate-{node}",
                             daemon=True)
        t.start()
        self._threads.append(t)

    def _work(self, node: str, requested: str, reason: str) -> None:
        t0 = time.time()
        try:
            operator, why = self._rights()
            state = node_state_for(self._cfg.isolate_state, requested, operator)
            done = self._launcher.isolate(node, state, reason) or {}
            note = str(done.get("note") or "")
            self._emit(EventKind.ISOLATED, node=node, state=state, reason=reason, rights=why,
                       released=bool(done.get("released")), note=note, start=t0, end=time.time())
            self._say(f"isolated node {node} ({reason}): Slurm state {state}"
                      f"{', released from the job' if done.get('released') else ''}{'; ' + note if note else ''}; "
                      f"excluded from this job and from its requeue ({why})")
        except Exception as exc:  # reported, never fatal: the node is excluded regardless
            self._emit(EventKind.ISOLATE_FAILED, node=node, error=str(exc), start=t0, end=time.time())
            self._say(f"isolating node {node} failed ({exc}); it stays excluded from this job and its requeue")
        if self._cfg.isolate_hook:
            self._hook(node, reason)

    def _rights(self) -> tuple[bool, str]:
        if self._cfg.isolate_state != "auto":
            return True, f"recovery.isolate_state={self._cfg.isolate_state}"
        ask = getattr(self._launcher, "may_set_node_state", None)
        if ask is None:
            return True, "no scheduler"
        try:
            return ask()
        except Exception as exc:  # unknown rights: leave node states alone
            return False, f"operator rights unknown ({exc})"

    def _hook(self, node: str, reason: str) -> None:
        argv = [*self._cfg.isolate_hook, node, reason, self._job_id]
        t0 = time.time()
        try:
            proc = subprocess.run(argv, capture_output=True, text=True, stdin=subprocess.DEVNULL,
                                  timeout=self._cfg.isolate_hook_timeout_s)
            error = None if proc.returncode == 0 else \
                f"exit code {proc.returncode}: {(proc.stderr or proc.stdout).strip()[-500:]}"
        except subprocess.TimeoutExpired:
            error = f"timed out after {self._cfg.isolate_hook_timeout_s:g}s"
        except OSError as exc:
            error = f"cannot run {argv[0]}: {exc.strerror or exc}"
        self._emit(EventKind.ISOLATE_HOOK, node=node, argv=argv, ok=error is None, error=error,
                   start=t0, end=time.time())
        if error is not None:
            self._say(f"isolate hook for node {node} failed: {error}")

    def join(self, timeout_s: float = 20.0) -> None:
        """Wait up to ``timeout_s`` in all for the isolations started (at the job's end)."""
        deadline = time.monotonic() + timeout_s
        for t in self._threads:
            t.join(timeout=max(0.0, deadline - time.monotonic()))
