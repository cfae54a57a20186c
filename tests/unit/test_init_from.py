"""StateSync's import path (checkpoint.init_from) in one process: a one-rank
generation (its collectives are identities), a real DCP checkpoint on disk."""

import types

import pytest
import torch
from torch import nn

from slurm_resilience.checkpoint.dcp_io import write_dcp
from slurm_resilience.errors import ConfigError
from slurm_resilience.worker.statesync import StateSync, TrainingState


class OneRank:
    """A generation of one rank: every collective returns this rank's own data."""

    rank, world_size, generation, device = 0, 1, 1, torch.device("cpu")

    def all_gather_ints(self, value):
        return [int(value)]

    def all_gather_rows(self, values):
        return [[int(v) for v in values]]

    def broadcast(self, tensor, src):
        pass

    def all_reduce_sum(self, tensor):
        pass

    def interrupted(self):
        return False


class Engine:
    """No tier holds anything (or ``stored``: one L1 checkpoint)."""

    specs = ()

    def __init__(self, stored=None):
        self.stored, self.saved = stored, []

    def best(self):
        return self.stored

    def load(self, candidate, into=None):
        return self.stored_state

    def candidates(self):
        return [self.stored] if self.stored else []

    def rebuild_missing(self):
        return []

    def report_foreign(self):
        pass

    def save(self, step, state, tiers):
        self.saved.append((step, tiers))


class Store(dict):
    def set(self, k, v):
        self[k] = v.encode() if isinstance(v, str) else v

    def check(self, keys):
        return all(k in self for k in keys)

    def get(self, k):
        return self[k]


class Momentum:
    """A 1-D sharded object (examples/train_zero.py's convention)."""

    def __init__(self, n):
        self.buf = torch.zeros(n)

    def state_dict(self):
        return {"shards": {"momentum": self.buf.clone()}, "lr": 0.5}

    def load_state_dict(self, sd):
        self.buf = sd["shards"]["momentum"].clone()


def _sync(tmp_path, state, engine, init_from):
    events = []
    sync = StateSync(state, engine, Store(), emit=lambda kind, **f: events.append((kind, f)),
                     heartbeat=types.SimpleNamespace(update=lambda **k: None), job_dir=str(tmp_path),
                     init_from=init_from)
    sync.sync(OneRank(), types.SimpleNamespace(generation=1, joining=(0,)))
    return events[-1][1]


def _source(tmp_path):
    torch.manual_seed(4)
    model = nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(5, 3)).sum().backward()
    opt.step()
    mom = torch.randn(8)
    write_dcp({"model": model.state_dict(), "opt": opt.state_dict(), "mom": {"shards": {"momentum": mom}},
               "step": 30, "position": 480, "extras": {"epoch": 3}}, str(tmp_path / "dcp"))
    return model, opt, mom


def test_replicated_state_starts_from_the_dcp(tmp_path):
    model, opt, _ = _source(tmp_path)
    st = TrainingState()
    fresh = nn.Linear(3, 2)
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.1, momentum=0.9)
    st.register(model=fresh, opt=fresh_opt)
    rng = torch.get_rng_state()
    done = _sync(tmp_path, st, Engine(), str(tmp_path / "dcp"))
    assert (done["tier"], done["step"], done["position"]) == ("init_from", 30, 480)
    assert (st.step, st.position, st.extras) == (30, 480, {"epoch": 3})
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), model.state_dict().values()))
    bufs = [fresh_opt.state[p]["momentum_buffer"] for p in fresh.parameters()]
    assert all(torch.equal(a, opt.state[p]["momentum_buffer"]) for a, p in zip(bufs, model.parameters()))
    assert torch.equal(torch.get_rng_state(), rng)  # the job's own RNG states stay


def test_a_job_with_a_checkpoint_of_its_own_ignores_init_from(tmp_path):
    _source(tmp_path)
    st = TrainingState()
    fresh = nn.Linear(3, 2)
    st.register(model=fresh)
    engine = Engine(stored=(10, "L1", "x"))
    keep = TrainingState()
    keep.register(model=nn.Linear(3, 2))
    keep.step = 10
    engine.stored_state = keep.state_dict()
    done = _sync(tmp_path, st, engine, str(tmp_path / "dcp"))
    assert (done["tier"], st.step) == ("L1", 10)


def test_sharded_state_takes_its_slice_and_is_saved_at_the_imported_step(tmp_path):
    _, _, mom = _source(tmp_path)
    st = TrainingState()
    st.register_sharded(mom=Momentum(8))
    engine = Engine()
    done = _sync(tmp_path, st, engine, str(tmp_path / "dcp"))
    assert (done["tier"], st.step, st.shard_totals) == ("init_from", 30, {"mom": {"momentum": 8}})
    assert torch.equal(st.objects["mom"].buf, mom)
    assert engine.saved == [(30, [])]  # no disk tier in this fake; the step is saved like step 0


def test_missing_object_is_one_line(tmp_path):
    _source(tmp_path)
    st = TrainingState()
    st.register(model=nn.Linear(3, 2), sched=torch.optim.lr_scheduler.StepLR(
        torch.optim.SGD(nn.Linear(1, 1).parameters(), lr=1), 1))
    with pytest.raises(ConfigError, match=r"lacks sched \(it has extras, model, mom, opt, position, step\)"):
        _sync(tmp_path, st, Engine(), str(tmp_path / "dcp"))
