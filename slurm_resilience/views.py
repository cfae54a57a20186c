"""What `slurm-resilience status | timeline | inject` show: pure renderers + thin I/O."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from .errors import ResilienceError
from .lifecycle import JobPhase
from .protocol import WorkerEvent


__all__ = ["load_status", "checkpoint_latest", "requeue_count", "render_status", "watch_status"]


def load_status(job_dir: str) -> dict[str, Any]:
    """The job's status.json as a dict."""
    path = os.path.join(job_dir, "status.json")
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ResilienceError(f"no status at {path}: is {job_dir} a job directory?") from None


def checkpoint_latest(job_dir: str) -> dict[str, int]:
    """Newest committed step per tier as the ranks reported it (L1 is node-local)."""
    out: dict[str, int] = {}
    path = os.path.join(job_dir, "events.jsonl")
    if not os.path.exists(path):
        return out
    from .events import read_events

    for e in read_events(path):
        if e["kind"] == WorkerEvent.CHECKPOINT_DURABLE.logged and e.get("rank") == 0:
            out[e["tier"]] = max(out.get(e["tier"], -1), int(e["step"]))
    return out


def requeue_count(st: dict[str, Any]) -> int:
    """How often Slurm requeued the job (``SLURM_RESTART_COUNT``).

    Status files of jobs started before the rename carry it as ``restart_count``.
    """
    return int(st.get("requeue_count", st.get("restart_count", 0)))


def render_status(st: dict[str, Any], *, rate: float | None, tiers: dict[str, int]) -> str:
    """Pure: the status screen."""
    budget = st.get("retry_budget")
    used = st.get("fault_retries_used", 0)
    lines = [
        f"job {st.get('job_id')}  phase {st['phase']}  generation {st['generation']}  "
        f"recoveries {st['recoveries']}  requeues {requeue_count(st)}",
        f"throughput {rate:.2f} steps/s" if rate is not None else "throughput -",
        "checkpoints: " + (", ".join(f"{t} step {s}" for t, s in sorted(tiers.items())) or "none yet"),
        "fault retries left (restarts in place, per job): " + ("-" if budget is None else str(budget - used)),
        f"{'rank':>6}  {'node':<10} {'pid':>8} {'step':>7}  liveness",
    ]
    for r in st["ranks"]:  # liveness: the watchdog's verdict (docs/timeouts.md); '-' in older files
        lines.append(f"{r['rank']:>6}  {r['node']:<10} {str(r['pid']):>8} {r['step']:>7}  {r.get('liveness', '-')}")
    spare_nodes = list(dict.fromkeys(s["node"] for s in st["spares"]))  # G standbys per spare node
    lines.append(f"spares left: {len(spare_nodes)}" + ("  (" + ", ".join(spare_nodes) + ")" if spare_nodes else ""))
    if st.get("excluded"):
        lines.append("isolated nodes: " + ", ".join(st["excluded"]))
    failure = st.get("failure")
    if failure:  # the job failed: why, and the program's own error where it was one
        lines.append(f"failed: {failure.get('reason', '')}")
        lines += [f"  | {line}" for line in failure.get("traceback", ())]
    return "\n".join(lines)


def watch_status(job_dir: str, *, interval: float, once: bool, out) -> int:
    """Print the job's status once, or every ``interval`` s until it succeeds or fails; returns 0."""
    prev: tuple[float, int] | None = None
    while True:
        st = load_status(job_dir)
        step = min((r["step"] for r in st["ranks"]), default=0)
        rate = None
        if prev is not None and st["t"] > prev[0]:
            rate = (step - prev[1]) / (st["t"] - prev[0])
        prev = (st["t"], step)
        text = render_status(st, rate=rate, tiers=checkpoint_latest(job_dir))
        if once:
            print(text, file=out)
            return 0
        print("\033[2J\033[H" + text, file=out, flush=True)
        if st["phase"] in (JobPhase.SUCCEEDED.name, JobPhase.FAILED.name):  # status.json holds the name
            return 0
        time.sleep(interval)
