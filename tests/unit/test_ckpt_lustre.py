"""Lustre striping of the shared tier: detection from a mount table, ``lfs`` through an
argv list, and the engine striping each new L2 step directory exactly once (fake adapter)."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from slurm_resilience.checkpoint import layout
from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.checkpoint.engine import CheckpointEngine
from slurm_resilience.checkpoint.lustre import LustreStriping, check_striping, fstype_of, parse_mounts, stripe_argv
from slurm_resilience.checkpoint.tiers import TierSpec
from slurm_resilience.config import CheckpointConfig, load_config
from slurm_resilience.errors import CheckpointError, ConfigError

pytestmark = pytest.mark.timeout(120)

MOUNTS = """\
/dev/sda1 / ext4 rw,relatime 0 0
proc /proc proc rw,nosuid 0 0
10.0.0.1@o2ib:/scratch /lustre/scratch lustre rw,flock,lazystatfs 0 0
nfs:/home /lustre/scratch/home nfs rw 0 0
10.0.0.1@o2ib:/proj /mnt/my\\040project lustre rw 0 0
tmpfs /tmp tmpfs rw 0 0
garbage
"""


# -- detection ---------------------------------------------------------------------


def test_parse_mounts_decodes_escapes_and_skips_garbage():
    m = parse_mounts(MOUNTS)
    assert ("/mnt/my project", "lustre") in m and ("/lustre/scratch", "lustre") in m
    assert len(m) == 6


@pytest.mark.parametrize("path,fstype", [
    ("/lustre/scratch", "lustre"),
    ("/lustre/scratch/u1/job/checkpoints", "lustre"),
    ("/lustre/scratch/home/u1/ckpt", "nfs"),  # a mount inside a Lustre tree is not Lustre
    ("/lustre/scratchpad/x", "ext4"),  # a name prefix is not a parent
    ("/mnt/my project/run", "lustre"),
    ("/tmp/ckpt", "tmpfs"),
    ("/home/u1", "ext4"),
])
def test_fstype_is_the_longest_containing_mount(path, fstype):
    assert fstype_of(path, parse_mounts(MOUNTS)) == fstype


def test_is_lustre_reads_the_mount_table(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(MOUNTS + f"fs@tcp:/x {tmp_path}/lu lustre rw 0 0\n")
    s = LustreStriping(mounts=str(mounts))
    assert s.is_lustre(str(tmp_path / "lu" / "job" / "checkpoints"))  # need not exist yet
    assert not s.is_lustre(str(tmp_path / "other"))
    (tmp_path / "lu").mkdir()
    os.symlink(tmp_path / "lu", tmp_path / "link")
    assert s.is_lustre(str(tmp_path / "link" / "ck"))  # resolved before matching
    assert not LustreStriping(mounts=str(tmp_path / "missing")).is_lustre("/lustre/scratch")


# -- lfs --------------------------------------------------------------------------


def test_stripe_argv_is_a_list_without_shell():
    assert stripe_argv("lfs", "/p fs/$(x)", 8, "4M") == ["lfs", "setstripe", "-c", "8", "-S", "4M", "/p fs/$(x)"]


def _fake_lfs(tmp_path, monkeypatch, body):
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "lfs"
    script.write_text("#!/bin/sh\n" + body)
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")
    return tmp_path / "argv"


def test_stripe_runs_lfs(tmp_path, monkeypatch):
    log = _fake_lfs(tmp_path, monkeypatch, f'printf "%s\\n" "$@" > {tmp_path}/argv\n')
    LustreStriping().stripe("/p fs/step-00000002", -1, "1M")
    assert log.read_text().splitlines() == ["setstripe", "-c", "-1", "-S", "1M", "/p fs/step-00000002"]


def test_stripe_failure_and_timeout_raise_checkpoint_error(tmp_path, monkeypatch):
    _fake_lfs(tmp_path, monkeypatch, 'echo "not a lustre fs" >&2\nexit 22\n')
    with pytest.raises(CheckpointError, match="exit 22.*not a lustre fs"):
        LustreStriping().stripe("/q", 4, "4M")
    (tmp_path / "bin" / "lfs").write_text("#!/bin/sh\nsleep 5\n")
    with pytest.raises(CheckpointError, match="timed out"):
        LustreStriping(timeout_s=0.2).stripe("/q", 4, "4M")


def test_stripe_without_lfs_raises(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(CheckpointError, match="not on PATH"):
        LustreStriping().stripe("/q", 4, "4M")


# -- validation --------------------------------------------------------------------


@pytest.mark.parametrize("count,size", [(-1, "4M"), (0, "4M"), (1, "64K"), (2000, "1g"), (8, "65536")])
def test_valid_striping(count, size):
    check_striping("x.", count, size)


@pytest.mark.parametrize("count,size,msg", [
    (-2, "4M", "stripe_count=-2 must be -1"), (2001, "4M", "stripe_count=2001"), (True, "4M", "stripe_count"),
    (4, "4X", "stripe_size='4X' must be a number"), (4, "100K", "multiple of 64K"), (4, "4G", "below 4G"),
    (4, "", "must be a number"), (4, 4, "must be a number"),
])
def test_invalid_striping(count, size, msg):
    with pytest.raises(ConfigError, match=msg):
        check_striping("checkpoint.lustre_", count, size)
    with pytest.raises(ConfigError, match=msg):
        TierSpec(name="L2", storage="shared", every_kth=1, path="/x", stripe_count=count, stripe_size=size)


@pytest.mark.parametrize("yaml,message", [
    ("checkpoint: {lustre_stripe_count: -2}",
     "checkpoint.lustre_stripe_count=-2 must be -1 (all OSTs), 0 (do not stripe) or 1..2000"),
    ("checkpoint: {lustre_stripe_count: all}", "checkpoint.lustre_stripe_count must be an integer, got 'all'"),
    ("checkpoint: {lustre_stripe_size: 4MB}",
     "checkpoint.lustre_stripe_size='4MB' must be a number with an optional K, M or G suffix, such as '4M'"),
    ("checkpoint: {lustre_stripe_size: 100K}", "checkpoint.lustre_stripe_size='100K' must be a multiple of 64K below 4G"),
    ("checkpoint: {lustre_stripe_size: 4194304}", "checkpoint.lustre_stripe_size must be a string, got 4194304"),
])
def test_bad_striping_in_yaml_is_one_line(tmp_path, yaml, message):
    """The rows of the bad-input table in docs/configuration.md."""
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(yaml + "\n")
    with pytest.raises(ConfigError) as ei:
        load_config(cfg)
    assert str(ei.value) == message


def test_config_passes_striping_to_the_shared_tier():
    spec = CheckpointConfig(lustre_stripe_count=-1, lustre_stripe_size="16M").tiers()[-1]
    assert (spec.storage, spec.stripe_count, spec.stripe_size) == ("shared", -1, "16M")
    with pytest.raises(ConfigError, match=r"^checkpoint\.lustre_stripe_count=-5 must be"):
        CheckpointConfig(lustre_stripe_count=-5)


# -- the engine --------------------------------------------------------------------


class FakeStriping:
    def __init__(self, lustre: bool, fail: bool = False) -> None:
        self.lustre, self.fail = lustre, fail
        self.asked: list[str] = []
        self.calls: list[tuple[str, int, str, list[str]]] = []

    def is_lustre(self, path: str) -> bool:
        self.asked.append(path)
        return self.lustre

    def stripe(self, directory: str, count: int, size: str) -> None:
        self.calls.append((directory, count, size, sorted(os.listdir(directory))))
        if self.fail:
            raise CheckpointError("`lfs setstripe` failed (exit 1): no space on MDT")


def _run(tmp_path, striping, steps=range(1, 7), **l2):
    events = []
    tiers = (TierSpec(name="L1", storage="local", interval_steps=1, path=str(tmp_path / "l1")),
             TierSpec(name="L2", storage="shared", every_kth=2, path=str(tmp_path / "l2"), keep=5, **l2))
    eng = CheckpointEngine(tiers, job_id="1", run_id="0" * 32, job_dir=str(tmp_path), node="n0",
                           striping=striping,
                           emit=lambda kind, **f: events.append((kind, f)))
    try:
        for s in steps:
            eng.save(s, {"w": torch.full((64,), float(s))})
            assert eng.wait(timeout=60)
        eng.save(6, {"w": torch.zeros(4)}, tiers=["L2"])  # the step directory exists: not new
        assert eng.wait(timeout=60)
    finally:
        eng.close()
    return events


def test_engine_stripes_each_new_l2_step_dir_once_on_lustre(tmp_path):
    fake = FakeStriping(lustre=True)
    events = _run(tmp_path, fake, stripe_count=8, stripe_size="16M")
    l2 = str(tmp_path / "l2")
    assert fake.calls == [(layout.step_dir(l2, s), 8, "16M", []) for s in (2, 4, 6)]  # empty when striped
    assert fake.asked == [l2]  # detected once per tier root
    assert mf.complete_steps(l2) == [2, 4, 6] and not [k for k, _ in events if k == "checkpoint_failed"]


def test_engine_never_stripes_elsewhere(tmp_path):
    fake = FakeStriping(lustre=False)
    _run(tmp_path, fake)
    assert fake.calls == [] and fake.asked == [str(tmp_path / "l2")]
    assert mf.complete_steps(str(tmp_path / "l2")) == [2, 4, 6]


def test_engine_stripe_count_zero_leaves_the_default_layout(tmp_path):
    fake = FakeStriping(lustre=True)
    _run(tmp_path, fake, stripe_count=0)
    assert fake.calls == []


def test_engine_stripe_failure_is_an_event_not_a_failed_checkpoint(tmp_path):
    fake = FakeStriping(lustre=True, fail=True)
    events = _run(tmp_path, fake, steps=range(1, 3))
    failed = [f for k, f in events if k == "checkpoint_stripe_failed"]
    assert [f["path"] for f in failed] == [layout.step_dir(str(tmp_path / "l2"), s) for s in (2, 6)]
    assert "no space on MDT" in failed[0]["error"] and failed[0]["tier"] == "L2"
    assert mf.complete_steps(str(tmp_path / "l2")) == [2, 6]
    assert not [k for k, _ in events if k == "checkpoint_failed"]
