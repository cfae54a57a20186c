"""End to end on the real local Slurm: network faults between nodes with their own
addresses (``local-cluster partition-node``, ``partition-peers``, ``heal``, ``flap-node``).

One job takes a partition and the heal after it: the node of rank 1 is cut from
everyone (its processes keep running; no FIN, no RST), the supervisor calls it lost
and recovers on the spare; then the partition heals while the job still runs, and
the old ranks, still alive and still in the old generation, must find they are
fenced: they end, and nothing they send after the fence is counted (no step,
checkpoint or done event), nothing lands in the node's checkpoint directory. The
job ends bit-identical to the fault-free run.

A flap shorter than the detection deadline costs a stall and nothing else: no
recovery, no spare spent. The same job then has that node cut from its peers only
(``partition-peers``): the node pulses' peer probes blame it and it is replaced
(``supervisor/observe/partition.py``), bit-identical.
"""

import os
import time

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events

from .conftest import FAULT_STEP_TIME, STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(600)]  # a busy lab queues the jobs

FAULT_AT = 8
# What a fenced rank may still report: that it was fenced (the record of the fence
# itself, with its old generation). Nothing else after the fence.
FENCE_RECORDS = {"rank_fenced"}


def _events(job_dir):
    return read_events(str(job_dir / "events.jsonl"))


def _wait(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.1)
    pytest.fail(f"timed out after {timeout} s waiting for {what}")


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def _files_after(root, t):
    out = []
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            try:
                if os.stat(path).st_mtime > t:
                    out.append(path)
            except FileNotFoundError:
                pass
    return out


