"""Site options (docs/site-options.md): the user's #SBATCH and srun options and setup
lines — golden scripts per option kind, hetjob components, owned options refused,
bad values in one line, setup lines run by bash, the steps' argv, the submitit path."""

import os
from pathlib import Path

import pytest

from sbatch_shell import run_script, stub_python
from slurm_resilience.config import config_to_dict, load_config
from slurm_resilience.errors import ConfigError
from slurm_resilience.launch.restart import render_restart
from slurm_resilience.launch.sbatch import render
from slurm_resilience.slurm import options as opts
from slurm_resilience.slurm.steps import srun_argv
from slurm_resilience.supervisor.executors.relaunch import step_argv

GOLDEN = Path(__file__).parent / "golden"

# one of each option kind: string, number, flag, list, constraint expression, reservation
SITE = {"account": "proj42", "qos": "high", "gres": ["gpu:8", "nic:1"], "constraint": "a100&ib",
        "mem": "480G", "exclusive": True, "reservation": "maint_01", "comment": "run-7",
        "cpus-per-task": 12, "requeue_me": False}
SETUP = ["module load cuda/12.4 nccl", "source /opt/venvs/train/bin/activate",
         "export NCCL_DEBUG=WARN"]
GPU_JOB = {"nodes": 3, "spares": 1, "tasks_per_node": 8, "partition": "gpu", "time_limit": "12:00:00",
           "sbatch_options": SITE, "srun_options": {"gpu-bind": "closest", "cpu-bind": "cores"},
           "setup": SETUP}
HET_JOB = {**GPU_JOB, "supervisor_partition": "cpu",
           "supervisor_sbatch_options": {"mem": "8G", "cpus-per-task": 4}}


def _render(job, hetjob=False, restart=False):
    cfg = load_config({"job": job})
    kw = dict(command=["python", "train.py"], config_path="/home/u/run/config.yaml",
              job_dir="/home/u/sr-jobs/42", python="/usr/bin/python3")
    return render_restart(cfg, **kw) if restart else render(cfg, hetjob=hetjob, **kw)


@pytest.mark.parametrize("name,job,hetjob,restart", [
    ("resilient-site.sbatch", GPU_JOB, False, False),
    ("hetjob-site.sbatch", HET_JOB, True, False),
    ("restart-site.sbatch", GPU_JOB, False, True),
])
def test_site_golden(name, job, hetjob, restart):
    text = _render(job, hetjob, restart)
    if os.environ.get("SR_UPDATE_GOLDEN") == "1":
        (GOLDEN / name).write_text(text)
    assert text == (GOLDEN / name).read_text()


def test_every_option_kind_rendered():
    lines = _render(GPU_JOB).splitlines()
    for want in ("#SBATCH --account=proj42", "#SBATCH --qos=high", "#SBATCH --gres=gpu:8,nic:1",
                 "#SBATCH --constraint=a100&ib", "#SBATCH --mem=480G", "#SBATCH --exclusive",
                 "#SBATCH --reservation=maint_01", "#SBATCH --comment=run-7", "#SBATCH --cpus-per-task=12"):
        assert want in lines, want
    assert not any("requeue-me" in ln for ln in lines)  # false: left out
    # every #SBATCH line before the first command (sbatch stops reading at it), setup before exec
    first_cmd = next(i for i, ln in enumerate(lines) if ln and not ln.startswith("#"))
    assert all(not ln.startswith("#SBATCH") for ln in lines[first_cmd:])
    assert lines[first_cmd:first_cmd + 3] == SETUP and lines[-1].startswith("exec ")


def _components(text):
    sb = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    cut = sb.index("#SBATCH hetjob")
    return sb[:cut], sb[cut + 1:]


def test_hetjob_supervisor_component_is_small_and_cpu():
    sup, workers = _components(_render(HET_JOB, hetjob=True))
    assert "#SBATCH --partition=cpu" in sup and "#SBATCH --partition=gpu" in workers
    for job_wide in ("--account=proj42", "--qos=high", "--reservation=maint_01", "--comment=run-7"):
        assert f"#SBATCH {job_wide}" in sup and f"#SBATCH {job_wide}" in workers
    for per_node in ("--gres", "--constraint", "--exclusive", "--mem=480G", "--cpus-per-task=12"):
        assert not any(ln.startswith(f"#SBATCH {per_node}") for ln in sup), per_node
        assert any(ln.startswith(f"#SBATCH {per_node}") for ln in workers), per_node
    assert "#SBATCH --mem=8G" in sup and "#SBATCH --cpus-per-task=4" in sup


def test_hetjob_without_supervisor_partition_uses_the_partition():
    sup, _ = _components(_render({**GPU_JOB, "supervisor_sbatch_options": {"mem": "4G"}}, hetjob=True))
    assert "#SBATCH --partition=gpu" in sup and "#SBATCH --mem=4G" in sup


@pytest.mark.parametrize("key", ["supervisor_partition", "supervisor_sbatch_options"])
def test_supervisor_options_need_hetjob(key):
    with pytest.raises(ConfigError, match=f"job.{key} needs --hetjob"):
        _render({**GPU_JOB, key: "cpu" if key == "supervisor_partition" else {"mem": "1G"}})


