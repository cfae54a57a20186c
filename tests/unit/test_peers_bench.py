"""benchmarks/peers.py's own logic: step logs → recovery time and steps lost, the lines a
peer's script changed, the summary, and the case table (every system x fault has a runner
or a reason). No Slurm, no peer installed."""

import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH / "peers"))
import steplog  # noqa: E402
import systems  # noqa: E402

_spec = importlib.util.spec_from_file_location("peers_bench", BENCH / "peers.py")
peers = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(peers)

LOG = """0 10 100.0 100.2
0 11 100.2 100.4
0 12 100.4 100.6
0 13 100.6 100.8
1 11 105.0 105.2
1 12 105.2 105.4
1 13 105.4 105.6
1 14 105.6
"""


def test_parse_skips_torn_and_malformed_lines():
    rows = steplog.parse(LOG + "x 15 1 2\n")
    assert [r.step for r in rows] == [10, 11, 12, 13, 11, 12, 13]
    assert rows[-1] == steplog.Step(1, 13, 105.4, 105.6)


def test_recovery_counts_from_the_fault_to_the_first_step_started_after_it():
    # step 13 was in flight at the fault (100.7) and still completed: not the recovery
    r = steplog.recovery(steplog.parse(LOG), 100.7)
    assert r["mttr_s"] == pytest.approx(105.2 - 100.7, abs=1e-3)
    assert r["step_at_fault"] == 12 and r["first_step_after"] == 11
    assert r["steps_lost"] == 2  # steps 11 and 12 done again (the snapshot was at 10)
    assert r["last_step"] == 13


def test_recovery_without_a_step_after_the_fault_and_without_loss():
    rows = steplog.parse(LOG)
    assert steplog.recovery(rows, 106.0)["mttr_s"] is None
    online = steplog.parse("0 5 1.0 1.2\n0 6 1.2 1.4\n0 7 3.0 3.2\n")  # carried on: nothing redone
    r = steplog.recovery(online, 1.5)
    assert r["steps_lost"] == 0 and r["first_step_after"] == 7 and r["mttr_s"] == pytest.approx(1.7)


def test_stats_median_min_max_and_empty():
    assert steplog.stats([3.0, None, 1.0, 2.0]) == {"median_s": 2.0, "min_s": 1.0, "max_s": 3.0, "n": 3}
    assert steplog.stats([None])["n"] == 0


def test_lines_changed_ignores_docstrings_comments_and_blank_lines():
    plain = '"""Doc."""\nimport os\n\nx = 1  # one\nprint(x)\n'
    variant = '"""Another doc\nover two lines."""\nimport os\nimport torchft\n# a comment\nx = 1\nprint(x, os)\n'
    assert steplog.lines_changed(plain, plain) == {"added": 0, "removed": 0}
    assert steplog.lines_changed(plain, variant) == {"added": 2, "removed": 1}


def test_the_torchft_script_is_counted_against_the_plain_one():
    got = steplog.lines_changed(systems.TRAIN.read_text(), systems.TRAIN_TORCHFT.read_text())
    assert got["added"] > 0 and got["removed"] > 0


def test_every_system_and_fault_has_a_runner_or_a_reason():
    for system in systems.SYSTEMS:
        for fault in systems.FAULTS:
            c = peers.case(system, fault)
            assert callable(c) or (isinstance(c, str) and len(c) > 20), (system, fault)
    assert set(systems.LAUNCHERS) == set(systems.SYSTEMS)
    assert all(k[0] in systems.SYSTEMS and k[1] in systems.FAULTS for k in systems.CANNOT)


def test_summary_ratios_digests_and_reasons():
    runs = {"kill-rank": {
        "ours": [{"mttr_s": 0.4, "steps_lost": 2, "recovered": True, "digest": "a"},
                 {"mttr_s": 0.6, "steps_lost": 2, "recovered": True, "digest": "a"}],
        "torchrun": [{"mttr_s": 6.0, "steps_lost": 2, "recovered": True, "digest": "b"},
                     {"mttr_s": None, "recovered": False}],
        "nvrx": "cannot: a reason long enough to explain itself"}}
    out = peers.summarize(runs, {"ours": "a", "torchrun": "c"})
    assert out["kill-rank"]["ours"]["median_s"] == 0.5 and out["kill-rank"]["ours"]["digest_equal"] == 2
    assert out["kill-rank"]["torchrun"]["ratio_to_ours"] == 12.0
    assert out["kill-rank"]["torchrun"]["not_recovered"] == 1 and out["kill-rank"]["torchrun"]["digest_equal"] == 0
    assert out["kill-rank"]["nvrx"] == {"cannot": "cannot: a reason long enough to explain itself"}
    text = peers.table(out)
    assert "12.0x" in text and "cannot:" in text


def test_bad_arguments_are_one_line_errors(capsys):
    with pytest.raises(SystemExit) as e:
        peers.parse_args(["--systems", "ours,bogus"])
    assert e.value.code == 2 and "unknown: bogus" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        peers.parse_args(["--systems", "torchft", "--g", "2"])
    with pytest.raises(SystemExit):
        peers.parse_args(["--systems", "nvrx", "--prefix", "/nonexistent-peers"])
    assert "run benchmarks/peers/setup.sh" in capsys.readouterr().err


def test_markdown_table_of_a_written_json(tmp_path, capsys):
    runs = {"kill-node": {"ours": [{"mttr_s": 0.3, "steps_lost": 2, "recovered": True, "digest": "a"}],
                          "torchft": [{"mttr_s": 2.1, "steps_lost": 0, "recovered": True, "digest": "x"}]}}
    doc = {"results": peers.summarize(runs, {"ours": "a", "torchft": "b"}),
           "script_lines_changed": {"ours": {"added": 0, "removed": 0}, "torchft": {"added": 17, "removed": 22}}}
    text = peers.markdown(doc)
    assert "| kill-node | ours | 0.30 (0.30–0.30) | 1/1 | 1 | 2 | 1/1 | +0/−0 |" in text
    assert "| kill-node | torchft | 2.10 (2.10–2.10) | 1/1 | 7.0× | 0 | 0/1 | +17/−22 |" in text
    path = tmp_path / "peers.json"
    path.write_text(__import__("json").dumps(doc))
    assert peers.main(["--markdown", str(path)]) == 0 and "torchft" in capsys.readouterr().out
    assert peers.main(["--markdown", str(tmp_path / "missing.json")]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_a_run_that_never_reached_its_fault_is_counted_apart():
    runs = {"kill-rank": {"nvrx": [{"mttr_s": 5.0, "steps_lost": 2, "recovered": True, "digest": "d"},
                                   {"error": "RuntimeError: ended before step 12 with all 2 ranks", "recovered": False},
                                   {"mttr_s": None, "recovered": False, "why": "not within 90 s"}]}}
    cell = peers.summarize(runs, {"nvrx": "d"})["kill-rank"]["nvrx"]
    assert cell["no_fault"] == 1 and cell["not_recovered"] == 1 and cell["n"] == 1 and cell["digest_equal"] == 1
    assert "| 1/2 |" in peers.markdown({"results": {"kill-rank": {"nvrx": cell}}})
