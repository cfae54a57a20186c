"""Golden sbatch script, and shell quoting checked by running the script with bash."""

import os
from pathlib import Path

import pytest

from slurm_resilience.config import load_config

from sbatch_shell import HOSTILE_CMD, HOSTILE_DIR, run_script, stub_python
from slurm_resilience.errors import ConfigError
from slurm_resilience.launch.sbatch import render

GOLDEN = Path(__file__).parent / "golden" / "resilient.sbatch"
HET_GOLDEN = Path(__file__).parent / "golden" / "hetjob.sbatch"


def _golden_render(hetjob=False):
    cfg = load_config({"job": {"nodes": 3, "spares": 2, "tasks_per_node": 4, "partition": "debug",
                               "time_limit": "01:30:00"}})
    return render(cfg, command=["python", "train.py", "--steps", "100"],
                  config_path="/home/u/run/config.yaml", job_dir="/home/u/sr-jobs/42",
                  job_name="resilient", python="/usr/bin/python3", hetjob=hetjob)


@pytest.mark.parametrize("hetjob,golden", [(False, GOLDEN), (True, HET_GOLDEN)])
def test_matches_golden(hetjob, golden):
    text = _golden_render(hetjob)
    if os.environ.get("SR_UPDATE_GOLDEN") == "1":
        golden.write_text(text)
    assert text == golden.read_text()


def test_golden_essentials():
    lines = GOLDEN.read_text().splitlines()
    assert lines[0] == "#!/bin/bash"
    assert "#SBATCH --no-kill" in lines
    assert "#SBATCH --nodes=6" in lines  # 3 nodes + 2 spares + 1 supervisor node
    assert "#SBATCH --ntasks-per-node=4" in lines  # G ranks on every node, the supervisor's too
    assert "#SBATCH --partition=debug" in lines
    assert "#SBATCH --requeue" in lines and "#SBATCH --signal=B:USR2@60" in lines
    assert lines[-1].startswith("exec /usr/bin/python3 -m slurm_resilience.cli supervise ")


def _components(text):
    """#SBATCH lines per hetjob component (split at ``#SBATCH hetjob``)."""
    sbatch = [ln for ln in text.splitlines() if ln.startswith("#SBATCH")]
    cut = sbatch.index("#SBATCH hetjob")
    return sbatch[:cut], sbatch[cut + 1:]


def test_hetjob_golden_essentials():
    text = HET_GOLDEN.read_text()
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash" and lines.count("#SBATCH hetjob") == 1
    sup, workers = _components(text)
    assert "#SBATCH --nodes=1" in sup  # the supervisor's component: one node
    assert "#SBATCH --nodes=5" in workers  # 3 nodes + 2 spares
    for comp in (sup, workers):
        for opt in ("--no-kill", "--requeue", "--partition=debug", "--time=01:30:00"):
            assert f"#SBATCH {opt}" in comp, (opt, comp)
    assert "#SBATCH --ntasks-per-node=1" in sup  # the supervisor needs one task ...
    assert "#SBATCH --ntasks-per-node=4" in workers  # ... the workers G = tasks_per_node
    assert "#SBATCH --signal=B:USR2@60" in sup  # B: the batch shell lives in component 0
    assert "#SBATCH --output=/home/u/sr-jobs/42/supervisor.log" in sup
    assert lines[-1] == _golden_render().splitlines()[-1]  # the same supervisor command


@pytest.mark.parametrize("nodes,spares", [(1, 0), (4, 1), (16, 3)])
def test_hetjob_worker_component_size(nodes, spares):
    cfg = load_config({"job": {"nodes": nodes, "spares": spares}})
    sup, workers = _components(render(cfg, command=["x"], config_path="c", job_dir="d", hetjob=True))
    assert "#SBATCH --nodes=1" in sup and f"#SBATCH --nodes={nodes + spares}" in workers
    assert not any("--partition" in ln for ln in sup + workers)


@pytest.mark.parametrize("hetjob", [False, True])
@pytest.mark.parametrize("tasks", [1, 2, 8])
def test_tasks_per_node_reaches_every_worker_node(hetjob, tasks):
    cfg = load_config({"job": {"nodes": 2, "spares": 1, "tasks_per_node": tasks}})
    text = render(cfg, command=["x"], config_path="c", job_dir="d", hetjob=hetjob)
    per_node = [ln for ln in text.splitlines() if ln.startswith("#SBATCH --ntasks-per-node=")]
    want = ["#SBATCH --ntasks-per-node=1"] if hetjob else []
    assert per_node == want + [f"#SBATCH --ntasks-per-node={tasks}"]


