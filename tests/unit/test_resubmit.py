"""recovery.requeue_by: resubmit — the pure parts (environment, flags, the successor chain,
the launcher choice) and the requeue breakdown of benchmarks/mttr.py. The job itself is
tested on the real cluster (tests/e2e/test_recovery_slurm.py, requeue_by=resubmit)."""

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from slurm_resilience.config import RecoveryConfig, load_config
from slurm_resilience.errors import ConfigError
from slurm_resilience.launch.allocation import _launcher_kind
from slurm_resilience.slurm.parse import SlurmEnv
from slurm_resilience.slurm.resubmit import (
    RESUBMITTED_FILE, ResubmittingLauncher, resubmit_args, resubmit_env, successor,
)
from slurm_resilience.slurm.steps import SrunLauncher

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import mttr_cases  # noqa: E402


def test_the_successor_inherits_no_variable_of_this_run_but_the_count_and_the_first_id():
    env = resubmit_env({"PATH": "/bin", "SLURM_CONF": "/etc/s.conf", "SLURM_JOB_ID": "7", "SLURM_NNODES": "5",
                        "SBATCH_EXCLUSIVE": "1", "SLURM_RESTART_COUNT": "1", "SRUN_DEBUG": "3",
                        "SR_RESUBMIT_COUNT": "0", "PYTHONPATH": "/x"}, origin_job_id="5", resubmits=1)
    assert env == {"PATH": "/bin", "SLURM_CONF": "/etc/s.conf", "PYTHONPATH": "/x",
                   "SR_ORIGIN_JOB_ID": "5", "SR_RESUBMIT_COUNT": "1"}


def test_the_successor_waits_for_this_job_and_avoids_the_isolated_nodes():
    assert resubmit_args(after="41", exclude=[]) == ["--dependency", "afterany:41", "--kill-on-invalid-dep=yes"]
    assert resubmit_args(after="41", exclude=["n3", "n2"])[-2:] == ["--exclude", "n[2-3]"]
    with pytest.raises(ValueError):
        resubmit_args(after="41", exclude=["n3;rm"])


def test_the_chain_names_each_jobs_successor(tmp_path):
    assert successor(str(tmp_path), "41") is None
    (tmp_path / RESUBMITTED_FILE).write_text(json.dumps({"chain": {"41": "45", "45": "52"}, "origin": "41"}))
    assert successor(str(tmp_path), "41") == "45" and successor(str(tmp_path), "45") == "52"
    assert successor(str(tmp_path), "52") is None
    (tmp_path / RESUBMITTED_FILE).write_text("{half")
    assert successor(str(tmp_path), "41") is None


def test_requeue_by_is_checked_and_read_from_yaml(tmp_path):
    with pytest.raises(ConfigError, match="requeue_by='later' must be requeue or resubmit"):
        RecoveryConfig(requeue_by="later")
    p = tmp_path / "c.yaml"
    p.write_text("recovery:\n  requeue_by: resubmit\n")
    assert load_config(str(p)).recovery.requeue_by == "resubmit"
    assert RecoveryConfig().requeue_by == "requeue"  # the default keeps the job id


def test_the_toolkits_count_adds_to_slurms_and_the_first_id_travels():
    env = SlurmEnv.from_environ({"SLURM_JOB_ID": "45", "SLURM_RESTART_COUNT": "1", "SR_RESUBMIT_COUNT": "2",
                                 "SR_ORIGIN_JOB_ID": "41"})
    assert (env.requeue_count, env.resubmit_count, env.origin_job_id) == (1, 2, "41")
    plain = SlurmEnv.from_environ({"SLURM_JOB_ID": "45"})
    assert (plain.resubmit_count, plain.origin_job_id) == (0, None)


def test_only_a_submitted_ordinary_job_resubmits(tmp_path):
    cfg = load_config(None)
    resub = dataclasses.replace(cfg, recovery=RecoveryConfig(requeue_by="resubmit"))
    env = SlurmEnv.from_environ({"SLURM_JOB_ID": "45", "SR_ORIGIN_JOB_ID": "41", "SR_RESUBMIT_COUNT": "1"})
    assert _launcher_kind(resub, env, str(tmp_path)) == (SrunLauncher, {})  # no job.sbatch (submitit's)
    (tmp_path / "job.sbatch").write_text("#!/bin/bash\n")
    kind, more = _launcher_kind(resub, env, str(tmp_path))
    assert kind is ResubmittingLauncher and more == {"job_dir": str(tmp_path), "origin_job_id": "41", "resubmits": 1}
    assert _launcher_kind(cfg, env, str(tmp_path)) == (SrunLauncher, {})  # requeue_by: requeue
    het = SlurmEnv.from_environ({"SLURM_JOB_ID": "45", "SLURM_HET_SIZE": "2", "SLURM_JOB_ID_HET_GROUP_0": "45",
                                 "SLURM_JOB_ID_HET_GROUP_1": "46", "SLURM_JOB_NODELIST_HET_GROUP_0": "n1",
                                 "SLURM_JOB_NODELIST_HET_GROUP_1": "n[2-3]"})
    assert _launcher_kind(resub, het, str(tmp_path)) == (SrunLauncher, {})


def test_the_requeue_breakdown_splits_the_window_at_each_event(tmp_path):
    (tmp_path / "store.json").write_text(json.dumps({"started": 110.0, "t": 111.0}))
    ev = [{"kind": "job_start", "t": 0.9}, {"kind": "plan", "t": 1.0}, {"kind": "fault_detected", "t": 100.5},
          {"kind": "requeue", "t": 102.0}, {"kind": "job_start", "t": 111.5}, {"kind": "plan", "t": 112.0, "generation": 0}]
    ev += [{"kind": "rank_reconnected", "t": 115.0 + r / 10} for r in range(2)]
    ev += [{"kind": "rank_restored", "t": 115.5 + r / 10} for r in range(2)]
    ev += [{"kind": "rank_first_step", "t": 116.0 + r / 10, "generation": 0} for r in range(2)]
    parts = mttr_cases.requeue_parts(ev, 100.0, tmp_path)
    assert parts == {"detect": 0.5, "stop": 1.5, "slurm": 8.0, "store": 1.0, "supervisor": 1.5, "plan": 2.0,
                     "workers": 3.6, "restore": 0.5, "first_step": 0.5}
    (tmp_path / "store.json").unlink()  # no restarted batch step: the parts after it are unknown
    assert mttr_cases.requeue_parts(ev, 100.0, tmp_path)["slurm"] is None