@pytest.mark.parametrize("key,controls", [
    ("nodes", "job.nodes and job.spares"), ("--ntasks-per-node", "job.tasks_per_node"),
    ("no_kill", "always on"), ("requeue", "recovery.max_requeues"), ("signal", "job.preempt_signal"),
    ("output", "job.job_dir"), ("time", "job.time_limit"), ("partition", "job.partition"),
    ("het-group", "--hetjob"), ("job-name", "name"), ("open-mode", "append"),
])
def test_owned_sbatch_options_refused(key, controls):
    with pytest.raises(ConfigError, match="the toolkit's own") as e:
        load_config({"job": {"sbatch_options": {key: "1"}}})
    assert controls in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("key", ["nodelist", "ntasks", "jobid", "het-group", "overlap", "no-kill",
                                 "output", "gpus-per-task", "kill-on-bad-exit"])
def test_owned_srun_options_refused(key):
    with pytest.raises(ConfigError, match=f"job.srun_options: --{key} is the toolkit's own"):
        load_config({"job": {"srun_options": {key: "1"}}})


@pytest.mark.parametrize("options,match", [
    ({"account": "p\ntouch PWNED"}, "line break"),
    ({"comment": "two words"}, "outside Slurm's option syntax: ' '"),
    ({"account": "$(touch PWNED)"}, "outside Slurm's option syntax"),
    ({"qos": "a;b"}, "outside Slurm's option syntax"),
    ({"qos": "'q'"}, "outside Slurm's option syntax"),
    ({"qos": ""}, "outside Slurm's option syntax"),
    ({"gres": {"gpu": 8}}, "must be a string, a number, true, false or a list"),
    ({"gres": ["gpu:8", True]}, "a list holds strings or numbers"),
    ({"A": "proj"}, "use the long name"),
    ({"acc ount": "proj"}, "not a Slurm long option"),
    ({"account": "a", "--account": "b"}, "given twice"),
])
def test_bad_values_one_line(options, match):
    with pytest.raises(ConfigError, match=match) as e:
        load_config({"job": {"sbatch_options": options}})
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("job,match", [
    ({"sbatch_options": "account=proj"}, "job.sbatch_options must be a mapping"),
    ({"setup": 3}, "job.setup must be a list of strings"),
    ({"setup": "module load a"}, "job.setup must be a list of strings"),
    ({"setup": ["export A=1 \\"]}, "ends with a backslash"),
    ({"supervisor_partition": "cpu\nx"}, "job.supervisor_partition='cpu\\\\nx' is not a partition name"),
])
def test_bad_job_keys_one_line(job, match):
    with pytest.raises(ConfigError, match=match):
        load_config({"job": job})


def test_normalised_and_round_trips():
    cfg = load_config({"job": {"sbatch_options": {"--gpus_per_node": 8, "exclusive": True},
                               "setup": ["module load a", "module load b"]}})
    assert cfg.job.sbatch_options == {"gpus-per-node": "8", "exclusive": True}
    assert cfg.job.setup == ("module load a", "module load b")
    import yaml

    assert load_config(yaml.safe_load(yaml.safe_dump(config_to_dict(cfg)))) == cfg


def test_setup_lines_run_before_the_supervisor_and_its_env_is_inherited(tmp_path):
    python = stub_python(tmp_path)
    cfg = load_config({"job": {"setup": ["export SR_SITE_MARK=from-setup", "cd /"]}})
    text = render(cfg, command=["train.py"], config_path="c", job_dir="d", python=python)
    stub = Path(python)
    stub.write_text(stub.read_text() + "open(os.environ['SR_ARGV_OUT'] + '.env', 'w')"
                    ".write(os.environ.get('SR_SITE_MARK', '') + ' ' + os.getcwd())\n")
    run_script(text, tmp_path)
    assert (tmp_path / "argv.json.env").read_text() == "from-setup /"


def test_srun_argv_adds_the_site_options_after_the_toolkits():
    argv = srun_argv(job_id="7", name="w", nodes=["n2"], options=["--gpu-bind=closest", "--cpu-bind=cores"])
    assert argv[-2:] == ["--gpu-bind=closest", "--cpu-bind=cores"]
    assert argv[:3] == ["srun", "--no-kill", "--overlap"]
    mpi = srun_argv(job_id="7", name="w", nodes=["n2"], mpi=True, options=["--mpi=pmix_v4"])
    assert [a for a in mpi if a.startswith("--mpi")] == ["--mpi=pmix_v4"]  # the site's MPI plugin wins
    assert srun_argv(job_id="7", name="w", nodes=["n2"], mpi=True)[-1] == "--mpi=pmix"


def test_relaunch_step_gets_the_site_options():
    argv = step_argv(job_id="7", name="r", nodes=["n2", "n3"], command=["python", "t.py"], mpi=False,
                     master_addr="10.0.0.2", port=29500, attempt=0, tasks_per_node=8,
                     srun_options=opts.srun_args({"gpu-bind": "closest", "exclusive-gpus": True}))
    cut = argv.index("--")
    assert argv[cut - 2:cut] == ["--gpu-bind=closest", "--exclusive-gpus"]