def test_hetjob_needs_the_supervisor_component():
    cfg = load_config({"job": {"supervisor_node": False}})
    with pytest.raises(ConfigError, match="supervisor_node"):
        render(cfg, command=["x"], config_path="c", job_dir="d", hetjob=True)


def test_hetjob_without_preempt_signal():
    cfg = load_config({"job": {"preempt_signal": ""}})
    assert "--signal" not in render(cfg, command=["x"], config_path="c", job_dir="d", hetjob=True)


@pytest.mark.parametrize("nodes,spares,sup,total", [(1, 0, True, 2), (4, 1, True, 6), (4, 1, False, 5),
                                                   (16, 3, True, 20)])
def test_total_nodes(nodes, spares, sup, total):
    cfg = load_config({"job": {"nodes": nodes, "spares": spares, "supervisor_node": sup}})
    text = render(cfg, command=["x"], config_path="c", job_dir="d")
    assert f"#SBATCH --nodes={total}\n" in text
    assert "#SBATCH --no-kill\n" in text


def test_no_partition_line_without_partition():
    text = render(load_config(), command=["x"], config_path="c", job_dir="d")
    assert "--partition" not in text


def test_empty_command_raises():
    with pytest.raises(ConfigError, match="no training command"):
        render(load_config(), command=[], config_path="c", job_dir="d")


def test_missing_template_raises(tmp_path):
    with pytest.raises(ConfigError, match="template not found"):
        render(load_config(), command=["x"], config_path="c", job_dir="d", template="nope.tmpl")


def test_hostile_values_are_quoted_in_text():
    text = render(load_config(), command=HOSTILE_CMD, config_path="/c fg/$(x).yaml", job_dir=HOSTILE_DIR,
                  python="/opt/my python/bin/python3")
    exec_line = text.splitlines()[-1]
    assert "'; rm -rf /'" in exec_line
    assert "'/tmp/my jobs/run $(touch PWNED); x'" in exec_line
    assert "'/opt/my python/bin/python3'" in exec_line
    assert "#SBATCH --output='/tmp/my jobs/run $(touch PWNED); x/supervisor.log'" in text


@pytest.mark.parametrize("hetjob", [False, True])
def test_hostile_values_reach_the_supervisor_verbatim(tmp_path, hetjob):
    text = render(load_config(), command=HOSTILE_CMD, config_path="/c fg/$(touch PWNED).yaml",
                  job_dir=HOSTILE_DIR, python=stub_python(tmp_path), hetjob=hetjob)
    argv = run_script(text, tmp_path)
    assert argv == ["-m", "slurm_resilience.cli", "supervise", "--config", "/c fg/$(touch PWNED).yaml",
                    "--job-dir", HOSTILE_DIR, "--", *HOSTILE_CMD]


def test_partition_with_newline_cannot_inject(tmp_path):
    with pytest.raises(ConfigError, match="partition"):
        cfg = load_config({"job": {"partition": "debug\ntouch PWNED"}})
        render(cfg, command=["train.py"], config_path="c", job_dir="d", python=stub_python(tmp_path))
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("hetjob", [False, True])
def test_job_name_with_newline_cannot_inject(tmp_path, hetjob):
    with pytest.raises(ConfigError, match="line break"):
        render(load_config(), command=["train.py"], config_path="c", job_dir="d",
               job_name="x\ntouch PWNED\n", python=stub_python(tmp_path), hetjob=hetjob)


@pytest.mark.parametrize("flag,het", [([], False), (["--hetjob"], True)])
def test_cli_submit_hetjob_flag_picks_the_template(tmp_path, monkeypatch, flag, het):
    from slurm_resilience import cli
    from slurm_resilience.slurm import commands

    submitted = []
    monkeypatch.setattr(commands, "sbatch", lambda path, args=(): submitted.append(path) or "7")
    code = cli.main(["submit", *flag, "--nodes", "2", "--spares", "1", "--job-dir", str(tmp_path / "j"),
                     "--", "python", "train.py"])
    assert code == 0
    text = Path(submitted[0]).read_text()
    assert ("#SBATCH hetjob" in text) is het
    assert ("#SBATCH --nodes=3" in text) is het and ("#SBATCH --nodes=4" in text) is not het
