"""Containers: the `container:` section, and golden command lines of every runtime.

pyxis and apptainer cannot run on the development or CI machines (not packaged for
Debian 12): their argv is only tested here, against tests/unit/golden/container-steps.txt.
podman's also runs for real (tests/e2e/test_containers_slurm.py).
"""

import json
import os
import shlex
from pathlib import Path

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.container import enter
from slurm_resilience.container.argv import (
    cleanup_argv, container_name, for_job, node_prefix, srun_options, stale_cleanup_argv, wrap)
from slurm_resilience.errors import ConfigError
from slurm_resilience.slurm.steps import srun_argv
from slurm_resilience.supervisor.executors.relaunch import step_argv

GOLDEN = Path(__file__).parent / "golden" / "container-steps.txt"
SECTION = {"image": "IMAGE", "mounts": ["/shared/data:/data:ro", "/scratch"], "env": ["HF_HOME"],
           "extra_args": ["--x-extra"]}
IMAGES = {"pyxis": "/shared/images/pytorch-24.05.sqsh", "apptainer": "/shared/images/train.sif",
          "podman": "localhost/train:1"}


def _sc(runtime, **more):
    section = {**SECTION, "runtime": runtime, "image": IMAGES[runtime], **more}
    cfg = load_config({"container": section}).container
    return for_job(cfg, job_id="42", job_dir="/home/u/sr-jobs/42", cwd="/home/u/proj", python="/usr/bin/python3")


def _worker_step(sc):
    """A worker's (or standby's) step, as SrunLauncher.launch builds it."""
    srun = srun_argv(job_id="42", name="sr-n3.7", nodes=["n3"], options=["--cpu-bind=cores", *srun_options(sc)])
    return [*srun, *wrap(sc, ["python", "train.py"], name=container_name("42", "n3", "n3.7"),
                         env_names=["SR_TOKEN", "SR_WORKER_ID"])]


def _relaunch_step(sc):
    return step_argv(job_id="42", name="sr-restart-1", nodes=["n2", "n3"], command=["python", "train.py"],
                     mpi=False, master_addr="10.0.0.2", port=24201, attempt=1, python="/usr/bin/python3",
                     step_container=sc)


def _render() -> str:
    lines = []
    for runtime in ("pyxis", "apptainer", "podman"):
        for what, argv in (("worker", _worker_step(_sc(runtime))),
                           ("worker, gpus", _worker_step(_sc(runtime, gpus=True))),
                           ("relaunch", _relaunch_step(_sc(runtime))),
                           ("cleanup", cleanup_argv(_sc(runtime))),
                           ("cleanup at the job's start", stale_cleanup_argv(_sc(runtime)))):
            lines.append(f"# {runtime}: {what}")
            lines.append(shlex.join(argv) if argv is not None else "(nothing to clean)")
    return "\n".join(lines) + "\n"