def test_online_steps_get_the_site_options(monkeypatch, tmp_path):
    from slurm_resilience.slurm import commands, steps

    monkeypatch.setattr(commands, "show_nodes", lambda nodes: {n: {"NodeAddr": "127.0.0.1"} for n in nodes})
    seen = {}
    monkeypatch.setattr(steps.subprocess, "Popen", lambda argv, **kw: seen.setdefault("argv", argv))
    launcher = steps.SrunLauncher("40", ["n2"], srun_options=["--gpu-bind=closest"])
    launcher.launch(name="sr-w1", node="n2", argv=["python", "t.py"], env={}, log_path=str(tmp_path / "l"))
    assert seen["argv"] == [*srun_argv(job_id="40", name="sr-w1", nodes=["n2"], options=["--gpu-bind=closest"]),
                            "python", "t.py"]


def test_cli_flags_add_to_the_config(tmp_path, monkeypatch):
    from slurm_resilience import cli
    from slurm_resilience.slurm import commands

    cfg = tmp_path / "c.yaml"
    cfg.write_text("job:\n  sbatch_options: {account: old, qos: normal}\n  setup: [module load a]\n")
    submitted = []
    monkeypatch.setattr(commands, "sbatch", lambda path, args=(): submitted.append(path) or "7")
    code = cli.main(["submit", "--config", str(cfg), "--job-dir", str(tmp_path / "j"),
                     "--sbatch-option", "account=proj", "--sbatch-option", "exclusive",
                     "--srun-option=--gpu-bind=closest", "--setup", "source venv/bin/activate", "--", "x"])
    assert code == 0
    text = Path(submitted[0]).read_text()
    assert "#SBATCH --account=proj" in text and "#SBATCH --qos=normal" in text and "#SBATCH --exclusive" in text
    assert "module load a\nsource venv/bin/activate\nexec " in text
    written = load_config(str(tmp_path / "j" / "submitted-config.yaml"))
    assert written.job.srun_options == {"gpu-bind": "closest"}  # the supervisor's steps read it there


@pytest.mark.parametrize("argv,match", [
    (["--sbatch-option", "nodes=3"], "--sbatch-option: --nodes is the toolkit's own"),
    (["--sbatch-option", "comment=a b"], "--sbatch-option comment='a b'"),
    (["--sbatch-option", "=x"], "give KEY=VALUE"),
    (["--srun-option", "ntasks=2"], "--srun-option: --ntasks is the toolkit's own"),
])
def test_cli_bad_site_flags_exit_2(tmp_path, capsys, argv, match):
    from slurm_resilience import cli

    assert cli.main(["submit", "--job-dir", str(tmp_path / "j"), *argv, "--", "x"]) == 2
    err = capsys.readouterr().err
    assert match in err and err.count("\n") == 1 and not (tmp_path / "j").exists()


def test_executor_merges_the_site_options_with_its_own(tmp_path, monkeypatch):
    """``slurm_additional_parameters`` used to replace no_kill/nodes/requeue: now merged."""
    import submitit

    import slurm_resilience
    from slurm_resilience.launch import submitit_launch

    seen = {}

    class FakeExecutor:
        def __init__(self, folder, cluster):
            pass

        def update_parameters(self, **params):
            seen["params"] = params

        def submit(self, fn, config, command, job_dir, run_id):
            seen["config"] = config
            return type("J", (), {"job_id": "9"})()

    monkeypatch.setattr(submitit, "AutoExecutor", FakeExecutor)
    ex = slurm_resilience.ResilientExecutor(folder=tmp_path)
    ex.update_parameters(nodes=2, spares=1, tasks_per_node=8, slurm_account="proj", slurm_qos="high",
                         slurm_gres="gpu:8", slurm_constraint="a100", gpus_per_node=8, mem_gb=480,
                         cpus_per_task=12, slurm_additional_parameters={"reservation": "r1", "exclusive": True},
                         slurm_setup=["module load cuda"], slurm_srun_args=["--cpu-bind", "cores"],
                         slurm_signal_delay_s=20)
    ex.submit(["python", "train.py"])
    extra = seen["params"]["slurm_additional_parameters"]
    assert {k: extra[k] for k in ("no_kill", "nodes", "ntasks_per_node", "requeue")} == \
        {"no_kill": True, "nodes": 4, "ntasks_per_node": 8, "requeue": True}
    assert {k: extra[k] for k in ("account", "qos", "gres", "constraint", "gpus_per_node", "mem",
                                  "cpus_per_task", "reservation", "exclusive")} == \
        {"account": "proj", "qos": "high", "gres": "gpu:8", "constraint": "a100", "gpus_per_node": "8",
         "mem": "480GB", "cpus_per_task": "12", "reservation": "r1", "exclusive": True}
    assert seen["params"]["slurm_setup"] == ["module load cuda"]
    assert seen["params"]["slurm_signal_delay_s"] == 20
    assert seen["config"]["job"]["srun_options"] == {"cpu-bind": "cores"}
