"""The fault cases of benchmarks/mttr.py: one :class:`Case` per fault, run by :func:`run_case`.

A case is data: the YAML it appends to the lab config, the spares it needs, how it
injects its fault into a running job (``inject(status) -> fault wall time``), how it
cleans up after the job (``cleanup``), and what ends its window (``measure``):

    recovery   the first ``recovery_done``'s first step (the last rank's)
    resume     every rank past the step it was at when the fault ended (no recovery expected)
    reattach   the supervisor's re-attachment (training never pauses)
    restart    the first step of the world formed after the fault (requeue)

Another fault plugs in as one more :func:`register` call (see the freeze-node case below).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.events import read_events  # noqa: E402
from slurm_resilience.protocol import EventKind, WorkerEvent  # noqa: E402

Status = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    inject: Callable[[Status], float]
    config: str | Callable[[], str] = ""  # YAML appended to the lab's config (a callable: built when run)
    spares: int = 1
    cleanup: Callable[[Status], None] | None = None
    measure: str = "recovery"
    expect: str | None = None  # the ladder level this case must reach (checked, reported)
    # the fault also waits until every worker node's warm standby (recovery.local_standbys,
    # started at the job's first step) is connected; every contender runs the same --steps
    # and is hit at --kill-at, whose default leaves the standbys time to connect first (a run
    # whose standbys were late reports the later ``fault_step``)
    standbys: bool = False
    args: Callable[[Path], tuple[str, ...]] | None = None  # more training-script arguments, given the job dir
    # the fault, for the ratios: a case is compared only with the baselines of its own fault
    # (benchmarks/mttr_baseline.py FAULTS); one without such a baseline gets no ratio
    fault: str = "node-kill"


CASES: dict[str, Case] = {}
QUEUE_WAIT_S = 900.0  # submission -> the fault step, outside the window (a shared lab queues jobs)


def register(case: Case) -> Case:
    CASES[case.name] = case
    return case


def _kill_pid(pid: int, sig: int = signal.SIGKILL) -> float:
    t = time.time()
    os.kill(pid, sig)  # a process of the job this benchmark started
    return t


def _reap(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _last(st: Status) -> dict:
    return st["ranks"][-1]


def _block_main(st: Status) -> float:
    """The last rank's main thread blocks on a lock forever (examples/train_mlp.py
    --block-file); its process, heartbeat thread and pulse live on."""
    flag = Path(st["job_dir"]) / "block"
    flag.with_suffix(".tmp").write_text(_last(st)["worker_id"])
    t = time.time()  # before the rename: the window is never shorter than the truth
    os.replace(flag.with_suffix(".tmp"), flag)
    return t


register(Case("kill-node", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]), expect="node-replacement",
              standbys=True))
register(Case("rank0-node", inject=lambda st: lab.kill_node(st["ranks"][0]["node"]), expect="node-replacement",
              standbys=True))
register(Case("kill-rank", inject=lambda st: _kill_pid(_last(st)["pid"]), expect="online", standbys=True,
              fault="rank-kill"))
# the same without recovery.local_standbys: the restart in place starts a new process (cold import)
register(Case("kill-rank-cold", inject=lambda st: _kill_pid(_last(st)["pid"]), expect="online",
              config="recovery:\n  local_standbys: false\n", standbys=True, fault="rank-kill"))
register(Case("hang-rank", inject=lambda st: _kill_pid(_last(st)["pid"], signal.SIGSTOP),
              cleanup=lambda st: _reap(_last(st)["pid"]), standbys=True, fault="rank-hang"))
# a main thread stuck while the heartbeat thread beats on: the blocking timeout (docs/timeouts.md)
register(Case("hang-main", inject=_block_main, args=lambda job_dir: ("--block-file", str(job_dir / "block")),
              expect="online", standbys=True, fault="rank-hang"))
# the ladder's other levels, each forced by its configuration
register(Case("scale-in", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]), spares=0, expect="scale-in"))
register(Case("process-restart", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]),
              config="recovery:\n  online_timeout_s: 0.005\n", expect="process-restart", standbys=True))
# the same with a standby for every slot of a node (recovery.local_standbys_per_node: all = G;
# with --tasks-per-node 1 it is process-restart)
register(Case("process-restart-all", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]),
              config="recovery:\n  online_timeout_s: 0.005\n  local_standbys_per_node: all\n",
              expect="process-restart", standbys=True))
# the same without recovery.local_standbys: every rank of the relaunch imports torch cold
register(Case("process-restart-cold", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]),
              config="recovery:\n  online_timeout_s: 0.005\n  local_standbys: false\n", expect="process-restart",
              standbys=True))
# (the job's steady state: its node standbys connected, so the stop is not theirs to wait for)
register(Case("requeue", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]), spares=0,
              config="recovery:\n  scale_in: false\n  max_requeues: 1\n", measure="restart", standbys=True))
register(Case("requeue-resubmit", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]), spares=0,
              config="recovery:\n  scale_in: false\n  max_requeues: 1\n  requeue_by: resubmit\n", measure="restart",
              standbys=True))
register(Case("supervisor", inject=lambda st: _kill_pid(st["supervisor_pid"]), measure="reattach",
              fault="supervisor-kill"))


def _podman_config() -> str:
    """Every rank and warm standby in a podman container (docs/containers.md); the test
    image (containers/test-image.sh) is built once per machine."""
    section = lab.podman_section(lab.podman_test_image())
    return "container:\n" + "".join(f"  {k}: {json.dumps(v)}\n" for k, v in section.items())


register(Case("kill-node-podman", inject=lambda st: lab.kill_node(st["ranks"][1]["node"]),
              config=_podman_config, expect="node-replacement"))

# The silent node loss: slurmd and the node's job cgroups stopped, nothing closes; the
# node is thawed and revived after the job (outside the window).
register(Case("freeze-node", inject=lambda st: lab.freeze_node(st["ranks"][1]["node"]),
              cleanup=lambda st: lab.thaw_and_revive(st["ranks"][1]["node"]), expect="node-replacement",
              fault="node-freeze"))


# Network faults (nodes with their own addresses, scripts/lab_net.py): the node's
# processes keep running, cut off; healed and revived after the job (outside the window).
def _victim(st: Status) -> str:
    return st["ranks"][1]["node"]


def _heal_and_revive(st: Status) -> None:
    lab.net_fault("heal")
    lab.cluster("revive-node", _victim(st), timeout=60)


def _peers(st: Status) -> float:
    peers = sorted({r["node"] for r in st["ranks"]} - {_victim(st)})
    return lab.net_fault("partition-peers", _victim(st), "--peers", ",".join(peers))


register(Case("partition-node", inject=lambda st: lab.net_fault("partition-node", _victim(st)),
              cleanup=_heal_and_revive, expect="node-replacement", fault="node-partition"))
# cut from the other ranks' nodes only; slurmctld and the supervisor (a node of its own)
# still reach it
register(Case("partition-peers", inject=_peers, cleanup=_heal_and_revive, expect="node-replacement",
              fault="peer-partition"))


def _from_supervisor(st: Status) -> float:
    ep = st["endpoints"]
    ports = ",".join(str(p) for p in (ep.get("store_port"), ep.get("liveness_port")) if p)
    return lab.net_fault("partition-supervisor", _victim(st), "--supervisor-addr", ep["host"], "--ports", ports)


# cut from the supervisor's store and liveness ports only; its peers and slurmctld still reach it
register(Case("partition-supervisor", inject=_from_supervisor, cleanup=_heal_and_revive, expect="node-replacement",
              fault="supervisor-partition"))
# down for FLAP_S, under the detection deadline: no recovery; the window ends when every
# rank has passed the step it was at when the link came back
FLAP_S = 0.5
register(Case("flap-node", inject=lambda st: lab.net_fault("flap-node", _victim(st), f"{FLAP_S}", timeout=60),
              cleanup=lambda st: lab.net_fault("heal"), measure="resume", fault="node-flap"))


def _resumed(run, timeout_s: float = 120.0) -> float | None:
    """When status.json first shows every rank past the step the slowest was at now
    (status.json is written twice a second: that is the resolution)."""
    st = run.status
    if not st or not st["ranks"]:
        return None
    mark = max(r["step"] for r in st["ranks"])
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and run.process.poll() is None:
        st = run.status
        if st and min(r["step"] for r in st["ranks"]) > mark:
            return st["t"]
        time.sleep(0.05)
    return None


def _standbys_connected(run, status: Status, timeout_s: float = 120.0) -> Status:
    """The status once every rank's node and every spare has its own connected warm standby
    (outside the window)."""
    nodes = {r["node"] for r in status["ranks"]} | {s["node"] for s in status.get("spares", [])}  # spares: K extra
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        st = run.status or status
        if nodes <= {s["node"] for s in st.get("local_standbys", []) if s["connected"]}:
            return st
        time.sleep(0.05)
    raise TimeoutError(f"no connected standby on every node of {sorted(nodes)}: {run.status}")


def first_step_after(events: list[dict], t: float) -> float | None:
    """When the last rank of the first world formed after ``t`` completed its first step."""
    after = [e for e in events if e["kind"] == WorkerEvent.FIRST_STEP.logged and e["t"] > t]
    if not after:
        return None
    first = min(after, key=lambda e: e["t"])
    return max(e["t"] for e in after if e.get("generation") == first.get("generation")
               and abs(e["t"] - first["t"]) < 60)


def compute_args(args) -> tuple[str, ...]:
    """The example's ``--compute-time`` (emulated forward/backward inside the step) when set."""
    t = getattr(args, "compute_time", 0.0)
    return ("--compute-time", str(t)) if t else ()


