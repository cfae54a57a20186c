"""slurm_resilience.integrations.lightning: the pure plan, resume position and snapshots."""

import pytest
import torch

pytest.importorskip("pytorch_lightning")

from slurm_resilience.errors import ConfigError  # noqa: E402
from slurm_resilience.integrations.lightning import (  # noqa: E402
    LightningEnv, NodeSnapshots, RestorePlan, Resilience, _SkipOnce, plan_restore, resume_position)


def test_plan_takes_the_newest_step_from_the_lowest_rank_holding_it():
    assert plan_restore([-1, -1, -1]) == RestorePlan(-1, None)
    assert plan_restore([12, 12, -1, -1]) == RestorePlan(12, 0)  # spare ranks 2-3 hold nothing
    assert plan_restore([-1, -1, 11, 12]) == RestorePlan(12, 3)
    with pytest.raises(ValueError):
        plan_restore([])


def test_plan_reads_the_job_directory_only_when_its_copy_is_newer_than_every_node():
    # a requeued job on other nodes: no node holds a snapshot, the preempted step is durable
    assert plan_restore([-1, -1, -1, -1], durable=10) == RestorePlan(10, 0, durable=True)
    assert plan_restore([10, 10, -1, -1], durable=10) == RestorePlan(10, 0)  # a tie: the node's disk
    assert plan_restore([-1, -1, 12, 12], durable=10) == RestorePlan(12, 2)


def test_resume_position_mid_epoch_and_at_the_epoch_end():
    assert resume_position(1, 3, 8) == (1, 3)
    assert resume_position(0, 8, 8) == (1, 0)  # the last batch's snapshot: next epoch's start
    assert resume_position(2, 0, 8) == (2, 0)


def test_snapshots_are_atomic_newest_kept(tmp_path):
    snaps = NodeSnapshots(tmp_path / "n1", keep=2)
    assert snaps.newest() == -1
    for step in (1, 2, 3):
        snaps.write(step, {"w": torch.full((2,), float(step))})
    assert snaps.steps() == [2, 3] and snaps.newest() == 3
    (tmp_path / "n1" / ".step-000000004.pt.tmp-1").write_bytes(b"torn")  # a write cut short
    assert snaps.newest() == 3
    assert snaps.read_bytes(3)


def test_skip_once_skips_only_the_first_iteration():
    sampler = _SkipOnce(list(range(6)), 4)
    assert list(sampler) == [4, 5]
    assert list(sampler) == list(range(6))
    assert len(sampler) == 6


def test_environment_is_read_once_and_keys_the_directory():
    env = LightningEnv.from_env({"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n3", "SR_PROGRESS_FILE": "/p"})
    assert env.default_dir().parts[-2:] == ("42", "n3") and env.progress_file == "/p"
    assert LightningEnv.from_env({}).default_dir() is None  # no job, no directory: no stale snapshots
    assert LightningEnv.from_env({"SR_LIGHTNING_DIR": "/r", "SLURMD_NODENAME": "n1"}).default_dir().as_posix() == "/r/n1"
    assert LightningEnv.from_env({"SR_RUN_JOB_DIR": "/j"}).run_job_dir == "/j"  # set by `run` (relaunch_preempt.py)
    assert LightningEnv.from_env({}).run_job_dir is None  # not under `run`: no preemption check, no collective


@pytest.mark.parametrize("bad", [{"every": 0}, {"keep": 0}, {"every": True}, {"every": 1.5}])
def test_bad_arguments_are_one_line_errors(bad):
    with pytest.raises(ConfigError, match=r"^Resilience\(\w+=.*must be an integer >= 1$"):
        Resilience(**bad)


def test_strategies_whose_ranks_hold_shards_are_one_line_errors():
    from pytorch_lightning.strategies import (DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy,
                                              SingleDeviceStrategy)

    from slurm_resilience.integrations.lightning import check_strategy

    check_strategy(DDPStrategy())
    check_strategy(SingleDeviceStrategy(torch.device("cpu")))
    for strategy in (FSDPStrategy(), ModelParallelStrategy(), DeepSpeedStrategy.__new__(DeepSpeedStrategy)):
        with pytest.raises(ConfigError, match=rf"^Resilience\(\): strategy {type(strategy).__name__} is not supported"):
            check_strategy(strategy)


def test_rng_capture_apply_round_trip_and_own_entry():
    import random

    import numpy

    from slurm_resilience.integrations import rng

    state = rng.capture()
    first = (torch.rand(3), random.random(), numpy.random.rand())
    rng.apply(state)
    again = (torch.rand(3), random.random(), numpy.random.rand())
    assert torch.equal(first[0], again[0]) and first[1:] == again[1:]
    assert rng.own(["a", "b", "c"], rank=2, world_size=3) == "c"
    assert rng.own(["a", "b"], rank=1, world_size=3) is None  # taken at another world size: left alone
    assert rng.own(None, rank=0, world_size=1) is None


@pytest.mark.parametrize("local_rank", [0, 1])
def test_a_preemption_on_a_snapshot_step_gathers_the_state_once_on_every_rank(tmp_path, monkeypatch, local_rank):
    """``_state`` is a collective. On a step that took a snapshot, every rank must skip the
    second gather, not only those holding the state (local rank 0): else ranks 0 and 1 sit in
    different collectives and the preempted step never exits (it was cancelled after the
    supervisor's persist wait, 45 s)."""
    from types import SimpleNamespace

    from slurm_resilience.integrations import lightning as lit
    from slurm_resilience.integrations.snapshots import Persisted

    monkeypatch.setenv("SR_LIGHTNING_DIR", str(tmp_path / "snaps"))
    monkeypatch.setenv("SLURMD_NODENAME", "n1")
    monkeypatch.setenv("SR_RUN_JOB_DIR", str(tmp_path / "job"))
    cb = Resilience()
    cb.durable = SimpleNamespace(write=lambda step, state: None, directory=str(tmp_path))
    gathers = []
    monkeypatch.setattr(cb, "_state", lambda trainer: gathers.append(trainer.global_step) or
                        ({"w": 1} if trainer.local_rank == 0 else None))
    monkeypatch.setattr(lit, "preempt_requested", lambda *a, **k: True)
    trainer = SimpleNamespace(global_step=4, local_rank=local_rank, global_rank=local_rank, world_size=2,
                              strategy=SimpleNamespace(root_device="cpu", barrier=lambda name: None))
    with pytest.raises(Persisted):
        cb.on_train_batch_end(trainer, None, None, None, 0)
    assert gathers == [4]  # one gather, the snapshot's, on local rank 0 and the others alike
