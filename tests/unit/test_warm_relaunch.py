"""RelaunchExecutor with the zygotes: every generation forked when the pool can, the
old generation killed through it (never waiting on a lost node), the cold srun step
when it cannot. The pool is a fake here; the real one: tests/local/test_zygote_local.py
and tests/e2e/test_warm_restart_slurm.py."""

import sys
import threading
import time

import pytest
from test_relaunch import RECOVERED, FakeLauncher, _kinds, fake_srun  # noqa: F401  (fake_srun: a fixture)

from slurm_resilience.config import load_config
from slurm_resilience.events import read_events
from slurm_resilience.supervisor.executors import relaunch
from slurm_resilience.supervisor.executors.relaunch import RelaunchExecutor, layout
from slurm_resilience.supervisor.adapters.warm import WarmStep


class FakeWarmStep(WarmStep):
    def __init__(self, name, nodes, code):
        super().__init__(name=name, node=nodes[0], conns={}, pool=None)
        self.nodes, self.code, self.skipped = nodes, code, None

    def poll(self):
        return None if self.code == "hang" else self.code

    def kill(self, *, skip, timeout_s=10):
        self.skipped = tuple(skip)


class FakePool:
    """Forks generation i with ``codes[i]`` (None: no zygote, run cold)."""

    instances = []

    def __init__(self, *, job_dir, nodes, launcher, preload=(), env=None):
        self.nodes, self.preload, self.forked, self.waited = list(nodes), preload, [], []
        self.env = dict(env or {})
        self.codes = list(FakePool.codes)
        self.closed = False
        FakePool.instances.append(self)

    def wait_ready(self, nodes, timeout_s):
        self.waited.append(list(nodes))
        return True

    def fork_step(self, *, name, nodes, tasks_per_node, command, master_addr, port, attempt, log_path,
                  progress_file="", job_dir=""):
        code = self.codes.pop(0)
        if code == "train":  # the program's rank 0 trains step 11 and ends
            with open(progress_file, "a") as f:
                f.write(f"11 {time.time():.6f}\n")
            code = 0
        step = None if code is None else FakeWarmStep(name, list(nodes), code)
        self.forked.append((name, list(nodes), attempt, step))
        return step

    def close(self):
        self.closed = True


def _executor(tmp_path, launcher, codes, *, warm=True, command=(sys.executable, "t.py"), monkeypatch):
    FakePool.codes, FakePool.instances = codes, []
    monkeypatch.setattr(relaunch, "ZygotePool", FakePool)
    cfg = load_config({"detect": {"node_poll_s": 0.1}, "run": {"warm": warm, "preload": ["numpy"]}})
    lay = layout(["n1", "n2", "n3", "n4", "n5"], "n1", 3)
    return RelaunchExecutor(config=cfg, command=list(command), job_dir=str(tmp_path / "job"), job_id="77",
                            layout=lay, allocation=["n1", "n2", "n3", "n4", "n5"], launcher=launcher,
                            poll_s=0.02, probe_every_s=0.05)


@pytest.mark.timeout(30)
def test_node_loss_relaunch_is_forked_and_the_lost_node_not_waited_on(tmp_path, monkeypatch, fake_srun):
    launcher = FakeLauncher()
    threading.Timer(0.3, launcher.down.add, ["n3"]).start()
    sup = _executor(tmp_path, launcher, ["hang", "train"], monkeypatch=monkeypatch)
    assert sup.run() == 0
    pool = FakePool.instances[0]
    assert pool.nodes == ["n2", "n3", "n4", "n5"] and pool.preload == ("numpy",)  # workers and spares
    assert pool.waited == [["n2", "n3", "n4"]]  # only the first generation waits for the zygotes
    (name0, nodes0, _, step0), (name1, nodes1, attempt1, _) = pool.forked
    assert (name0, nodes0) == ("sr-restart-0", ["n2", "n3", "n4"])
    assert (name1, nodes1, attempt1) == ("sr-restart-1", ["n2", "n4", "n5"], 1)
    assert step0.skipped == ("n3",)  # killed through the zygotes, the lost node left to Slurm
    assert fake_srun() == [] and launcher.killed == []  # no srun step at all
    assert pool.closed
    assert [k for k in _kinds(tmp_path) if k != "isolated"] == RECOVERED
    done = [e for e in read_events(str(tmp_path / "job" / "events.jsonl")) if e["kind"] == "recovery_done"]
    assert done[0]["step"] == 11  # the line the forked program wrote to its SR_PROGRESS_FILE


@pytest.mark.timeout(30)
def test_no_zygote_falls_back_to_the_cold_step(tmp_path, monkeypatch, fake_srun):
    monkeypatch.setenv("FAKE_SRUN_CODES", "0")
    launcher = FakeLauncher()
    sup = _executor(tmp_path, launcher, [1, None], monkeypatch=monkeypatch)  # gen 0 warm dies, gen 1 cold
    assert sup.run() == 0
    (first,) = fake_srun()
    assert first["restart"] == "1" and first["argv"][first["argv"].index("-w") + 1] == "n2,n3,n4"
    assert _kinds(tmp_path).count("relaunch") == 1


def test_no_pool_when_not_warm(tmp_path, monkeypatch):
    for kw in ({"warm": False}, {"command": ("python", "-m", "train")}, {"command": ("/bin/sh", "t.sh")}):
        sup = _executor(tmp_path, FakeLauncher(), [], monkeypatch=monkeypatch, **kw)
        assert sup.zygotes is None and FakePool.instances == []


def test_zygotes_get_the_ranks_nccl_settings_and_none_for_containers(tmp_path, monkeypatch):
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    sup = _executor(tmp_path, FakeLauncher(), [], monkeypatch=monkeypatch)
    assert FakePool.instances[0].env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == sup._nccl_env["TORCH_NCCL_ASYNC_ERROR_HANDLING"]
    FakePool.instances = []
    cfg = load_config({"run": {"warm": True}, "container": {"runtime": "podman", "image": "img"}})
    sup = RelaunchExecutor(config=cfg, command=[sys.executable, "t.py"], job_dir=str(tmp_path / "job2"), job_id="78",
                           layout=layout(["n1", "n2", "n3"], "n1", 2), allocation=["n1", "n2", "n3"],
                           launcher=FakeLauncher(), poll_s=0.02, probe_every_s=0.05)
    assert sup.zygotes is None and FakePool.instances == []  # the zygotes run on the host: containers start cold
