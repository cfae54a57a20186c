"""CheckpointEngine in one process (world 1): tiers, restore, corruption, disk full, SIGKILL, CLI.

Real files, real HDF5, a real tmpfs for the disk-full case, a real SIGKILL of a
writer process. No fakes beyond the ``emit`` callback that records events and a
gate that holds the writer thread (to show that ``save`` does not wait for it).
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time

import h5py
import pytest
import torch

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.engine import CheckpointEngine
from slurm_resilience.checkpoint.hdf5_format import flatten_state, verify_shard
from slurm_resilience.checkpoint.tiers import TierSpec

pytestmark = pytest.mark.timeout(120)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Events(list):
    def __call__(self, kind, **fields):
        self.append((kind, fields))

    def of(self, kind):
        return [f for k, f in self if k == kind]


def specs(tmp_path, l2=True, l1_path=None):
    out = [
        TierSpec(name="L0", storage="memory", interval_steps=1),
        TierSpec(name="L1", storage="local", interval_steps=1, path=l1_path or str(tmp_path / "l1"), keep=3),
    ]
    if l2:
        out.append(TierSpec(name="L2", storage="shared", every_kth=2, path=str(tmp_path / "l2")))
    return tuple(out)


def make_engine(tier_specs, tmp_path, events):
    return CheckpointEngine(tier_specs, job_id="1", run_id="0" * 32, job_dir=str(tmp_path), node="node0",
                            emit=events)


def train_state(step, width=8):
    torch.manual_seed(step)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(), torch.nn.Linear(width, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(3, width)).sum().backward()
    opt.step()
    return {"objects": {"model": model.state_dict(), "optimizer": opt.state_dict()}, "step": step}


def big_state(step, mbytes):
    n = mbytes * (1 << 20) // 4
    g = torch.Generator().manual_seed(step)
    return {"objects": {"model": {"w": torch.rand(n, generator=g)}}, "step": step}


def assert_state_equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_state_equal(x, y)
    else:
        assert a == b


def flip_byte(path, dataset="objects/objects/model/0.weight"):
    """Flip one byte inside ``dataset``'s contiguous data region of the HDF5 file."""
    with h5py.File(path, "r", locking=False) as f:
        ds = f[dataset]
        offset, size = ds.id.get_offset(), ds.id.get_storage_size()
    assert offset is not None and size > 0
    with open(path, "r+b") as fh:
        fh.seek(offset + size // 2)
        b = fh.read(1)
        fh.seek(offset + size // 2)
        fh.write(bytes([b[0] ^ 0xFF]))


def save_steps(engine, steps, **kw):
    saved = {}
    for s in steps:
        saved[s] = train_state(s, **kw)
        engine.save(s, saved[s])
        assert engine.wait(timeout=60)
    return saved


def cli(*args):
    return subprocess.run([sys.executable, "-m", "slurm_resilience.cli", "ckpt", *args],
                          capture_output=True, text=True, timeout=60, cwd=REPO)


# -- 1. tiers, restore from a fresh engine, retention, modes ------------------------------


def test_save_restore_across_tiers_and_modes(tmp_path):
    events = Events()
    eng = make_engine(specs(tmp_path), tmp_path, events)
    try:
        saved = save_steps(eng, [1, 2, 3, 4])
        assert eng.best() == (4, "L0", "")
        assert_state_equal(eng.load(eng.best()), saved[4])
    finally:
        eng.close()
    assert not events.of("checkpoint_failed")
    assert [f["step"] for f in events.of("checkpoint_durable") if f["tier"] == "L2"] == [2, 4]

    events2 = Events()
    eng2 = make_engine(specs(tmp_path), tmp_path, events2)
    try:
        l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
        best = eng2.best()
        assert best == (4, "L1", mf.shard_path(l1, 4, 0))
        assert_state_equal(eng2.load(best), saved[4])
        assert not events2.of("checkpoint_invalid")
        # into: the rank's own tensors (as the session passes them) are read over in place
        own = flatten_state(train_state(99))[0]
        got = eng2.load(best, into=own)
        assert_state_equal(got, saved[4])
        assert all(any(t is g for g in flatten_state(got)[0].values()) for t in own.values())
    finally:
        eng2.close()

    assert mf.complete_steps(l1) == [2, 3, 4]  # keep=3
    assert mf.read_latest(l1) == 4
    assert mf.complete_steps(l2) == [2, 4]
    assert mf.read_latest(l2) == 4
    for root, steps in ((l1, [2, 3, 4]), (l2, [2, 4])):
        assert mf.incomplete_steps(root) == []
        for s in steps:
            assert mf.validate_step(root, s, deep=True) == []
            man = mf.read_manifest(root, s)
            assert man.step == s and man.world_size == 1 and set(man.shards) == {0}
    # L2 holds exactly the data of L1 at that step
    assert_state_equal(eng2.load((2, "L2", mf.shard_path(l2, 2, 0))), saved[2])

    for root in (l1, l2):
        for dirpath, dirnames, filenames in os.walk(root):
            if dirpath != root:  # step directories (the tier root is checked below)
                assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
            for name in filenames:
                p = os.path.join(dirpath, name)
                assert stat.S_IMODE(os.stat(p).st_mode) == 0o600, p



def test_a_restore_from_host_memory_lands_in_the_given_tensors_and_leaves_the_snapshot(tmp_path):
    """L0 with ``into``: the rank's own tensors get the bytes (as from disk); the held
    snapshot is a copy, so changing the restored tensors does not change the next restore."""
    events = Events()
    eng = make_engine(specs(tmp_path, l2=False), tmp_path, events)
    try:
        state = train_state(5)
        eng.save(1, state)
        assert eng.wait(timeout=60)
        best = eng.best()
        assert best[:2] == (1, "L0")
        own = {k: torch.zeros_like(v) for k, v in flatten_state(state)[0].items()}
        got = eng.load(best, into=own)
        assert_state_equal(got, state)
        assert all(any(t is g for g in flatten_state(got)[0].values()) for t in own.values())
        for t in own.values():
            t.add_(1)
        assert_state_equal(eng.load(best), state)
    finally:
        eng.close()

def test_tier_root_dir_is_private(tmp_path):
    eng = make_engine(specs(tmp_path), tmp_path, Events())
    try:
        save_steps(eng, [1, 2])
    finally:
        eng.close()
    for root in (tmp_path / "l1", tmp_path / "l2"):
        assert stat.S_IMODE(os.stat(root).st_mode) == 0o700, root


# -- 2. a corrupt shard is skipped and reported --------------------------------------------


def test_corrupt_l1_shard_is_skipped(tmp_path):
    eng = make_engine(specs(tmp_path), tmp_path, Events())
    try:
        saved = save_steps(eng, [1, 2, 3, 4])
    finally:
        eng.close()
    l1, l2 = str(tmp_path / "l1"), str(tmp_path / "l2")
    bad = mf.shard_path(l1, 4, 0)
    flip_byte(bad)
    assert verify_shard(bad)

    events = Events()
    eng2 = make_engine(specs(tmp_path), tmp_path, events)
    try:
        best = eng2.best()
        assert best is not None and best[2] != bad
        assert best in {(4, "L2", mf.shard_path(l2, 4, 0)), (3, "L1", mf.shard_path(l1, 3, 0))}
        assert best == (4, "L2", mf.shard_path(l2, 4, 0))  # same step, next tier first
        assert verify_shard(best[2]) == []
        assert_state_equal(eng2.load(best), saved[best[0]])
    finally:
        eng2.close()
    invalid = events.of("checkpoint_invalid")
    assert [(f["step"], f["source"], f["path"]) for f in invalid] == [(4, "L1", bad)]
    assert invalid[0]["problems"] and "checksum mismatch" in invalid[0]["problems"][0]


# -- 3. disk full: reported, never raised, older checkpoint untouched ---------------------


def test_disk_full_is_reported_not_raised(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount tmpfs: {r.stderr.strip()}")
    try:
        root = str(mnt / "l1")
        events = Events()
        eng = make_engine(specs(tmp_path, l2=False, l1_path=root), tmp_path, events)
        try:
            small = train_state(1)
            eng.save(1, small)
            assert eng.wait(timeout=60)
            assert mf.complete_steps(root) == [1]

            eng.save(2, big_state(2, mbytes=2))  # 2 MiB into a 256 KiB filesystem: no exception
            assert eng.wait(timeout=60)
        finally:
            eng.close()
        failed = events.of("checkpoint_failed")
        assert len(failed) == 1 and failed[0]["step"] == 2 and failed[0]["tiers"] == ["L1"]
        assert failed[0]["error"] and "\n" not in failed[0]["error"]
        assert "space" in failed[0]["error"].lower() or "write" in failed[0]["error"].lower()
        assert [f["step"] for f in events.of("checkpoint_durable")] == [1]

        assert mf.complete_steps(root) == [1]
        assert mf.read_latest(root) == 1
        assert mf.validate_step(root, 1, deep=True) == []
        assert not os.path.exists(mf.shard_path(root, 2, 0))
        assert not os.path.exists(mf.manifest_path(root, 2))
        leftovers = os.listdir(mf.step_dir(root, 2)) if os.path.isdir(mf.step_dir(root, 2)) else []
        assert leftovers == []  # the temp file was removed too

        eng2 = make_engine(specs(tmp_path, l2=False, l1_path=root), tmp_path, Events())
        try:
            best = eng2.best()
            assert best == (1, "L1", mf.shard_path(root, 1, 0))
            assert_state_equal(eng2.load(best), small)
        finally:
            eng2.close()
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


# -- 4. SIGKILL of the writer mid-file ------------------------------------------------------

_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time, torch
    from slurm_resilience.checkpoint.engine import CheckpointEngine
    from slurm_resilience.checkpoint.tiers import TierSpec

    root = sys.argv[1]
    specs = (TierSpec(name="L0", storage="memory", interval_steps=1),
             TierSpec(name="L1", storage="local", interval_steps=1, path=root, keep=3))
    eng = CheckpointEngine(specs, job_id="1", run_id="0" * 32, job_dir=root, node="n0")
    eng.save(1, {"objects": {"model": {"w": torch.arange(1000, dtype=torch.float32)}}, "step": 1})
    assert eng.wait(60)
    n = 300 * (1 << 20) // 4
    eng.save(2, {"objects": {"model": {"w": torch.rand(n), "v": torch.rand(n)}}, "step": 2})
    print("writing", flush=True)
    time.sleep(600)
    """
)


def test_sigkill_mid_write_leaves_previous_checkpoint(tmp_path):
    root = str(tmp_path / "l1")
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, root], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        step2 = mf.step_dir(root, 2)
        deadline = time.time() + 90
        while time.time() < deadline:
            if os.path.isdir(step2) and any(n.endswith(".tmp") and os.path.getsize(os.path.join(step2, n)) > 0
                                            for n in os.listdir(step2)):
                break
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.01)
        else:
            pytest.fail("the writer never started step 2")
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    assert mf.complete_steps(root) == [1]
    assert mf.incomplete_steps(root) == [2]
    assert mf.read_latest(root) == 1
    assert not os.path.exists(mf.shard_path(root, 2, 0))  # only a temp file, never the final name

    events = Events()
    tiers = (TierSpec(name="L0", storage="memory", interval_steps=1),
             TierSpec(name="L1", storage="local", interval_steps=1, path=root, keep=3))
    eng = make_engine(tiers, tmp_path, events)
    try:
        best = eng.best()
        assert best == (1, "L1", mf.shard_path(root, 1, 0))
        state = eng.load(best)
        assert torch.equal(state["objects"]["model"]["w"], torch.arange(1000, dtype=torch.float32))
        assert not events.of("checkpoint_invalid")
    finally:
        eng.close()

    r = cli("verify", root)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "valid" in r.stdout and "INVALID" not in r.stdout and "1 valid, 0 invalid" in r.stdout
    # retention keeps the newer, possibly still running, incomplete step
    assert mf.prune(root, keep_last=1) == []
    assert mf.complete_steps(root) == [1] and mf.incomplete_steps(root) == [2]


# -- 5. the background writer does not block training ----------------------------------------


def test_save_returns_before_the_disk_write(tmp_path, monkeypatch):
    """save() is the host copy only: it returns while the writer is still held before
    the L1 write, and what is written is the state as it was at save(), even though
    training changes the tensors in place meanwhile. No durations are compared (the
    stall against the persist time is a benchmark figure, benchmarks/checkpoint.py)."""
    import slurm_resilience.checkpoint.engine as engine_mod

    gate, started = threading.Event(), threading.Event()
    real = engine_mod.persist_local

    def held(*args, **kw):
        started.set()
        if not gate.wait(60):
            raise RuntimeError("test gate never opened")
        return real(*args, **kw)

    monkeypatch.setattr(engine_mod, "persist_local", held)
    events = Events()
    eng = make_engine(specs(tmp_path, l2=False), tmp_path, events)
    try:
        state = big_state(1, mbytes=8)
        expected = state["objects"]["model"]["w"].clone()
        out = []
        t0 = time.perf_counter()
        saver = threading.Thread(target=lambda: out.append(eng.save(1, state)))
        saver.start()
        saver.join(60)  # a hang detector, not a speed bound: save() must not wait for the gate
        returned = time.perf_counter() - t0
        assert not saver.is_alive(), "save() waited for the background write"
        assert started.wait(60), "the writer never picked up the checkpoint"
        assert not eng.wait(timeout=0) and eng.stats == []
        assert mf.read_latest(str(tmp_path / "l1")) is None
        state["objects"]["model"]["w"].add_(1.0)  # training goes on, in place
        gate.set()
        assert eng.wait(timeout=100)
    finally:
        gate.set()
        eng.close()
    stall = out[0]
    assert 0 <= stall <= returned
    assert [s["step"] for s in eng.stats if s["tier"] == "L1"] == [1]
    best = make_engine(specs(tmp_path, l2=False), tmp_path, Events())
    try:
        cand = best.best()
        assert cand is not None and cand[:2] == (1, "L1")
        assert torch.equal(best.load(cand)["objects"]["model"]["w"], expected)
    finally:
        best.close()
    assert [f["stall_ms"] for f in events.of("checkpoint_saved")] == [round(stall * 1000, 3)]


# -- 6. the ckpt CLI ------------------------------------------------------------------------


def test_ckpt_cli_list_verify_prune(tmp_path):
    tiers = (TierSpec(name="L0", storage="memory", interval_steps=1),
             TierSpec(name="L1", storage="local", interval_steps=1, path=str(tmp_path / "l1"), keep=3),
             TierSpec(name="L2", storage="shared", every_kth=2, path=str(tmp_path / "l2"), keep=3))
    eng = make_engine(tiers, tmp_path, Events())
    try:
        save_steps(eng, range(1, 7))
    finally:
        eng.close()
    l2 = str(tmp_path / "l2")
    assert mf.complete_steps(l2) == [2, 4, 6]

    r = cli("list", l2)
    assert r.returncode == 0, r.stderr
    assert "3 complete, 0 incomplete; latest 6" in r.stdout
    assert "<- latest" in [ln for ln in r.stdout.splitlines() if "step" in ln and " 6 " in ln][0]

    r = cli("verify", l2)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3 valid, 0 invalid" in r.stdout

    flip_byte(mf.shard_path(l2, 4, 0))
    r = cli("verify", l2)
    assert r.returncode == 1, r.stdout + r.stderr
    line4 = [ln for ln in r.stdout.splitlines() if ln.split()[:2] == ["step", "4"]]
    assert line4 and "INVALID" in line4[0] and "checksum" in line4[0]
    assert all("INVALID" not in ln for ln in r.stdout.splitlines() if ln.split()[:2] in (["step", "2"], ["step", "6"]))
    assert "2 valid, 1 invalid" in r.stdout
    r = cli("verify", l2, "6")
    assert r.returncode == 0 and "1 valid, 0 invalid" in r.stdout

    r = cli("prune", l2, "--keep", "1")
    assert r.returncode == 0, r.stderr
    assert "deleted steps: 2, 4" in r.stdout
    assert mf.complete_steps(l2) == [6] and mf.read_latest(l2) == 6
    assert not os.path.exists(mf.step_dir(l2, 2))
