"""benchmarks/mttr.py's pure parts: repeats → median/min/max, ratios to both baselines,
and the case registry a new fault plugs into."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCH))

import mttr  # noqa: E402
import mttr_cases  # noqa: E402


def test_median_min_max_and_ratio_to_each_baseline():
    runs = {
        "kill-node": [{"mttr_s": 0.3}, {"mttr_s": 0.1}, {"mttr_s": 0.2}, {"error": "x"}],
        "baseline-slurm-detection": [{"mttr_s": 20.0, "catch_up_s": 21.0}, {"mttr_s": 22.0, "catch_up_s": 23.0}],
        "baseline-instant-detection": [{"mttr_s": 4.0, "catch_up_s": 5.0}],
    }
    out = mttr.summarize(runs)
    k = out["kill-node"]
    assert (k["median_s"], k["min_s"], k["max_s"], k["n"]) == (0.2, 0.1, 0.3, 3)  # the failed run is not a figure
    assert k["ratio"] == {"baseline-slurm-detection": 105.0, "baseline-instant-detection": 20.0}
    assert out["baseline-slurm-detection"]["catch_up"]["median_s"] == 22.0
    assert out["baseline-instant-detection"]["ratio"]["baseline-instant-detection"] == 1.0
    text = mttr.table(out, type("A", (), {"tasks_per_node": 1, "repeats": 3})())
    assert "kill-node" in text and "105.0x" in text and "20.0x" in text


def test_a_case_without_runs_has_no_ratio():
    out = mttr.summarize({"hang-rank": [{"error": "boom"}], "baseline-slurm-detection": [{"mttr_s": 9.0}]})
    assert out["hang-rank"]["median_s"] is None and out["hang-rank"]["ratio"] == {}


def test_every_case_named_in_the_issue_is_registered_and_one_more_plugs_in():
    assert {"kill-node", "rank0-node", "kill-rank", "hang-rank", "scale-in", "process-restart", "requeue",
            "supervisor"} <= set(mttr_cases.CASES)
    case = mttr_cases.register(mttr_cases.Case("test-extra", inject=lambda st: 1.0))
    try:
        assert mttr_cases.CASES["test-extra"] is case and case.measure == "recovery" and case.spares == 1
    finally:
        del mttr_cases.CASES["test-extra"]


def test_first_step_after_is_the_last_rank_of_the_new_world():
    ev = [{"kind": "rank_first_step", "t": 1.0, "generation": 0},
          {"kind": "rank_first_step", "t": 5.0, "generation": 1}, {"kind": "rank_first_step", "t": 5.2, "generation": 1},
          {"kind": "rank_first_step", "t": 9.0, "generation": 2}]
    assert mttr_cases.first_step_after(ev, 2.0) == 5.2
    assert mttr_cases.first_step_after(ev, 10.0) is None


def test_goodput_inputs_come_from_the_benchmarks_json():
    import goodput_inputs as gi

    mttr_doc = {"args": {"tasks_per_node": 2}, "results": {
        "kill-node": {"runs": [{"mttr_s": 0.2, "detect_s": 0.01, "phases_ms": {"reconnect": 20.0, "restore": 5.0}},
                               {"mttr_s": 0.4, "detect_s": 0.03, "phases_ms": {"reconnect": 40.0, "restore": 7.0}},
                               {"error": "boom"}]},
        "freeze-node": {"runs": [{"mttr_s": 2.1}, {"mttr_s": 2.3}, {"mttr_s": 2.2}]}}}
    ph = gi.phases_ms(mttr_doc)
    assert ph == {"detect": 20.0, "reconnect": 30.0, "restore": 6.0}
    assert gi.case_mttr_s(mttr_doc, "freeze-node") == 2.2 and gi.case_mttr_s(mttr_doc, "hang-rank") is None
    assert gi.ranks_per_node(mttr_doc) == 2
    ck = {"bytes": 2e9, "figures": {"ours_stall": {"median_s": 0.1}, "torch_save_write": {"median_s": 3.0}}}
    c = gi.checkpoint_costs(ck, state_gb_per_rank=4.0)
    assert (c["toolkit_s"], c["baseline_s"], c["scale"]) == (0.2, 6.0, 2.0)
    import pytest

    with pytest.raises(ValueError, match="kill-node"):
        gi.phases_ms({"results": {}})


def test_ratios_only_against_baselines_of_the_same_fault():
    runs = {"kill-rank": [{"mttr_s": 0.5, "fault_step": 120}], "kill-node": [{"mttr_s": 0.2}],
            "supervisor": [{"mttr_s": 0.1}],
            "baseline-instant-detection": [{"mttr_s": 4.0}], "baseline-rank-kill": [{"mttr_s": 3.0}]}
    out = mttr.summarize(runs)
    assert out["kill-rank"]["ratio"] == {"baseline-rank-kill": 6.0}  # not the node-kill baseline
    assert out["kill-node"]["ratio"] == {"baseline-instant-detection": 20.0}
    assert out["supervisor"]["ratio"] == {} and out["supervisor"]["fault"] == "supervisor-kill"
    assert out["kill-rank"]["fault_steps"] == [120]
    assert {mttr.fault_of(n) for n in ("hang-rank", "hang-main", "baseline-hang-instant-detection")} == {"rank-hang"}



def test_goodput_downtimes_come_from_peers_then_our_json_then_a_labelled_assumption():
    import goodput_inputs as gi

    names = {"mttr": "m.json", "peers": "p.json"}
    mttr_doc = {"results": {"requeue-resubmit": {"runs": [{"mttr_s": 4.0}]},
                            "baseline-instant-detection": {"runs": [{"mttr_s": 9.0}]}}}
    peers = {"results": {"requeue": {"ours": {"median_s": 5.0}, "lightning": {"median_s": 30.0},
                                     "torchrun": {"median_s": 20.0}},
                         "kill-rank": {"ours": {"median_s": 1.0}, "torchrun": {"median_s": 15.0},
                                       "nvrx": {"median_s": 12.0}, "torchft": {"median_s": 5.0},
                                       "lightning": {"cannot": "no in-job restart"}}}}
    d = gi.downtimes(mttr_doc, peers, names)
    assert d["baseline_requeue"][0] == 20.0 and "torchrun" in d["baseline_requeue"][1]
    assert d["in_job_restart"][0] == 12.0 and "nvrx" in d["in_job_restart"][1]  # torchft is no in-job restart
    assert d["toolkit_requeue"] == (4.0, "m.json: requeue-resubmit (no spare)")
    d = gi.downtimes(mttr_doc, None, names)  # no peers.json yet
    assert d["baseline_requeue"][0] == 9.0 and "baseline-instant-detection" in d["baseline_requeue"][1]
    assert d["in_job_restart"][0] == gi.ASSUMED_IN_JOB_RESTART_S and d["in_job_restart"][1].startswith("assumed")
    d = gi.downtimes(None, None, names)
    assert all(v[1].startswith("assumed") for v in d.values())
