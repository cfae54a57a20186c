"""benchmarks/lightning_mttr.py's pure parts: progress lines → the first step after the
fault, repeats → median/min/max and each baseline's ratio to ours."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import lightning_mttr  # noqa: E402
import lightning_mttr_cases as cases  # noqa: E402


def test_progress_lines_of_both_forms_and_a_torn_last_line():
    assert cases.parse_progress("0 1 10.0\n0 2 11.0\n1 3 15.5\n1 4", attempts=True) == [
        (0, 1, 10.0), (0, 2, 11.0), (1, 3, 15.5)]
    assert cases.parse_progress("1 10.0\n2 11.5\n3 1", attempts=False) == [(0, 1, 10.0), (0, 2, 11.5), (0, 3, 1.0)]
    assert cases.parse_progress("1 10.", attempts=True) == []


def test_the_first_step_after_the_fault_is_of_the_restarted_attempt():
    rows = [(0, 9, 10.0), (0, 10, 11.0), (0, 11, 12.5), (1, 11, 30.0), (1, 12, 30.2)]
    assert cases.first_after(rows, 12.0, 1) == (11, 30.0)  # the old attempt's step in flight is not it
    assert cases.first_after(rows, 40.0, 1) is None
    result = cases._result(rows, 12.0, 1)
    assert (result["mttr_s"], result["step_at_fault"], result["first_step_after"]) == (18.0, 10, 11)


def test_median_min_max_and_ratio_to_ours():
    out = lightning_mttr.summarize({"ours": [{"mttr_s": 2.0}, {"mttr_s": 3.0}, {"mttr_s": 2.5}, {"error": "x"}],
                                    "torchrun": [{"mttr_s": 20.0}, {"mttr_s": 30.0}, {"mttr_s": 25.0}],
                                    "requeue": [{"error": "x"}]})
    assert (out["ours"]["median_s"], out["ours"]["min_s"], out["ours"]["max_s"], out["ours"]["n"]) == (2.5, 2.0, 3.0, 3)
    assert out["torchrun"]["ratio_to_ours"] == 10.0 and "ratio_to_ours" not in out["ours"]
    assert out["requeue"]["n"] == 0 and "ratio_to_ours" not in out["requeue"]
    assert (out["ours"]["no_recovery"], out["requeue"]["no_recovery"], out["torchrun"]["no_recovery"]) == (1, 1, 0)
    assert "10.0x" in lightning_mttr.table(out)


def test_every_contender_is_registered():
    assert list(cases.CONTENDERS) == ["ours", "torchrun", "requeue"]
