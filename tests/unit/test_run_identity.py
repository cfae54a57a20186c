"""The run's identity: drawn once per submission, kept by its requeues, never by another run."""

from __future__ import annotations

import json
import os
import stat
import sys

import pytest

from slurm_resilience.checkpoint import manifest as mf
from slurm_resilience.config import load_config
from slurm_resilience.errors import CheckpointError, ConfigError
from slurm_resilience.launch.sbatch import render
from slurm_resilience.run_identity import (RUN_FILE, RUN_ID_ENV, RunIdentity, check_run_id, choose, establish,
                                           from_environ, new_run_id, read_recorded)
from slurm_resilience.supervisor.executors.keeper import keep

A, B = "a" * 32, "b" * 32


def test_a_new_run_id_is_128_random_bits_in_hex():
    ids = {new_run_id() for _ in range(100)}
    assert len(ids) == 100 and all(check_run_id(i) == i for i in ids)


@pytest.mark.parametrize("bad", ["", "A" * 32, "a" * 31, "a" * 33, "g" * 32, "a" * 31 + "\n", None, 7])
def test_anything_else_is_not_a_run_id(bad):
    with pytest.raises(ConfigError, match="bad run id"):
        check_run_id(bad)
    with pytest.raises(ConfigError):
        RunIdentity("1", bad)


def test_a_given_id_wins_a_resumption_keeps_the_recorded_one_a_new_job_draws():
    assert choose(A, B, resumed=False) == A  # job.sbatch's (a requeue reruns the same script)
    assert choose(A, B, resumed=True) == A
    assert choose(None, B, resumed=True) == B  # a requeue of a job started without one
    assert choose(None, B, resumed=False) is None  # a reused job id's directory: another run
    assert choose(None, None, resumed=True) is None
    with pytest.raises(ConfigError):
        choose("not-a-run-id", None, resumed=False)


def test_establish_records_it_0600_and_a_requeue_keeps_it(tmp_path):
    job = str(tmp_path / "job")
    first = establish(job, None, resumed=False)
    path = os.path.join(job, RUN_FILE)
    assert read_recorded(job) == first and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert establish(job, None, resumed=True) == first  # SLURM_RESTART_COUNT > 0
    second = establish(job, None, resumed=False)  # job 1 again after a Slurm restart: a new run
    assert second != first and read_recorded(job) == second
    assert establish(job, A, resumed=False) == A and read_recorded(job) == A


def test_a_broken_run_file_counts_as_none(tmp_path):
    (tmp_path / RUN_FILE).write_text("{not json")
    assert read_recorded(str(tmp_path)) is None
    (tmp_path / RUN_FILE).write_text(json.dumps({"run_id": "x"}))
    assert read_recorded(str(tmp_path)) is None
    assert check_run_id(establish(str(tmp_path), None, resumed=True))


def test_the_supervisor_child_reads_it_once_and_names_what_is_missing():
    assert from_environ({RUN_ID_ENV: A}) == A
    with pytest.raises(ConfigError, match=f"no {RUN_ID_ENV}"):
        from_environ({})
    with pytest.raises(ConfigError, match="bad run id"):
        from_environ({RUN_ID_ENV: "x"})


def test_the_keeper_hands_it_to_the_supervisor_it_starts():
    code = keep([sys.executable, "-c", f"import os, sys; sys.exit(0 if os.environ['{RUN_ID_ENV}'] == '{A}' else 9)"],
                restarts=0, env={**os.environ, RUN_ID_ENV: A})
    assert code == 0


def test_owns_only_its_own_and_legacy_by_choice():
    run = RunIdentity("1", A)
    assert run.owns(A) and not run.owns(B)
    assert not run.owns(None) and run.owns(None, adopt_legacy=True)


def test_the_manifest_carries_the_run_and_reads_back_without_one(tmp_path):
    shards = {0: mf.ShardRecord("rank-00000.h5", 4, 1)}
    m = mf.Manifest(step=3, world_size=1, tier="L1", shards=shards, run_id=A, job_id="7")
    back = mf.Manifest.from_json(m.to_json())
    assert (back.run_id, back.job_id) == (A, "7")
    legacy = mf.Manifest.from_json(mf.Manifest(step=3, world_size=1, tier="L1", shards=shards).to_json())
    assert (legacy.run_id, legacy.job_id) == (None, None)
    with pytest.raises(CheckpointError, match="run_id"):
        mf.Manifest(step=3, world_size=1, tier="L1", shards=shards, run_id=5)


def test_submit_exports_the_run_id_in_the_batch_script():
    cfg = load_config(None)
    text = render(cfg, command=["python", "t.py"], config_path="/c.yaml", job_dir="/j", run_id=A)
    line = next(ln for ln in text.splitlines() if RUN_ID_ENV in ln)
    assert line == f"export {RUN_ID_ENV}={A}"
    assert text.index(line) < text.index("exec ")  # the batch step (keeper) reads it
    assert RUN_ID_ENV not in render(cfg, command=["python", "t.py"], config_path="/c.yaml", job_dir="/j")
    het = render(cfg, command=["python", "t.py"], config_path="/c.yaml", job_dir="/j", run_id=A, hetjob=True)
    assert f"export {RUN_ID_ENV}={A}" in het
    with pytest.raises(ConfigError):
        render(cfg, command=["python", "t.py"], config_path="/c.yaml", job_dir="/j", run_id="$(rm -rf /)")


def test_continue_run_takes_a_run_id_or_a_job_directory(tmp_path):
    from slurm_resilience.errors import ConfigError
    from slurm_resilience.run_identity import continued, establish, new_run_id

    rid = new_run_id()
    assert continued(rid) == rid
    job = tmp_path / "job"
    recorded = establish(str(job), None, resumed=False)
    assert continued(str(job)) == recorded
    for bad in (str(tmp_path / "nothing"), "ABC", rid.upper()):
        with pytest.raises(ConfigError, match="--continue-run .*: not a run id"):
            continued(bad)
