"""slurm_resilience.integrations.accelerate: the pure parts, then one process's snapshot
and restore through a real Accelerator (CPU): the position and the weights come back."""

import pytest
import torch

pytest.importorskip("accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import DataLoaderConfiguration  # noqa: E402

from slurm_resilience.errors import ConfigError  # noqa: E402
from slurm_resilience.integrations.accelerate import AccelerateEnv, Position, Resilience, pack, unpack  # noqa: E402


def test_position_moves_to_the_next_epoch_after_its_last_batch():
    pos = Position()
    for _ in range(3):
        pos.advance(4)
    assert pos.state_dict() == {"epoch": 0, "batch": 3, "step": 3}
    pos.advance(4)
    assert pos.state_dict() == {"epoch": 1, "batch": 0, "step": 4}
    other = Position()
    other.load_state_dict(pos.state_dict())
    assert other.state_dict() == pos.state_dict()


def test_pack_round_trip_and_no_entry_leaves_its_folder(tmp_path):
    (tmp_path / "a" / "sub").mkdir(parents=True)
    (tmp_path / "a" / "model.safetensors").write_bytes(b"m")
    (tmp_path / "a" / "sub" / "x.bin").write_bytes(b"x")
    files = pack(tmp_path / "a")
    assert files == {"model.safetensors": b"m", "sub/x.bin": b"x"}
    unpack(files, tmp_path / "b")
    assert pack(tmp_path / "b") == files
    with pytest.raises(ValueError, match="leaves its folder"):
        unpack({"../evil": b"x"}, tmp_path / "c")


def test_environment_names_its_own_folders():
    env = AccelerateEnv.from_env({"SLURM_JOB_ID": "42", "SLURMD_NODENAME": "n3", "SR_RUN_JOB_DIR": "/j"})
    assert env.default_dir().parts[-3:] == ("accelerate", "42", "n3")
    assert env.durable_dir().as_posix() == "/j/accelerate/42"
    assert AccelerateEnv.from_env({"SR_ACCELERATE_DIR": "/r", "SLURMD_NODENAME": "n1"}).default_dir().as_posix() == "/r/n1"
    assert AccelerateEnv.from_env({}).durable_dir() is None


@pytest.mark.parametrize("bad", [{"every": 0}, {"keep": -1}, {"every": "2"}])
def test_bad_arguments_are_one_line_errors(bad):
    with pytest.raises(ConfigError, match=r"^Resilience\(\w+=.*must be an integer >= 1$"):
        Resilience(Accelerator(cpu=True), **bad)


def test_not_an_accelerator_or_not_a_model_is_a_one_line_error():
    with pytest.raises(ConfigError, match=r"^Resilience\(accelerator=…\): needs an accelerate.Accelerator, got Linear$"):
        Resilience(torch.nn.Linear(1, 1))
    with pytest.raises(ConfigError, match=r"^Resilience\(accelerator, model\): the model must be the torch.nn.Module "
                                          r"that accelerator.prepare returned, got SGD$"):
        Resilience(Accelerator(cpu=True), torch.optim.SGD(torch.nn.Linear(1, 1).parameters(), lr=0.1))


def _setup(directory):
    torch.manual_seed(0)
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(use_seedable_sampler=True))
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=torch.Generator().manual_seed(1)),
                                          torch.randn(24, 2, generator=torch.Generator().manual_seed(2)))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model, opt, loader = acc.prepare(model, opt, loader)
    return acc, model, opt, loader, Resilience(acc, model, directory=directory)


def _train(acc, model, opt, loader, res, epochs, stop_at=None):
    seen = []
    for _ in res.epochs(epochs):
        for x, y in res.batches(loader):
            seen.append(x.sum().item())
            acc.backward(torch.nn.functional.mse_loss(model(x), y))
            opt.step()
            opt.zero_grad()
            res.step_done()
            if res.position.step == stop_at:
                return seen
    return seen


def test_an_interrupted_run_resumes_at_the_next_batch_with_the_same_result(tmp_path):
    whole = _setup(tmp_path / "whole")
    assert whole[4].restore() == 0  # nothing there: a fresh start
    batches = _train(*whole, epochs=2)
    first = _setup(tmp_path / "cut")
    head = _train(*first, epochs=2, stop_at=8)  # epoch 1, batch 2 of 6
    again = _setup(tmp_path / "cut")
    assert again[4].restore() == 8 and again[4].position.state_dict() == {"epoch": 1, "batch": 2, "step": 8}
    tail = _train(*again, epochs=2)
    assert head + tail == batches  # every batch once, in the same order
    assert torch.equal(whole[1].weight, again[1].weight) and torch.equal(whole[1].bias, again[1].bias)


def test_the_migration_guide_shows_the_current_accelerate_diff():
    import difflib
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    plain = (root / "examples" / "accelerate_train_plain.py").read_text().splitlines(keepends=True)
    converted = (root / "examples" / "accelerate_train.py").read_text().splitlines(keepends=True)
    diff = "".join(list(difflib.unified_diff(plain, converted))[2:])
    section = (root / "docs" / "migration.md").read_text().split("\n## Hugging Face Accelerate\n", 1)[1]
    assert section.split("```diff\n", 1)[1].split("```", 1)[0] == diff, "regenerate the Accelerate diff block"


def test_gradient_accumulation_snapshots_only_whole_windows(tmp_path):
    """accelerator.accumulate(model), 2 batches a window: stopped after a window's first batch,
    the restore is the window's start and the window is trained again: same weights."""

    def setup(directory):
        acc, model, opt, loader, res = _setup(directory)
        acc.gradient_accumulation_steps = 2
        return acc, model, opt, loader, res

    def train(acc, model, opt, loader, res, epochs, stop_at=None):
        for _ in res.epochs(epochs):
            for x, y in res.batches(loader):
                with acc.accumulate(model):
                    acc.backward(torch.nn.functional.mse_loss(model(x), y))
                    opt.step()
                    opt.zero_grad()
                res.step_done()
                if res.position.step == stop_at:
                    return

    whole = setup(tmp_path / "whole")
    train(*whole, epochs=2)
    first = setup(tmp_path / "cut")
    train(*first, epochs=2, stop_at=9)  # epoch 1, batch 3 of 6: the window of batches 2-3 half done
    again = setup(tmp_path / "cut")
    assert again[4].restore() == 8  # the window's start, not the half window
    train(*again, epochs=2)
    assert torch.equal(whole[1].weight, again[1].weight) and torch.equal(whole[1].bias, again[1].bias)
