"""ResilientExecutor: parameters → config and submit() arguments; the job wrapper's
done/result without accounting. submitit and Slurm are replaced by fakes."""

from pathlib import Path
from types import SimpleNamespace

import pytest

import slurm_resilience
from slurm_resilience.errors import ConfigError, ResilienceError
from slurm_resilience.launch import submitter as executor_mod
from slurm_resilience.launch import submitit_launch
from slurm_resilience.slurm import commands
from slurm_resilience.run_identity import check_run_id


class FakeSubmititJob:
    def __init__(self, folder: Path, job_id: str = "77") -> None:
        self.job_id = job_id
        self.paths = SimpleNamespace(result_pickle=folder / f"{job_id}_result.pkl",
                                     stderr=folder / f"{job_id}_log.err", folder=folder)
        self.cancelled = False
        self.exit_code = 0  # what the supervisor returned (tests set other values)

    def result(self):
        return self.exit_code

    def cancel(self, check=True):
        self.cancelled = True


@pytest.fixture
def submitted(monkeypatch, tmp_path):
    calls = []

    def fake_submit(command, **kwargs):
        calls.append((command, kwargs))
        return FakeSubmititJob(tmp_path)

    monkeypatch.setattr(submitit_launch, "submit", fake_submit)
    return calls


def test_exported_lazily():
    assert slurm_resilience.ResilientExecutor is executor_mod.ResilientExecutor
    assert "ResilientExecutor" in slurm_resilience.__all__


def test_parameters_reach_submit(submitted, tmp_path):
    ex = slurm_resilience.ResilientExecutor(folder=tmp_path / "jobs")
    ex.update_parameters(nodes=3, spares=1, tasks_per_node=1, timeout_min=10, slurm_partition="debug",
                         recovery={"recovery": {"scale_in": False}, "checkpoint": {"local_every": 5}})
    ex.update_parameters(recovery={"recovery": {"max_requeues": 0}}, name="train", slurm_signal_delay_s=20)
    job = ex.submit(["python", "train.py"])
    (command, kw), = submitted
    assert command == ["python", "train.py"]
    assert kw["nodes"] == 3 and kw["spares"] == 1 and kw["timeout_min"] == 10
    assert kw["job_dir"] == str(tmp_path / "jobs" / "%j")
    cfg = kw["config"]
    assert cfg.job.partition == "debug" and cfg.checkpoint.local_every == 5
    assert cfg.recovery.scale_in is False and cfg.recovery.max_requeues == 0  # later calls add up
    assert kw["executor_params"] == {"slurm_job_name": "train", "slurm_signal_delay_s": 20}
    assert job.job_id == "77" and job.folder == tmp_path / "jobs" / "77"
    assert job.paths.folder == tmp_path


def test_base_config_file_is_overridden(submitted, tmp_path):
    base = tmp_path / "base.yaml"
    base.write_text("job:\n  nodes: 8\n  spares: 2\nrecovery:\n  scale_in: false\n")
    ex = slurm_resilience.ResilientExecutor(folder=tmp_path, config=str(base))
    ex.update_parameters(spares=0)
    ex.submit(["x"])
    kw = submitted[0][1]
    assert (kw["nodes"], kw["spares"], kw["config"].recovery.scale_in) == (8, 0, False)


@pytest.mark.parametrize("params,match", [
    ({"gpus_per_nod": 1}, "unknown parameter 'gpus_per_nod'"),
    ({"slurm_additional_parameters": {"no_kill": False}}, "--no-kill is the toolkit's own"),
    ({"slurm_additional_parameters": {"nodes": 9}}, "job.nodes and job.spares"),
    ({"slurm_additional_parameters": {"requeue": False}}, "recovery.max_requeues"),
    ({"slurm_time": 10}, "slurm_time is the toolkit's own: set it with timeout_min"),
    ({"slurm_gres": "gpu:8\ntouch x"}, "line break"),
    ({"slurm_srun_args": "--cpu-bind=none"}, "list of srun arguments"),
    ({"slurm_srun_args": ["--ntasks=3"]}, "--ntasks is the toolkit's own"),
    ({"tasks_per_node": 0}, "job.tasks_per_node=0 must be >= 1"),
    ({"tasks_per_node": "2"}, "tasks_per_node"),
    ({"nodes": 0}, "job.nodes"),
    ({"recovery": {"scale_in": False}}, "sections"),
    ({"recovery": {"bogus": {}}}, "unknown section 'bogus'"),
    ({"recovery": {"recovery": {"bogus_key": 1}}}, "bogus_key"),
    ({"timeout_min": 0}, "timeout_min"),
])
def test_bad_parameters_fail_at_update_and_change_nothing(tmp_path, params, match):
    ex = slurm_resilience.ResilientExecutor(folder=tmp_path)
    ex.update_parameters(nodes=2)
    with pytest.raises(ConfigError, match=match):
        ex.update_parameters(**params)
    assert ex.config.job.nodes == 2


@pytest.mark.parametrize("command", [[], "python train.py"])
def test_command_must_be_an_argv_list(submitted, tmp_path, command):
    with pytest.raises(ConfigError, match="argv list"):
        slurm_resilience.ResilientExecutor(folder=tmp_path).submit(command)
    assert submitted == []


def test_result_is_the_supervisor_exit_code(submitted, tmp_path, monkeypatch):
    job = slurm_resilience.ResilientExecutor(folder=tmp_path).submit(["x"])
    job._job.exit_code = 75  # not 0: a result that ignored the supervisor's code would fail here
    states = iter(["PENDING", "RUNNING"])

    def job_state(job_id):
        try:
            return next(states)
        except StopIteration:
            job.paths.result_pickle.write_bytes(b"")  # the batch step wrote its result
            return None

    monkeypatch.setattr(commands, "job_state", job_state)
    assert not job.done() and not job.done()
    assert job.result(poll_s=0) == 75 and job.done()


