"""Pure parts of 'bring your own loop': the unsupervised fallback environment, the
replay / high-water decision, the logger rank, failed-collective classification and
the per-generation callbacks."""

import os
import stat

import pytest
import torch.distributed as dist

from slurm_resilience.errors import ConfigError, ResilienceError
from slurm_resilience.supervisor.decide.ranktable import Replacement, initial_table, regenerate, shrink
from slurm_resilience.worker import replay
from slurm_resilience.worker.rebind import GenerationHooks
from slurm_resilience.worker.unsupervised import FallbackEnv, fallback_environ, supervised
from slurm_resilience.worker.userfault import is_distributed_error, plan_wait_s

TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500",
            "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
ADDR = {f"n{i}": f"10.0.0.{i}" for i in range(9)}


# -- fallback environment ------------------------------------------------------
def test_no_variables_is_a_single_process():
    assert fallback_environ({}) == FallbackEnv(0, 1, 0, 1, "single process")
    assert fallback_environ({"PATH": "/bin"}).world_size == 1


def test_torchrun_variables():
    assert fallback_environ(TORCHRUN) == FallbackEnv(1, 2, 1, 2, "torchrun")
    no_local = {k: v for k, v in TORCHRUN.items() if not k.startswith("LOCAL")}
    assert fallback_environ(no_local) == FallbackEnv(1, 2, 0, 1, "torchrun")


@pytest.mark.parametrize("change, words", [
    ({"MASTER_PORT": None}, "MASTER_PORT not set"),
    ({"WORLD_SIZE": None, "MASTER_ADDR": None}, "WORLD_SIZE, MASTER_ADDR not set"),
    ({"RANK": "2"}, "RANK=2 must be in [0, WORLD_SIZE=2)"),
    ({"RANK": "-1"}, "RANK=-1"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0"),
    ({"RANK": "one"}, "RANK='one' is not an integer"),
    ({"MASTER_PORT": "70000"}, "MASTER_PORT=70000 is not a TCP port"),
    ({"LOCAL_RANK": "2"}, "LOCAL_RANK=2 must be in [0, LOCAL_WORLD_SIZE=2)"),
])
def test_bad_torchrun_environment_is_one_line(change, words):
    env = {**TORCHRUN}
    for k, v in change.items():
        if v is None:
            env.pop(k)
        else:
            env[k] = v
    with pytest.raises(ConfigError) as err:
        fallback_environ(env)
    assert words in str(err.value) and "\n" not in str(err.value)


def test_supervised_means_any_worker_variable():
    assert not supervised(TORCHRUN)
    assert supervised({"SR_WORKER_ID": "w1"})  # partial: WorkerEnv then names what is missing


# -- replay and the high-water step -------------------------------------------
def test_high_water_is_the_max_of_what_anyone_knows():
    assert replay.high_water() == 0
    assert replay.high_water(3, 0, 7) == 7
    assert replay.high_water(-1) == 0


@pytest.mark.parametrize("index, high, redone", [(0, 0, False), (4, 5, True), (5, 5, False), (6, 5, False)])
def test_replay_is_a_step_index_below_the_high_water(index, high, redone):
    assert replay.is_replay(index, high) is redone


def test_the_high_water_survives_the_loss_of_any_one_rank():
    # three ranks had reached step 9 (high water 9); one is lost and replaced by a fresh
    # process (0); the state rolls back to a checkpoint at 6: the max over the survivors says 9
    for lost in range(3):
        known = [0 if r == lost else 9 for r in range(3)]
        hw = max(replay.high_water(k, 6) for k in known)
        assert hw == 9 and [replay.is_replay(i, hw) for i in (6, 8, 9)] == [True, True, False]
    # every rank relaunched: the mark file written by the logger still knows it
    assert replay.high_water(0, 6, 9) == 9


def test_mark_file_round_trip(tmp_path):
    assert replay.read_mark(str(tmp_path)) == 0 and replay.read_mark("") == 0
    replay.write_mark(str(tmp_path), 12)
    assert replay.read_mark(str(tmp_path)) == 12
    assert stat.S_IMODE(os.stat(tmp_path / replay.MARK).st_mode) == 0o600
    (tmp_path / replay.MARK).write_text("garbage")
    assert replay.read_mark(str(tmp_path)) == 0


def test_logger_is_rank_zero_and_rank_zero_stays_the_same_process():
    t = initial_table([f"n{i}" for i in range(4)], [f"w{i}" for i in range(4)], ADDR)
    assert replay.logger_rank(t.world_size) == 0
    # a node lost (rank 2) and replaced, then a scale-in of rank 1: w0 logs throughout
    t1 = regenerate(t, [Replacement(rank=2, old_node="n2", new_node="n5", new_worker_id="x")], ADDR)
    t2 = shrink(t1, [1])
    for table in (t, t1, t2):
        assert table.slots[replay.logger_rank(table.world_size)].worker_id == "w0"
    # only when rank 0 itself is lost does another process log
    t3 = regenerate(t, [Replacement(rank=0, old_node="n0", new_node="n6", new_worker_id="z")], ADDR)
    assert t3.slots[replay.logger_rank(t3.world_size)].worker_id == "z"
    with pytest.raises(ValueError):
        replay.logger_rank(0)


# -- failed collectives --------------------------------------------------------
@pytest.mark.parametrize("exc", [
    RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:1"),
    RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation"),
    RuntimeError("Connection reset by peer"),
    RuntimeError("NCCL error in: ProcessGroupNCCL.cpp:1, remote process exited"),
    dist.DistNetworkError("store gone"),
])
def test_failed_collectives_are_distributed_errors(exc):
    assert is_distributed_error(exc)


def test_a_wrapped_failed_collective_is_found_through_its_cause():
    try:
        try:
            raise RuntimeError("Connection closed by peer")
        except RuntimeError as inner:
            raise KeyError("wrapped") from inner
    except KeyError as outer:
        assert is_distributed_error(outer)


@pytest.mark.parametrize("exc", [ValueError("bad shape"), RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
                                 ZeroDivisionError(), KeyError("process group")])
def test_user_errors_are_not_distributed_errors(exc):
    assert not is_distributed_error(exc)


def test_plan_wait_bound():
    assert plan_wait_s(2.0, 30.0) == 32.0


# -- per-generation callbacks --------------------------------------------------
def test_generation_hooks_run_once_per_generation_in_order():
    calls = []
    hooks = GenerationHooks()
    hooks.add(lambda: calls.append("a"))
    hooks.add(lambda: calls.append("b"))
    assert calls == []  # nothing before the first state sync
    hooks.run(0)
    hooks.run(0)
    assert calls == ["a", "b"]
    hooks.add(lambda: calls.append("late"))  # added after the sync: runs at once
    assert calls == ["a", "b", "late"]
    hooks.run(1)
    assert calls == ["a", "b", "late", "a", "b", "late"]
    with pytest.raises(ResilienceError):
        hooks.add("not callable")


def test_session_ddp_bad_input_is_one_line():
    import torch

    from slurm_resilience.worker.rebind import RebuiltDDP

    hooks = GenerationHooks()
    with pytest.raises(ResilienceError, match="find_unused_parameters=True is not supported"):
        RebuiltDDP(torch.nn.Linear(2, 2), hooks, lambda x: None, find_unused_parameters=True)
    with pytest.raises(ResilienceError, match="needs a torch.nn.Module, got dict"):
        RebuiltDDP({}, hooks, lambda x: None)
    wrapped = RebuiltDDP(torch.nn.Linear(2, 2), hooks, lambda x: None)
    with pytest.raises(ResilienceError, match="usable inside the steps loop"):
        wrapped(torch.ones(2))


def test_unsupervised_single_process_session_runs_a_ddp_loop(monkeypatch, capsys):
    """python train.py: a world of one on a local store, DDP built once, replay False."""
    import torch

    from slurm_resilience import Session

    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "SR_WORKER_ID"):
        monkeypatch.delenv(var, raising=False)
    model = torch.nn.Linear(3, 1)
    with Session(environ={}) as session:
        session.register(model=model)
        ddp = session.ddp(model)
        built = []
        session.on_generation(lambda: built.append(session.generation))
        for step in session.steps(3):
            with step:
                ddp(torch.ones(2, 3)).sum().backward()
                assert not step.replay and session.is_logger
        assert session.step == 3 and ddp.builds == 1 and built == [0]
    assert "running unsupervised (single process, 1 rank(s))" in capsys.readouterr().err
    assert not torch.distributed.is_initialized()


