"""The zygote and its pool as real processes on this host, without Slurm: the launcher
adapter starts the zygote as a plain process with a one-task step's SLURM_* variables.

Exit codes (0, N, an uncaught exception) reach the supervisor; ranks join a gloo
process group through the zygote's store host, which ends with the step, on KILL and
with its zygote; KILL reaps a running rank; a zygote that dies counts its ranks as killed; a command that cannot run warm,
a preloaded module that starts a thread, or a connection without the job's key are
refused. (Cold vs. warm equivalence under real Slurm: tests/e2e/test_warm_restart_slurm.py.)
"""

import os
import re
import signal
import subprocess
import sys
import time
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client
from pathlib import Path

import pytest

from slurm_resilience.supervisor.adapters.warm import ZygotePool

HERE = Path(__file__).resolve().parent
DATA = HERE / "zygote_data"
PROBE = HERE.parent / "e2e" / "observe_probe.py"


class _Step:
    def __init__(self, process, name, node):
        self.process, self.name, self.node = process, name, node


class _Launcher:
    """``SrunLauncher``'s shape: launch a one-task "step" (a plain process), kill it."""

    def __init__(self):
        self.steps = []

    def address(self, node):
        return "127.0.0.1"

    def launch(self, *, name, node, argv, env, log_path):
        step_env = {**os.environ, **env, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0",
                    "SLURM_NTASKS": "1", "SLURM_STEP_ID": "9", "SLURMD_NODENAME": node,
                    "PYTHONPATH": os.pathsep.join([str(DATA), os.environ.get("PYTHONPATH", "")])}
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(argv, env=step_env, stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.steps.append(_Step(proc, name, node))
        return self.steps[-1]

    def kill(self, handle):
        if handle.process.poll() is None:
            os.killpg(handle.process.pid, signal.SIGKILL)
            handle.process.wait()


@pytest.fixture
def pool_factory(tmp_path):
    pools = []

    def make(**kw):
        job = tmp_path / "job"
        job.mkdir(mode=0o700, exist_ok=True)
        pool = ZygotePool(job_dir=str(job), nodes=["n2"], launcher=_Launcher(), **kw)
        pools.append(pool)
        assert pool.wait_ready(["n2"], 120), (job / "zygote-n2.log").read_text()
        return pool, job

    yield make
    for pool in pools:
        pool.close()
        for step in pool.launcher.steps:  # a zygote started in the background too: leave none behind
            pool.launcher.kill(step)


def _fork(pool, job, command, name="sr-restart-1", ranks=2):
    return pool.fork_step(name=name, nodes=["n2"], tasks_per_node=ranks, command=command,
                          master_addr="127.0.0.1", port=21000, attempt=1, log_path=str(job / f"{name}.log"))


def _wait_gone(pid, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except FileNotFoundError:
            return
        time.sleep(0.02)
    raise AssertionError(f"rank pid {pid} outlived its zygote")


def _store_hosts(job):
    """The store hosts' pids the zygote reported, in order."""
    return [int(p) for p in re.findall(r"store host pid (\d+) listens", (job / "zygote-n2.log").read_text())]


def _wait(step, timeout=60):
    deadline = time.monotonic() + timeout
    while (code := step.poll()) is None:
        assert time.monotonic() < deadline, "the ranks did not end"
        time.sleep(0.02)
    return code


def test_exit_codes_and_output_reach_the_supervisor(pool_factory):
    pool, job = pool_factory()
    for extra, code, name in (([], 0, "ok"), (["--exit", "3"], 3, "exit3"), (["--raise"], 1, "raise")):
        step = _fork(pool, job, [sys.executable, str(PROBE), str(job / f"{name}-{{rank}}.json"), *extra], name=name)
        assert step is not None
        assert _wait(step) == code and step.codes == {0: code, 1: code}
        log = (job / f"{name}.log").read_text()
        assert "probe stdout rank 0" in log and "probe stderr rank 1" in log
    assert (job / "zygote.key").stat().st_mode & 0o777 == 0o600
    step = _fork(pool, job, [sys.executable, str(DATA / "pg_probe.py")], name="pg")
    assert _wait(step) == 0, (job / "pg.log").read_text()
    log = (job / "pg.log").read_text()
    assert "pg rank 0 sum 3 agent True" in log and "pg rank 1 sum 3 agent True" in log, log
    hosts = _store_hosts(job)
    assert len(hosts) == 4  # one per step, on port 21000 each time: the previous one ended with its step
    for pid in hosts:
        _wait_gone(pid)
    assert (job / "zygotes" / "n2.json").stat().st_mode & 0o777 == 0o600


def test_kill_reaps_running_ranks(pool_factory):
    pool, job = pool_factory()
    step = _fork(pool, job, [sys.executable, str(DATA / "sleeper.py")])
    while (job / "sr-restart-1.log").read_text().count("sleeper up") < 2:
        assert step.poll() is None
        time.sleep(0.02)
    pids = [pid for _, pid in step.pids.values()]
    step.kill(skip=())
    assert step.codes == {0: -9, 1: -9}
    _wait_gone(_store_hosts(job)[-1])  # KILL ends the step's store host too
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    # the zygote is still there for the next generation (the same step name: a new process group)
    again = _fork(pool, job, [sys.executable, str(PROBE), str(job / "again-{rank}.json")])
    assert _wait(again) == 0 and again.codes == {0: 0, 1: 0}, (job / "sr-restart-1.log").read_text()


def test_a_dead_zygote_counts_its_ranks_killed_and_is_replaced(pool_factory):
    pool, job = pool_factory()
    step = _fork(pool, job, [sys.executable, str(DATA / "sleeper.py")])
    pool.launcher.kill(pool.zygotes["n2"].step)  # the zygote's "step" with its ranks
    assert _wait(step) == 137 and step.codes == {0: -9, 1: -9}
    for _node, pid in step.pids.values():  # counted killed, and they are: they die with their zygote
        _wait_gone(pid)
    _wait_gone(_store_hosts(job)[-1])  # and so does the store host
    assert "n2" not in pool.zygotes or pool.zygotes["n2"].conn is None
    assert _fork(pool, job, [sys.executable, str(PROBE), str(job / "x-{rank}.json")], name="x") is None  # cold
    assert pool.wait_ready(["n2"], 120)  # a new zygote was started in the background


def test_refusals(pool_factory):
    pool, job = pool_factory()
    assert _fork(pool, job, [sys.executable, "-c", "print(1)"]) is None  # not `python script.py`
    info = (job / "zygotes" / "n2.json").read_text()
    import json

    port = json.loads(info)["port"]
    with pytest.raises((AuthenticationError, EOFError, ConnectionError)):
        Client(("127.0.0.1", port), authkey=b"not-the-job-key")
    assert _wait(_fork(pool, job, [sys.executable, str(PROBE), str(job / "ok-{rank}.json")], name="ok")) == 0
    assert "refused a connection" in (job / "zygote-n2.log").read_text()


def test_a_thread_in_the_zygote_refuses_every_fork(pool_factory):
    pool, job = pool_factory(preload=["starts_a_thread"])
    assert _fork(pool, job, [sys.executable, str(PROBE), str(job / "t-{rank}.json")]) is None
    assert "Python threads: forking it is unsafe" in (job / "zygote-n2.log").read_text()