def run_case(case: Case, root: Path, args) -> dict:
    """One run: reset the lab (outside the window), submit, wait for --kill-at, inject,
    wait for the job, read its event log."""
    cfg = root / f"{case.name}.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + (case.config() if callable(case.config) else case.config))
    lab.cluster("reset")
    run = lab.submit(root / case.name, spares=case.spares, tasks_per_node=args.tasks_per_node, steps=args.steps,
                     step_time=args.step_time, config=cfg,
                     extra_args=(*(case.args(root / case.name) if case.args else ()),
                                 *compute_args(args)))
    status = run.wait_for_step(args.kill_at, timeout=QUEUE_WAIT_S)  # a shared lab may queue the job a while
    if case.standbys and "local_standbys: false" not in cfg.read_text():
        status = _standbys_connected(run, status)
    status = {**status, "job_dir": str(run.job_dir)}
    fault_step = min((r.get("step") for r in status["ranks"] if r.get("step") is not None), default=None)
    t_fault = case.inject(status)  # ---- the timed window starts here
    t_resumed = _resumed(run) if case.measure == "resume" else None
    try:
        code = run.wait()
    finally:
        if case.cleanup:
            case.cleanup(status)
    events = read_events(str(run.job_dir / "events.jsonl"))
    done = [e for e in events if e["kind"] == EventKind.RECOVERY_DONE]
    out: dict[str, Any] = {"exit_code": code, "tasks_per_node": args.tasks_per_node, "recoveries": len(done),
                           "fault": case.fault, "fault_step": fault_step}
    t_end = None
    if case.measure == "reattach":
        back = [e for e in events if e["kind"] == EventKind.SUPERVISOR_REATTACHED]
        t_end, out["level"] = (back[0]["t"] if back else None), "supervisor re-attach"
    elif case.measure == "restart":
        t_end = first_step_after(events, t_fault)
        out["level"] = "requeue" if any(e["kind"] == EventKind.REQUEUE for e in events) else "?"
        out["parts_s"] = requeue_parts(events, t_fault, run.job_dir)
    elif case.measure == "resume":
        t_end, out["level"] = t_resumed, ("none" if not done else done[0]["level"])
    elif done:
        t_end, out["level"] = done[0]["first_step"], done[0]["level"]
        out["detect_s"] = round(done[0]["detected"] - t_fault, 3)
        out["phases_ms"] = {e["phase"]: e["duration_ms"] for e in events
                            if e["kind"] == EventKind.PHASE and e["recovery"] == done[0]["recovery"]}
        adopted = [e for e in events if e["kind"] == EventKind.LOCAL_STANDBY_ADOPTED
                   and e["generation"] == done[0]["generation"]]  # by the recovery measured
        out["local_standby_adopted"], out["local_standbys_adopted"] = bool(adopted), len(adopted)
    out["mttr_s"] = round(t_end - t_fault, 3) if t_end else None
    if case.expect and out.get("level") != case.expect:
        out["unexpected_level"] = f"expected {case.expect}"
    return out


