"""`slurm-resilience inject` records what it injected; `timeline --png` measures from it."""

import json
import os
import subprocess
import sys

from slurm_resilience import cli
from slurm_resilience.inject import INJECTED, inject, read_injections


def test_an_injected_fault_is_recorded_in_the_job_dir(tmp_path):
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / "status.json").write_text(json.dumps({"ranks": [{"rank": 0, "node": "n1", "pid": victim.pid}]}))
        done = inject("kill-rank", str(tmp_path), rank=0)
        assert victim.wait(timeout=10) == -9
    finally:
        if victim.poll() is None:
            victim.kill()
    assert os.stat(tmp_path / INJECTED).st_mode & 0o777 == 0o600
    assert read_injections(str(tmp_path)) == [done] and done["fault"] == "kill-rank" and done["pid"] == victim.pid
    with open(tmp_path / INJECTED, "a") as f:  # a torn last line and a non-object are skipped
        f.write('[1, 2]\n{"fault": "kill-node", "at": 1')
    assert read_injections(str(tmp_path)) == [done]


def _job(tmp_path):
    events = [
        {"t": 100.0, "kind": "plan", "generation": 0, "nodes": ["n1", "n2"]},
        {"t": 100.0, "kind": "job_start", "spares": ["n3"]},
        {"t": 101.0, "kind": "rank_first_step", "rank": 0, "step": 1},
        {"t": 104.0, "kind": "fault_detected", "observed_at": 104.0, "fault": {"kind": "node_lost", "rank": 1,
                                                                              "node": "n2"}},
        {"t": 104.01, "kind": "plan", "generation": 1, "nodes": ["n1", "n3"]},
        {"t": 104.1, "kind": "recovery_done", "recovery": 1, "level": "node-replacement", "detected": 104.0,
         "first_step": 104.1},
    ]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (tmp_path / INJECTED).write_text(json.dumps({"fault": "freeze-node", "node": "n2", "at": 102.0}) + "\n")
    return tmp_path


def test_timeline_png_measures_from_the_recorded_injection(tmp_path, monkeypatch, capsys):
    drawn = {}
    monkeypatch.setattr("slurm_resilience.timeline_plot.plot_timeline",
                        lambda events, path, fault_times=None: drawn.update(path=path, given=fault_times) or path)
    (tmp_path / "job").mkdir()
    job = _job(tmp_path / "job")
    assert cli.main(["timeline", str(job), "--png", str(tmp_path / "t.png")]) == 0
    assert drawn == {"path": str(tmp_path / "t.png"), "given": {1: 102.0}}
    assert "plot: " in capsys.readouterr().out


def test_timeline_png_into_a_missing_folder_is_a_one_line_error(tmp_path, capsys):
    job = _job(tmp_path)
    code = cli.main(["timeline", str(job), "--png", str(tmp_path / "no" / "such" / "t.png")])
    out, err = capsys.readouterr()
    assert code != 0 and err.startswith("slurm-resilience: error: --png ") and err.count("\n") == 1 and out == ""
    assert "is not a writable directory" in err and not (tmp_path / "no").exists()


def test_timeline_png_of_an_empty_event_log_is_a_one_line_error(tmp_path, capsys):
    (tmp_path / "events.jsonl").write_text("")
    code = cli.main(["timeline", str(tmp_path), "--png", str(tmp_path / "t.png")])
    out, err = capsys.readouterr()
    assert code != 0 and err.count("\n") == 1 and "holds no events to draw" in err and out == ""
    assert not (tmp_path / "t.png").exists()
