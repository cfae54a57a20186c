"""Job-level restart from the checkpoint tiers, on localhost with real processes.

A first job trains part of the way and stops; a second job with the same node-local
directories and job directory resumes from the newest complete checkpoint. Which
tier it restores from is forced by deleting the faster ones:

    own L1 shards present          → restored from L1
    every own L1 shard deleted     → restored from a PARTNER copy on another node
    all of L1 deleted              → restored from L2 (shared, deduplicated: each
                                     replicated tensor in one rank's file only)

Each resumed run must end bit-identical to an uninterrupted run of the same length.
A resume at a smaller world size (scale-in) continues from the same state and the
same global sample position; "identical" there means two scale-in resumes from the
same checkpoint end with the same bits (there is no fixed-world run to compare to).
"""

import shutil
from pathlib import Path

import h5py
import pytest
import torch

from slurm_resilience.checkpoint import manifest as mf

from .localjob import LocalJob

pytestmark = pytest.mark.timeout(240)

FIRST, TOTAL = 20, 30
CKPT = {"local_every": 10, "shared_every_kth": 1, "memory_every": 10}
RUN = "c" * 32  # "resumed" continues "first": one run (as a requeue would), so its checkpoints are its own


def _run(root: Path, *, steps: int, nodes: int = 3, job_name: str, local: Path) -> LocalJob:
    """One job; node-local dirs under ``local``, the shared tier in ``root/shared``."""
    job = LocalJob(root, nodes=nodes, spares=0, steps=steps, step_time=0.0,
                   checkpoint={**CKPT, "shared_dir": str(root / "shared")},
                   job_name=job_name, local_dir=local, run_id=RUN).start()
    try:
        assert job.wait() == 0, job.diag()
    finally:
        job.kill_leftovers()
    return job


def _final(job: LocalJob) -> dict:
    return torch.load(job.job_dir / "final.pt", weights_only=False)


def _same(a: dict, b: dict) -> bool:
    return all(torch.equal(a["objects"]["model"][k], b["objects"]["model"][k]) for k in a["objects"]["model"]) \
        and a["step"] == b["step"] and a["position"] == b["position"]


def _restored(job: LocalJob) -> dict:
    ev = [e for e in job.events() if e["kind"] == "rank_restored" and "tier" in e]
    assert ev, job.diag()
    return ev[0]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckref")
    return _final(_run(root, steps=TOTAL, job_name="ref", local=root / "local"))


def _first_part(root: Path) -> tuple[Path, Path]:
    """Train FIRST steps; return (node-local root, shared checkpoint dir)."""
    local = root / "local"
    _run(root, steps=FIRST, job_name="first", local=local)
    return local, root / "shared"


@pytest.mark.parametrize("delete,tier", [
    (None, "L1"),
    ("own-l1", "L1-partner"),
    ("all-l1", "L2"),
])
def test_resume_walks_tiers_and_is_bit_identical(tmp_path, reference, delete, tier):
    local, shared = _first_part(tmp_path)
    assert (shared / "latest").read_text().strip() == str(FIRST)
    if delete == "own-l1":
        for d in local.glob("*/ckpt/step-*"):
            shutil.rmtree(d)
    elif delete == "all-l1":
        shutil.rmtree(local)
    if tier == "L2":  # deduplicated: each replicated tensor in one file only, still the whole state
        owners = mf.read_manifest(str(shared), FIRST).extra["dedup"]["owners"]
        files = sorted((shared / f"step-{FIRST:08d}").glob("rank-*.h5"))
        held = []
        for f in files:
            with h5py.File(f, "r") as h:
                held.append(set(_datasets(h)))
        assert len(files) == 3 and owners and len({owners[k] for k in owners}) > 1
        assert all(sum(k in h for h in held) == 1 for k in owners)
    resumed = _run(tmp_path, steps=TOTAL, job_name="resumed", local=local)
    ev = _restored(resumed)
    assert ev["tier"] == tier and ev["step"] == FIRST, ev
    assert _same(_final(resumed), reference)


def test_corrupt_newest_checkpoint_falls_back(tmp_path, reference):
    local, shared = _first_part(tmp_path)
    shutil.rmtree(local)  # only L2 remains: steps 10 and 20
    # L2 is deduplicated: a replicated tensor of step 20 lives in its owner's file only,
    # so corrupting it there leaves no valid copy of step 20 on any rank: step 10 is used
    owners = mf.read_manifest(str(shared), FIRST).extra["dedup"]["owners"]
    name = next(k for k in sorted(owners) if k.startswith("objects/objects/model/"))
    shard = shared / f"step-{FIRST:08d}" / f"rank-{owners[name]:05d}.h5"
    with h5py.File(shard, "r") as f:
        offset = f[name].id.get_offset()
    data = bytearray(shard.read_bytes())
    data[offset + 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    resumed = _run(tmp_path, steps=TOTAL, job_name="resumed", local=local)
    ev = _restored(resumed)
    assert ev["step"] == FIRST - CKPT["local_every"] and ev["tier"] == "L2", ev
    invalid = [e for e in resumed.events() if e["kind"] == "rank_checkpoint_invalid"]
    assert invalid and {e["step"] for e in invalid} == {FIRST}, invalid
    assert _same(_final(resumed), reference)


def _datasets(f):
    out = []
    f.visititems(lambda n, o: out.append(n) if hasattr(o, "dtype") else None)
    return out


def test_scale_in_resume_continues_from_same_state_and_position(tmp_path):
    local, _ = _first_part(tmp_path)
    runs = []
    for i in range(2):
        copy = tmp_path / f"copy{i}"
        shutil.copytree(tmp_path / "shared", copy / "shared")
        shutil.copytree(local, copy / "local")
        job = _run(copy, steps=TOTAL, nodes=2, job_name="resumed", local=copy / "local")
        ev = _restored(job)
        assert ev["step"] == FIRST and ev["position"] == FIRST * 3 * 16, ev
        runs.append(_final(job))
    assert runs[0]["position"] == FIRST * 3 * 16 + (TOTAL - FIRST) * 2 * 16
    assert _same(runs[0], runs[1])
