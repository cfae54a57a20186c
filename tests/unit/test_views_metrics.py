import json

from slurm_resilience.supervisor.observe.metrics import Metrics
from slurm_resilience.timeline_plot import plot_timeline
from slurm_resilience.views import render_status

# Plain strings, as events.jsonl holds them: the enums must compare equal to these.
EVENTS = [
    {"t": 100.0, "kind": "job_start"},
    {"t": 101.0, "kind": "rank_checkpoint_saved", "rank": 0, "step": 10, "stall_ms": 2.0, "tiers": ["L1"]},
    {"t": 101.5, "kind": "rank_checkpoint_durable", "rank": 0, "step": 10, "tier": "L1", "seconds": 0.5, "bytes": 1000},
    {"t": 102.0, "kind": "fault_detected", "observed_at": 102.0, "fault": {"rank": 1}},
    {"t": 102.0, "kind": "recovery_start", "recovery": 1, "level": "node-replacement", "generation": 1},
    {"t": 102.1, "kind": "rank_restored", "rank": 0, "generation": 1, "step": 12},
    {"t": 102.2, "kind": "phase", "recovery": 1, "phase": "reconnect", "start": 102.01, "end": 102.06, "duration_ms": 50.0},
    {"t": 102.3, "kind": "recovery_done", "recovery": 1, "detected": 102.0, "first_step": 102.15,
     "level": "node-replacement", "generation": 1, "detect_to_step_s": 0.15},
]
STATUS = {"job_id": "7", "phase": "RUNNING", "generation": 1, "recoveries": 1, "requeue_count": 2,
          "ranks": [{"rank": 0, "node": "n2", "pid": 11, "step": 13, "liveness": "ok"},
                    {"rank": 1, "node": "n6", "pid": 12, "step": 13, "liveness": "suspect"}],
          "spares": [], "excluded": ["n3"], "fault_retries_used": 1, "retry_budget": 3, "t": 103.0}


def test_metrics_render_prometheus_text():
    m = Metrics(clock=lambda: 110.0)
    m.started = 100.0
    for e in EVENTS:
        m.observe(e)
    text = m.render(STATUS)
    values = dict(line.rsplit(" ", 1) for line in text.splitlines() if not line.startswith("#"))
    assert values["sr_recoveries_total"] == "1"
    assert abs(float(values["sr_mttr_seconds"]) - 0.15) < 1e-9
    assert values['sr_recovery_phase_seconds{phase="reconnect"}'] == "0.05"
    assert values['sr_checkpoints_total{outcome="durable"}'] == "1"
    assert abs(float(values["sr_effective_training_time_ratio"]) - (1 - (0.15 + 0.002) / 10)) < 1e-9
    assert values["sr_world_size"] == "2" and values["sr_step"] == "13"
    assert "# TYPE sr_recoveries_total counter" in text


def test_status_view_shows_budget_spares_and_tiers():
    text = render_status(STATUS, rate=4.0, tiers={"L1": 10, "L2": 10})
    assert "generation 1" in text and "4.00 steps/s" in text and "L1 step 10" in text
    assert "spares left: 0" in text and "isolated nodes: n3" in text
    assert "fault retries left (restarts in place, per job): 2" in text  # 3 - 1 used
    row1 = [line for line in text.splitlines() if line.strip().startswith("1  n6")][0]
    assert row1.split()[1] == "n6" and row1.split()[-1] == "suspect"  # the watchdog's verdict
    assert "requeues 2" in text


def test_status_view_reads_requeues_of_older_status_files():
    old = {k: v for k, v in STATUS.items() if k != "requeue_count"}
    assert "requeues 0" in render_status(old, rate=None, tiers={})
    no_liveness = {**old, "ranks": [{k: v for k, v in r.items() if k != "liveness"} for r in old["ranks"]]}
    assert render_status(no_liveness, rate=None, tiers={}).splitlines()[-3].split()[-1] == "-"
    assert "requeues 3" in render_status({**old, "restart_count": 3}, rate=None, tiers={})


def test_timeline_png_is_written(tmp_path):
    before = json.dumps(EVENTS, sort_keys=True)
    out = plot_timeline(EVENTS, str(tmp_path / "t.png"))
    data = open(out, "rb").read()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    assert json.dumps(EVENTS, sort_keys=True) == before, "plotting must not change the events it reads"


def test_lab_summary_rows_follow_the_recovery_phases(tmp_path):
    from slurm_resilience import lab

    names = lab.PHASES[2:]
    events = [{"t": 100.0, "kind": "isolated", "node": "n1", "start": 100.2, "end": 100.9}]
    events += [{"t": 101.0, "kind": "phase", "recovery": 1, "phase": p, "start": 100.0 + i / 10,
                "end": 100.1 + i / 10} for i, p in enumerate(names)]
    events.append({"t": 101.0, "kind": "recovery_done", "recovery": 1, "detected": 100.0,
                   "first_step": 100.6, "level": "online"})
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    summary = lab.summarize(tmp_path, fault_at=99.9)
    assert list(summary["phases"]) == ["detect", "isolate (off the critical path)", *names]
    assert names[0] == "classify" and names[-1] == "first_step"
    assert summary["mttr_s"] == 0.7 and summary["level"] == "online"
    assert "MTTR" in lab.format_summary(summary, 99.9)