def test_an_aborted_step_gives_back_what_it_drew_from_the_rngs():
    """A survivor redoes an aborted step from its live state: dropout in the aborted
    forward pass must not shift the RNG the redone step draws from."""
    import random

    import numpy as np
    import torch

    from slurm_resilience.worker.statesync import TrainingState

    st = TrainingState()
    st.mark()
    want = torch.rand(3), random.random(), np.random.rand()
    st.rewind()  # the step was aborted after drawing
    assert torch.equal(torch.rand(3), want[0]) and random.random() == want[1] and np.random.rand() == want[2]


def test_default_group_wraps_the_generation_backend_and_library_code_works():
    """A world of one: the default group is the prebuilt backend (no second rendezvous);
    DeviceMesh, DTensor and dist.new_group work on it; release destroys and parks it."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch
    from torch.distributed.device_mesh import init_device_mesh

    from slurm_resilience.worker import default_group
    from slurm_resilience.worker.parking import ParkingLot

    store = dist.HashStore()
    pg = dist.ProcessGroupGloo(dist.PrefixStore("gen0/", store), 0, 1, timedelta(seconds=5))
    lot = ParkingLot(60)
    default_group.install(SimpleNamespace(backend="gloo", generation=0, pg=pg, rank=0, world_size=1), store, 5, lot)
    try:
        assert dist.get_backend() == "sr_gloo" and dist.get_world_size() == 1
        mesh = init_device_mesh("cpu", (1,))
        from torch.distributed.tensor import Shard, distribute_tensor

        assert distribute_tensor(torch.arange(4.0), mesh, [Shard(0)]).full_tensor().tolist() == [0, 1, 2, 3]
        x = torch.ones(1)
        dist.all_reduce(x, group=dist.new_group([0]))  # an ordinary group of its own
        assert x.item() == 1.0
    finally:
        default_group.release(lot)
    assert not dist.is_initialized() and len(lot) == 1
    lot.close()