def test_matches_golden():
    text = _render()
    if os.environ.get("SR_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(text)
    assert text == GOLDEN.read_text()


def test_pyxis_is_srun_flags_and_the_command_is_untouched():
    argv = _worker_step(_sc("pyxis"))
    assert argv[-2:] == ["python", "train.py"]
    assert "--container-name=sr-42" in argv  # per job: created once per node, reused by later steps
    assert "--container-mounts=/shared/data:/data:ro,/scratch:/scratch,/home/u/sr-jobs/42:/home/u/sr-jobs/42," \
           "/home/u/proj:/home/u/proj" in argv
    assert argv.index("--cpu-bind=cores") < argv.index("--container-image=/shared/images/pytorch-24.05.sqsh")


def test_podman_shares_network_ipc_pid_and_passes_env_by_name_only():
    argv = _worker_step(_sc("podman"))
    assert {"--network=host", "--ipc=host", "--pid=host", "--rm"} <= set(argv)
    podman = argv[argv.index("podman"):]
    assert podman[podman.index("-w") + 1] == "/home/u/proj"
    assert ["-e", "SR_TOKEN"] == argv[argv.index("SR_TOKEN") - 1:argv.index("SR_TOKEN") + 1]
    assert not any("=" in a and a.split("=")[0] in ("SR_TOKEN", "HF_HOME") for a in argv)  # never a value
    assert argv.index("localhost/train:1") == len(argv) - 3


def test_none_runtime_changes_nothing():
    sc = for_job(load_config().container, job_id="1", job_dir="/j", cwd="/c")
    assert sc is None and wrap(sc, ["a"], name="x") == ["a"] and srun_options(sc) == [] and cleanup_argv(sc) is None
    plain = step_argv(job_id="1", name="s", nodes=["n1"], command=["a"], mpi=True, master_addr="h", port=1,
                      attempt=0)
    assert plain[-2:] == ["--", "a"]


def test_node_prefix_does_not_match_a_longer_node_name():
    assert not container_name("42", "n10", "n10.1").startswith(node_prefix("42", "n1"))


@pytest.mark.parametrize("section, words", [
    ({"runtime": "docker", "image": "x"}, "not a runtime"),
    ({"runtime": "podman"}, "container.image is empty"),
    ({"runtime": "podman", "image": "a b"}, "holds a space"),
    ({"runtime": "podman", "image": "x", "mounts": ["data:/data"]}, "must be absolute"),
    ({"runtime": "podman", "image": "x", "mounts": ["/a:/b:rx"]}, "mode must be ro or rw"),
    ({"runtime": "pyxis", "image": "x", "mounts": ["/a,b"]}, "comma"),
    ({"runtime": "podman", "image": "x", "workdir": "rel"}, "absolute path"),
    ({"runtime": "podman", "image": "x", "env": ["A=1"]}, "not a variable name"),
    ({"runtime": "podman", "image": "x", "mounts": "/a"}, "list of strings"),
    ({"runtime": "podman", "image": "x", "oops": 1}, "unknown key 'container.oops'"),
])
def test_bad_sections_are_one_line_errors(section, words):
    with pytest.raises(ConfigError) as exc:
        load_config({"container": section})
    assert words in str(exc.value) and "\n" not in str(exc.value)


CGROUP_V1 = """9:name=systemd:/
6:freezer:/slurm_n1/uid_0/job_314/step_0
4:memory:/slurm_n1/uid_0/job_314/step_0/task_0
0::/
"""


def test_enter_finds_the_step_cgroup():
    assert enter.step_cgroup(CGROUP_V1) == "/slurm_n1/uid_0/job_314/step_0"
    assert enter.step_cgroup("0::/system.slice/slurmstepd.scope/job_7/step_2/user/task_0\n") \
        == "/system.slice/slurmstepd.scope/job_7/step_2/user/task_0"
    assert enter.step_cgroup("6:freezer:/\n0::/\n") is None  # not a Slurm step


def test_enter_fills_node_task_cgroup_and_slurm_variables():
    env = {"SLURMD_NODENAME": "n3", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SR_TOKEN": "secret"}
    argv = enter.podman_run(["podman", "run", "--rm", "--name=sr-42-{node}-restart1-{task}", "IMG", "cmd"],
                            env, "/slurm_n3/uid_0/job_42/step_1")
    assert argv == ["podman", "run", "--cgroup-parent=/slurm_n3/uid_0/job_42/step_1", "-e", "SLURM_NTASKS",
                    "-e", "SLURM_PROCID", "--rm", "--name=sr-42-n3-restart1-5", "IMG", "cmd"]
    assert enter.podman_run(["apptainer", "exec", "x"], env, None) == ["apptainer", "exec", "x"]


def test_stale_names_are_this_nodes_containers_of_ended_jobs_only():
    names = ["sr-7-n1-n1.1", "sr-7-n10-n10.2", "sr-8-n1-n1.3", "sr-9-n1-restart1-0", "other", "sr-x-n1-a",
             "sr-7-n2-n2.1"]
    assert enter.stale_names(names, "n1", live_jobs={"8"}) == ["sr-7-n1-n1.1", "sr-9-n1-restart1-0"]
    assert enter.stale_names(names, "n1", live_jobs={"7", "8", "9"}) == []


def test_enter_usage_error_is_one_line(capsys):
    assert enter.main(["podman", "run"]) == 2
    assert capsys.readouterr().err.count("\n") == 1


def test_golden_file_is_valid_shell_words():
    for line in GOLDEN.read_text().splitlines():
        if not line.startswith("#") and not line.startswith("("):
            assert shlex.split(line) and json.dumps(shlex.split(line))


def test_local_mode_refuses_a_container_in_one_line(tmp_path, capsys):
    from slurm_resilience.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("container:\n  runtime: podman\n  image: localhost/x:1\n")
    assert main(["local", "--config", str(cfg), "--", "true"]) == 2
    err = capsys.readouterr().err
    assert "container.runtime=podman applies to Slurm jobs" in err and err.count("\n") == 1
