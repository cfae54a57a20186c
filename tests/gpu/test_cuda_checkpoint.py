"""The checkpoint engine with the state on a CUDA device (needs CUDA; skips without it).

What only a GPU can show: ``save`` copies device tensors into pinned host buffers with
``non_blocking`` copies and must not return before they have landed, so a training step
that changes the device tensors right after ``save`` cannot leak into the snapshot; and a
restore from the host-memory tier (L0) or from node-local disk (L1) gives back the same
bits, read straight into the rank's own device tensors where it asks (``into=``).
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()
pytestmark = [pytest.mark.timeout(180), pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")]


def _state() -> dict:
    g = torch.Generator(device="cuda").manual_seed(7)
    return {
        "model": {"w": torch.randn(1 << 22, generator=g, device="cuda"),  # 16 MiB: the copy takes a while
                  "b": torch.randn(4096, generator=g, device="cuda").to(torch.bfloat16)},
        "optim": {"step": torch.tensor(12, device="cuda"), "m": torch.randn(1 << 20, generator=g, device="cuda")},
        "meta": {"epoch": 3},
    }


def _engine(tmp_path, events):
    from slurm_resilience.checkpoint.engine import CheckpointEngine
    from slurm_resilience.checkpoint.tiers import TierSpec

    specs = (TierSpec(name="L0", storage="memory", interval_steps=1),
             TierSpec(name="L1", storage="local", interval_steps=1, path=str(tmp_path / "l1"), keep=2))
    return CheckpointEngine(specs, job_id="gpu", run_id="1" * 32, job_dir=str(tmp_path), node="g0",
                            emit=lambda kind, **f: events.append((kind, f)))


def _host(state) -> dict:
    from slurm_resilience.checkpoint.hdf5_format import flatten_state

    return {k: v.detach().cpu().clone() for k, v in flatten_state(state)[0].items()}


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].cpu().reshape(-1).view(torch.uint8), b[k].cpu().reshape(-1).view(torch.uint8)) for k in a)


def test_a_device_change_right_after_save_does_not_reach_the_snapshot(tmp_path):
    from slurm_resilience.checkpoint.hdf5_format import flatten_state

    events: list = []
    eng = _engine(tmp_path, events)
    try:
        state = _state()
        want = _host(state)
        stall = eng.save(1, state)
        assert eng._pinned, "with CUDA the host buffers are pinned (non-blocking copies)"
        assert all(t.is_pinned() for t in eng._l0.tensors.values())
        state["model"]["w"].mul_(-3.0)  # the next step, queued on the device straight after save
        state["optim"]["m"].zero_()
        torch.cuda.synchronize()
        assert stall > 0
        assert eng.wait(timeout=120)
        best = eng.best()
        assert best is not None and best[:2] == (1, "L0")
        assert _same_bits(_host(eng.load(best)), want)  # L0: host memory
        l1 = next(c for c in eng.candidates() if c[1] == "L1")
        into = {k: torch.empty_like(v) for k, v in flatten_state(state)[0].items()}  # device tensors
        got = eng.load(l1, into=into)
        assert _same_bits(_host(got), want)
        assert _same_bits({k: v for k, v in into.items()}, want), "read straight into the device tensors"
        assert got["meta"] == {"epoch": 3}
        assert _same_bits(_host(eng.load(l1)), want)  # into new tensors, as a fresh process
        assert any(k == "checkpoint_durable" and f.get("tier") == "L1" for k, f in events)
    finally:
        eng.close()


def test_every_step_of_a_training_loop_on_the_device_restores_bit_identical(tmp_path):
    """Save every step of a tiny model trained on the GPU; each step's L1 copy equals that
    step's state, and a model loaded from the last one takes the same next step."""
    events: list = []
    eng = _engine(tmp_path, events)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        x, y = torch.randn(32, 64, device="cuda"), torch.randn(32, 8, device="cuda")

        def step():
            opt.zero_grad(set_to_none=True)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()

        snaps = {}
        for s in range(1, 4):
            step()
            state = {"model": model.state_dict(), "optim": opt.state_dict()}
            snaps[s] = _host(state)
            eng.save(s, state)
        assert eng.wait(timeout=120)
        l1 = {c[0]: c for c in eng.candidates() if c[1] == "L1"}
        assert set(l1) == {2, 3}, "keep=2"
        for s in (2, 3):
            assert _same_bits(_host(eng.load(l1[s])), snaps[s])
        step()  # step 4 from the live state
        after = _host(model.state_dict())
        restored = eng.load(l1[3])
        model.load_state_dict({k: v.cuda() for k, v in restored["model"].items()})
        opt.load_state_dict(restored["optim"])
        step()  # step 4 again, from the restored state
        assert _same_bits(_host(model.state_dict()), after)
    finally:
        eng.close()
