"""The scale harness (benchmarks/scale.py) at ~1,024 simulated ranks: behaviour only.

The real supervisor and store with 128 simulated nodes × 8 ranks: a node killed is
detected, the plan that follows leaves it out and reaches every rank, and nothing is
suspected in a short steady window. No timing is asserted (docs/scale.md has them).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from scale_sim.run import Run, RunSpec  # noqa: E402

RANKS = 1024


@pytest.mark.timeout(240)
def test_killed_node_at_1024_simulated_ranks(tmp_path):
    spec = RunSpec(ranks=RANKS, tasks_per_node=8, steady_s=3.0, settle_s=0.5, cases=("killed",),
                   drain=False, finish=False, wait_recovery=False, max_wait_s=120)
    with Run(spec, root=str(tmp_path)) as run:
        r = run.measure()
        diag = f"{r}\n--- supervisor\n{run.tail('supervisor')}"
    assert r["errors"] == [], diag
    assert r["false_alarms"] == 0, diag
    killed = r["killed"]
    assert killed["fault_kinds"] == ["node_lost"], diag
    assert killed["plan_excludes_node"], diag
    assert killed["plan_to_all_read_s"] is not None and killed["plan_to_all_joined_s"] is not None, diag