def test_partitioned_node_is_replaced_and_fenced_when_it_heals(cluster, jobs_root, reference):
    run = lab.submit(jobs_root / "net-partition", steps=STEPS, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(FAULT_AT, timeout=300)  # a busy lab queues the job first
    victim = status["ranks"][1]["node"]
    spare = status["spares"][0]["node"]
    old = {r["worker_id"]: r["pid"] for r in status["ranks"] if r["node"] == victim}
    generation = status["generation"]
    try:
        cut_at = lab.net_fault("partition-node", victim)
        # recovered on the spare while the victim's ranks are still running, cut off
        plan = _wait(lambda: next((e for e in _events(run.job_dir) if e["kind"] == "recovery_done"), None),
                     120, "the recovery from the partition")
        fenced_gen = plan.get("generation", generation + 1)
        fence_at = next(e["t"] for e in _events(run.job_dir)
                        if e["kind"] == "plan" and victim not in e["nodes"])
        assert all(_alive(pid) for pid in old.values()), "the partition must leave the old ranks running"
        healed_at = lab.net_fault("heal")
        # the old ranks find they are fenced and end themselves (or Slurm ends them)
        _wait(lambda: not any(_alive(pid) for pid in old.values()), 120, "the fenced ranks to end")
        ended_at = time.time()
        assert run.wait() == 0, run.output()
    finally:
        lab.net_fault("heal")
        lab.cluster("revive-node", victim, timeout=60)
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []  # every rank's digest

    events = _events(run.job_dir)
    faults = [e for e in events if e["kind"] == "fault_detected"]
    lost = [f for f in faults if f["fault"]["node"] == victim]
    assert lost and all(f["fault"]["kind"] == "node_lost" for f in lost), faults
    assert lost[0]["observed_at"] >= cut_at
    done = [e for e in events if e["kind"] == "recovery_done"]
    assert [d["level"] for d in done] == ["node-replacement"], done
    plans = [e for e in events if e["kind"] == "plan"]
    assert plans[-1]["nodes"][1] == spare and victim not in plans[-1]["nodes"]

    # no split brain: after the fence, the old ranks' only records are their fencing
    # (worker-written records are the ``rank_*`` events; the supervisor's own records about the
    # victim, e.g. ``isolated`` once its thread has run, are not from the node)
    late = [e for e in events if e.get("worker_id") in old and e["t"] > fence_at and e["kind"].startswith("rank_")]
    assert all(e["kind"] in FENCE_RECORDS for e in late), late
    assert all(e.get("generation") is None or e["generation"] < fenced_gen for e in late), late
    # nothing of the job in the new generation came from the victim's node
    assert not [e for e in events if e.get("node") == victim and e["t"] > fence_at and e["kind"].startswith("rank_")
                and e["kind"] not in FENCE_RECORDS], "events from the fenced node"
    # the victim's node-local checkpoint directory got nothing after the fence
    # (examples/local-cluster.yaml: /tmp/slurm_resilience-{user}/{job_id}/{run_id}/{node}/ckpt)
    job_local = os.path.join("/tmp", f"slurm_resilience-{os.environ.get('USER', 'root')}", str(status["job_id"]))
    local = [p for p in _files_after(job_local, fence_at) if f"/{victim}/" in p]
    assert local == [], local
    summary = lab.summarize(run.job_dir, cut_at)
    print(f"partition: fault → first step {summary['mttr_s']:.3f} s; healed {healed_at - cut_at:.1f} s after "
          f"the cut; fenced ranks ended {ended_at - healed_at:.1f} s after the heal; late records "
          f"{sorted({e['kind'] for e in late})}")


FLAP_S = 0.5  # the longest cut the 0.9 s silence deadline always lets through (config/detect.py): the
# node's pulse replaces its stuck link once one connects (worker/pulse_link.py) and the slurmd probe
# sends a fresh SYN every 50 ms (slurm/reach.py), so neither waits out TCP's retransmission back-off
AFTER_FLAP = 4  # steps every rank does after the flap before the next fault (no recovery meanwhile)
DEGRADED_STEPS = 3  # steps every rank does on a lossy, a narrow, then a long link (no recovery meanwhile)
LOSS, RATE, DELAY_MS = "0.1", "1mbit", "20"  # benchmarks/lossy.py: training goes on, slower, bit-identical
PEERS_STEP_TIME = 0.3  # emulated compute (the bits do not depend on it): the job outlasts the cut's set-up


def test_a_short_flap_costs_no_recovery_and_a_node_cut_from_its_peers_is_replaced(cluster, jobs_root, reference):
    """One job, five faults on one node. A flap under the detection deadline: a stall, no
    recovery, no spare spent. A lossy link (10 %), a narrow one (1 Mbit/s), then a long one
    (every packet held 20 ms), each for a few steps: slower, no recovery. Then the same node is cut from the other ranks' nodes only (slurmctld,
    the supervisor and the spare still reach it): its heartbeats and pulse lines go on,
    every rank waits in a collective that never returns; the pulses' peer probes blame
    it (NODE_PARTITIONED), it is replaced by the spare, and the job ends bit-identical."""
    run = lab.submit(jobs_root / "net-flap-peers", steps=STEPS, step_time=PEERS_STEP_TIME)
    status = run.wait_for_step(FAULT_AT, timeout=300)  # a busy lab queues the job first
    victim = status["ranks"][1]["node"]
    spare = status["spares"][0]["node"]
    peers = sorted({r["node"] for r in status["ranks"]} - {victim})
    try:
        flap_at = lab.net_fault("flap-node", victim, f"{FLAP_S}")
        at = min(r["step"] for r in run.wait_for_step(FAULT_AT + AFTER_FLAP, timeout=120)["ranks"])
        # a degraded link: training goes on (a straggler report is allowed), no recovery
        for fault, arg in (("lossy-node", LOSS), ("slow-node", RATE), ("delay-node", DELAY_MS)):
            lab.net_fault(fault, victim, arg)
            at = min(r["step"] for r in run.wait_for_step(at + DEGRADED_STEPS, timeout=120)["ranks"])
            lab.net_fault("heal")
        assert [e for e in _events(run.job_dir) if e["kind"] in ("fault_detected", "recovery_done")] == []
        assert len([e for e in _events(run.job_dir) if e["kind"] == "plan"]) == 1
        cut_at = lab.net_fault("partition-peers", victim, "--peers", ",".join(peers))
        assert run.wait() == 0, run.output()
    finally:
        lab.net_fault("heal")
        lab.cluster("revive-node", victim, timeout=60)
    assert lab.compare_runs(reference, run.job_dir / "final.pt") == []
    events = _events(run.job_dir)
    faults = [e for e in events if e["kind"] == "fault_detected"]
    assert faults and all(f["fault"]["kind"] == "node_partitioned" and f["fault"]["node"] == victim
                          for f in faults), faults
    assert faults[0]["observed_at"] >= cut_at and faults[0]["fault"]["detail"].startswith("cut from its peers")
    done = [e for e in events if e["kind"] == "recovery_done"]
    assert [d["level"] for d in done] == ["node-replacement"], done
    plans = [e for e in events if e["kind"] == "plan"]
    assert plans[-1]["nodes"][1] == spare and victim not in plans[-1]["nodes"]
    summary = lab.summarize(run.job_dir, cut_at)
    print(f"flap of {FLAP_S} s on {victim} at {flap_at:.3f}: no recovery; then cut from {peers}: detected "
          f"{faults[0]['observed_at'] - cut_at:.2f} s after the cut, fault → first step {summary['mttr_s']:.3f} s")