def requeue_parts(events: list[dict], t_fault: float, job_dir: Path) -> dict[str, float | None]:
    """The requeue path in parts (s), from the event log and the restarted batch step's
    ``store.json`` (when its CLI was up, ``started``, and its store, ``t``):

        detect       fault → fault_detected
        stop         → the ``requeue`` event (stop plan published, survivors stopped and reaped)
        slurm        → the restarted batch step's CLI up (scontrol requeue or sbatch, Slurm
                     ending the job, its requeue hold or the successor's scheduling, batch shell)
        store        batch step up → its store up (in parallel with the supervisor)
        supervisor   batch step up → every worker step launched (the ``job_start`` event)
        plan         batch step up → plan 0 out (the supervisor's store client: import
                     torch, after the launches, in parallel with the workers' start)
        workers      launched → every rank reconnected (srun steps, import torch, rendezvous)
        restore      → every rank restored
        first_step   → every rank's first step
    """
    def t_of(kind: str, after: float, last: bool = False, gen_first: bool = False) -> float | None:
        ts = [e["t"] for e in events if e["kind"] == kind and e["t"] > after]
        return (max(ts) if last else min(ts)) if ts else None

    detected = t_of(EventKind.FAULT_DETECTED, t_fault)
    requeued = t_of(EventKind.REQUEUE, t_fault)
    try:
        store = json.loads((Path(job_dir) / "store.json").read_text())
    except (OSError, ValueError):
        store = {}
    started, store_up = store.get("started"), store.get("t")
    launched = t_of(EventKind.JOB_START, started or t_fault)
    plan = t_of(EventKind.PLAN, started or t_fault)
    joined = t_of(WorkerEvent.RECONNECTED.logged, launched or t_fault, last=True)
    restored = t_of(WorkerEvent.RESTORED.logged, launched or t_fault, last=True)
    stepped = first_step_after(events, t_fault)
    marks = [("detect", t_fault, detected), ("stop", detected, requeued), ("slurm", requeued, started),
             ("store", started, store_up), ("supervisor", started, launched), ("plan", started, plan),
             ("workers", launched, joined), ("restore", joined, restored), ("first_step", restored, stepped)]
    return {name: round(b - a, 3) if a is not None and b is not None else None for name, a, b in marks}
