"""`--tasks-per-node G` on submit, run and local: it becomes job.tasks_per_node, and a
bad value is one line on stderr with exit code 2 (never a traceback, never a job)."""

import pytest

from slurm_resilience import cli

COMMANDS = ("submit", "run", "local", "supervise", "restart-supervise")


@pytest.mark.parametrize("cmd", COMMANDS)
def test_flag_feeds_the_config(cmd):
    args = cli.build_parser().parse_args([cmd, "--nodes", "3", "--tasks-per-node", "2", "--", "python", "t.py"])
    cfg, command = cli._load(args)
    assert (cfg.job.nodes, cfg.job.tasks_per_node, command) == (3, 2, ["python", "t.py"])


def test_flag_overrides_the_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("job:\n  tasks_per_node: 8\n")
    cfg, _ = cli._load(cli.build_parser().parse_args(["run", "--config", str(path), "--tasks-per-node", "4"]))
    assert cfg.job.tasks_per_node == 4
    cfg, _ = cli._load(cli.build_parser().parse_args(["run", "--config", str(path)]))
    assert cfg.job.tasks_per_node == 8  # no flag: the file's value


@pytest.mark.parametrize("cmd", ("submit", "run", "local"))
@pytest.mark.parametrize("value,message", [
    ("0", "job.tasks_per_node=0 must be >= 1: one rank per GPU of a node"),
    ("-1", "job.tasks_per_node=-1 must be >= 1: one rank per GPU of a node"),
    ("two", "--tasks-per-node='two' must be an integer >= 1: ranks per node, one per GPU"),
    ("1.5", "--tasks-per-node='1.5' must be an integer >= 1: ranks per node, one per GPU"),
])
def test_bad_value_is_one_line(cmd, value, message, tmp_path, capsys):
    job_dir = tmp_path / "job"
    code = cli.main([cmd, f"--tasks-per-node={value}", "--job-dir", str(job_dir), "--", "true"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_USAGE
    assert err.splitlines() == [f"slurm-resilience: error: {message}"]
    assert not job_dir.exists()  # refused before anything was written or submitted