def test_job_gone_without_result_is_an_error(submitted, tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "job_state", lambda job_id: None)
    job = slurm_resilience.ResilientExecutor(folder=tmp_path).submit(["x"])
    assert job.done()
    with pytest.raises(ResilienceError, match="ended without a result"):
        job.result()


def test_result_timeout_and_cancel(submitted, tmp_path, monkeypatch):
    monkeypatch.setattr(commands, "job_state", lambda job_id: "RUNNING")
    job = slurm_resilience.ResilientExecutor(folder=tmp_path).submit(["x"])
    with pytest.raises(TimeoutError):
        job.result(timeout_s=0.01, poll_s=0.001)
    job.cancel()
    assert job._job.cancelled


def test_submit_makes_only_the_levels_above_the_job_id(tmp_path, monkeypatch):
    """``job_dir=folder/%j``: the folder exists (0700) before submission, ``%j`` never does."""
    seen = {}

    class FakeExecutor:
        def __init__(self, folder, cluster):
            seen["folder"] = folder

        def update_parameters(self, **params):
            seen["params"] = params

        def submit(self, fn, config, command, job_dir, run_id):
            seen["job_dir"], seen["run_id"] = job_dir, run_id
            return "job"

    import submitit

    monkeypatch.setattr(submitit, "AutoExecutor", FakeExecutor)
    assert submitit_launch.submit(["x"], nodes=2, spares=1, job_dir=str(tmp_path / "jobs" / "%j")) == "job"
    assert (tmp_path / "jobs").is_dir() and not (tmp_path / "jobs" / "%j").exists()
    assert oct((tmp_path / "jobs").stat().st_mode & 0o777) == "0o700"
    assert seen["folder"] == str(tmp_path / "jobs" / "%j" / "submitit")
    assert seen["job_dir"] == str(tmp_path / "jobs" / "%j")
    assert check_run_id(seen["run_id"])  # drawn at submission: the pickle a requeue runs again holds it
    assert seen["params"]["slurm_additional_parameters"] == {"no_kill": True, "nodes": 4, "ntasks_per_node": 1,
                                                           "requeue": True, "signal": "USR2@60"}


def test_tasks_per_node_as_in_submitit(submitted, tmp_path):
    """``tasks_per_node=G``: G ranks per worker node (and G standbys per spare), as in submitit."""
    ex = slurm_resilience.ResilientExecutor(folder=tmp_path)
    ex.update_parameters(nodes=3, spares=1, tasks_per_node=4)
    assert ex.config.job.tasks_per_node == 4
    ex.submit(["python", "train.py"])
    kw = submitted[0][1]
    assert kw["tasks_per_node"] == 4 and kw["config"].job.tasks_per_node == 4
    ex.update_parameters(nodes=2)  # later calls keep it
    assert ex.config.job.tasks_per_node == 4


def _fake_submitit(monkeypatch, seen):
    import submitit

    class FakeExecutor:
        def __init__(self, folder, cluster):
            pass

        def update_parameters(self, **params):
            seen["params"] = params

        def submit(self, fn, config, command, job_dir, run_id):
            seen["config"] = config
            return "job"

    monkeypatch.setattr(submitit, "AutoExecutor", FakeExecutor)


@pytest.mark.parametrize("base,arg,want", [(1, 4, 4), (8, None, 8), (8, 2, 2)])
def test_submitit_sees_one_task_the_allocation_gets_g_per_node(tmp_path, monkeypatch, base, arg, want):
    """submitit's own ``tasks_per_node`` stays 1 (one result: the supervisor's); every node
    of the allocation gets ``--ntasks-per-node=G``; the batch step's config carries G."""
    from slurm_resilience.config import load_config

    seen = {}
    _fake_submitit(monkeypatch, seen)
    cfg = load_config({"job": {"tasks_per_node": base}})
    submitit_launch.submit(["x"], nodes=3, spares=1, tasks_per_node=arg, config=cfg, job_dir=str(tmp_path / "j"))
    assert seen["params"]["tasks_per_node"] == 1 and seen["params"]["nodes"] == 1
    extra = seen["params"]["slurm_additional_parameters"]
    assert extra["nodes"] == 5 and extra["ntasks_per_node"] == want
    assert seen["config"]["job"]["tasks_per_node"] == want


def test_submitit_renders_ntasks_per_node_once(tmp_path):
    """Through submitit's real sbatch writer: one --ntasks-per-node line, with G."""
    from submitit.slurm.slurm import _make_sbatch_string

    text = _make_sbatch_string(command="x", folder=str(tmp_path), ntasks_per_node=1, nodes=1,
                               additional_parameters={"nodes": 5, "ntasks_per_node": 2, "no_kill": True})
    lines = text.splitlines()
    assert [ln for ln in lines if "ntasks-per-node" in ln] == ["#SBATCH --ntasks-per-node=2"]
    assert "#SBATCH --nodes=5" in lines


def test_submitit_bad_tasks_per_node_submits_nothing(tmp_path, monkeypatch):
    seen = {}
    _fake_submitit(monkeypatch, seen)
    with pytest.raises(ConfigError, match="job.tasks_per_node=0"):
        submitit_launch.submit(["x"], nodes=2, tasks_per_node=0, job_dir=str(tmp_path / "j"))
    assert seen == {} and not (tmp_path / "j").exists()
