"""End to end on the real local Slurm: a job started where another run left its
checkpoints trains from step 0 and says it ignored them.

The issue this guards (a restarted Slurm numbering jobs from 1 again, so a new job's
node-local directory held an earlier job's checkpoints, restored at the first state
sync): here the two runs share the checkpoint directories outright — a node-local
path with neither ``{job_id}`` nor ``{run_id}`` and one shared L2 directory — which
is what a repeated job id does to the old default path. Run A leaves steps 10 and 20;
run B, the same program, must restore nothing (a silent restore of A's step 20 would
end it at once), log one line per root it ignored, and write its own manifests.
"""

import re

import pytest
import yaml

from slurm_resilience import lab
from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(240)]

STEPS = 20


def _run_id(job_dir):
    return re.search(r"^export SR_RUN_ID=([0-9a-f]{32})$", (job_dir / "job.sbatch").read_text(), re.M).group(1)


def test_a_job_where_another_run_left_checkpoints_starts_from_scratch_and_says_so(cluster, jobs_root, tmp_path):
    cfg = yaml.safe_load(lab.LOCAL_CONFIG.read_text()) or {}
    cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "local_dir": str(tmp_path / "l1" / "{node}"),
                         "shared_dir": str(tmp_path / "l2"), "local_every": 10, "shared_every_kth": 2}
    cfg.setdefault("recovery", {})["local_standbys"] = False  # fewer processes on the 2-core box
    config = tmp_path / "shared-dirs.yaml"
    config.write_text(yaml.safe_dump(cfg))
    l2 = str(tmp_path / "l2")

    first = lab.submit(jobs_root / "foreign-a", nodes=2, spares=0, steps=STEPS, config=config)
    assert first.wait() == 0, first.output()
    run_a = _run_id(first.job_dir)
    assert mf.complete_steps(l2) == [20]
    assert mf.read_manifest(l2, 20).run_id == run_a

    second = lab.submit(jobs_root / "foreign-b", nodes=2, spares=0, steps=STEPS, config=config)
    assert second.wait() == 0, second.output()
    run_b = _run_id(second.job_dir)
    assert run_b != run_a
    events = read_events(str(second.job_dir / "events.jsonl"))
    restored = [e for e in events if e["kind"] == "rank_restored"]
    assert len(restored) == 2 and all(e["step"] == 0 for e in restored), restored  # from scratch
    foreign = [e for e in events if e["kind"] == "rank_checkpoint_foreign"]
    assert 1 <= len(foreign) <= 2 and len({e["rank"] for e in foreign}) == len(foreign), foreign  # once per rank
    found = [f for e in foreign for f in e["found"]]
    assert {(f["tier"], f["root"], tuple(f["run_ids"])) for f in found if f["tier"] == "L2"} == {("L2", l2, (run_a,))}
    assert all(f["run_ids"] == [run_a] for f in found), found
    log = (second.job_dir / "supervisor.log").read_text()
    assert re.search(r"ignored \d+ checkpoint step\(s\) of another run \(not restored\)", log), log
    # B trained the whole way and its own checkpoints name it; A's run id is gone from the L2 step it rewrote
    assert sorted(e["step"] for e in events if e["kind"] == "rank_done") == [STEPS, STEPS]
    assert mf.read_manifest(l2, 20).run_id == run_b
