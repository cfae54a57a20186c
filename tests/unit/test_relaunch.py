"""Job-level recovery: the pure parts (layout, spare choice, faults, plan, argv, env), then
the loop itself against a fake srun and a fake launcher."""

import io
import json
import os
import stat
import sys
import threading

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.errors import ResilienceError
from slurm_resilience.events import read_events
from slurm_resilience.rankenv import rank_env
from slurm_resilience.model import FaultKind
from slurm_resilience.supervisor.decide.classify import find_faults, lost_nodes
from slurm_resilience.supervisor.executors.relaunch import RelaunchExecutor, layout, master_node, master_port, step_argv

ALLOC = ["n1", "n2", "n3", "n4", "n5", "n6"]


def test_layout_batch_host_supervises_only():
    lay = layout(ALLOC, "n1", 3)
    assert lay.supervisor == "n1" and lay.workers == ("n2", "n3", "n4") and lay.spares == ("n5", "n6")


def test_layout_without_supervisor_node_uses_every_node():
    lay = layout(ALLOC[:4], "n1", 3, supervisor_node=False)
    assert lay.supervisor is None and lay.workers == ("n1", "n2", "n3") and lay.spares == ("n4",)


def test_layout_too_few_nodes():
    with pytest.raises(ResilienceError, match="2 node\\(s\\) for 3 worker"):
        layout(["n1", "n2", "n3"], "n1", 3)


NODES = ["n2", "n3", "n4"]
UP = {n: True for n in NODES}


def test_no_fault_while_running_or_after_clean_exit():
    assert find_faults(NODES, exit_code=None, reachable=UP, states={}, now=1.0) == []
    assert find_faults(NODES, exit_code=0, reachable=UP, states={"n2": "MIXED"}, now=1.0) == []


def test_unreachable_node_is_lost_even_while_running():
    faults = find_faults(NODES, exit_code=None, reachable={**UP, "n3": False}, states={}, now=1.0)
    assert [(f.kind, f.node) for f in faults] == [(FaultKind.NODE_LOST, "n3")]


def test_down_node_is_unhealthy():
    faults = find_faults(NODES, exit_code=137, reachable=UP, states={"n4": "DOWN*"}, now=1.0)
    assert [(f.kind, f.node) for f in faults] == [(FaultKind.NODE_UNHEALTHY, "n4")]


def test_a_frozen_node_is_lost_though_its_slurmd_takes_the_connect():
    # frozen: the kernel still completes the probe's TCP connect; Slurm says NOT_RESPONDING.
    # The relaunch's warm kill must not wait on its zygote (the 10 s answer timeout).
    states = {"n3": "MIXED+NOT_RESPONDING", "n2": "MIXED"}
    assert lost_nodes(NODES, UP, states) == ["n3"]
    assert lost_nodes(NODES, {**UP, "n4": False}, states) == ["n3", "n4"]
    assert lost_nodes(NODES, UP, {"n2": "MIXED"}) == []
    faults = find_faults(NODES, exit_code=None, reachable=UP, states=states, now=1.0)
    assert [(f.kind, f.node) for f in faults] == [(FaultKind.NODE_UNHEALTHY, "n3")]


def test_nonzero_exit_on_healthy_nodes_is_one_process_fault():
    faults = find_faults(NODES, exit_code=1, reachable=UP, states={}, now=1.0)
    assert len(faults) == 1 and faults[0].kind is FaultKind.PROCESS_DIED
    assert faults[0].node == "n[2-4]" and "exit code 1" in faults[0].detail


def test_exit_zero_with_a_lost_node_is_still_a_fault():
    # srun's exit code after a node failure is unreliable (0 seen): the node decides
    faults = find_faults(NODES, exit_code=0, reachable={**UP, "n2": False}, states={}, now=1.0)
    assert [f.kind for f in faults] == [FaultKind.NODE_LOST]


def test_master_is_first_in_allocation_order_not_list_order():
    assert master_node(["n5", "n3", "n4"], ALLOC) == "n3"


def test_master_port_range_and_changes_per_relaunch():
    ports = {master_port("123456", r) for r in range(5)}
    assert len(ports) == 5 and all(20000 <= p < 30000 for p in ports)
    assert master_port("7", 0) == master_port("7", 0)


def test_srun_argv_torch_mode_wraps_command():
    argv = step_argv(job_id="42", name="sr-restart-1", nodes=["n2", "n5", "n4"], command=["python", "t.py"],
                     mpi=False, master_addr="10.0.0.2", port=20042, attempt=1, python="/usr/bin/python3")
    assert argv[:9] == ["srun", "--no-kill", "--overlap", "-N", "3", "-n", "3", "--ntasks-per-node=1", "-w"]
    assert argv[9] == "n2,n5,n4" and "--jobid=42" in argv and "--mpi=pmix" not in argv
    assert "--kill-on-bad-exit=0" in argv  # a torch step is not ended by Slurm at a rank's death
    tail = argv[argv.index("--") + 1:]
    assert tail == ["/usr/bin/python3", "-m", "slurm_resilience.rankenv", "--master-addr", "10.0.0.2",
                    "--master-port", "20042", "--restart", "1", "--", "python", "t.py"]


def test_srun_argv_mpi_mode_runs_command_directly():
    argv = step_argv(job_id="42", name="s", nodes=["n2"], command=["python", "m.py"], mpi=True,
                     master_addr="x", port=1, attempt=0)
    assert argv[-4:] == ["--mpi=pmix", "--", "python", "m.py"]


def test_srun_argv_rejects_hostile_node_name():
    with pytest.raises(ValueError):
        step_argv(job_id="1", name="s", nodes=["n2;rm -rf /"], command=["x"], mpi=True, master_addr="x",
                  port=1, attempt=0)


SLURM = {"SLURM_PROCID": "2", "SLURM_LOCALID": "0", "SLURM_NTASKS": "3", "SLURM_NODEID": "2",
         "SLURM_NTASKS_PER_NODE": "1(x3)"}


def test_rank_env_maps_slurm_to_torchrun():
    env = rank_env(SLURM, master_addr="10.0.0.2", master_port=20042, restart=2)
    assert env == {"RANK": "2", "LOCAL_RANK": "0", "WORLD_SIZE": "3", "GROUP_RANK": "2", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "10.0.0.2", "MASTER_PORT": "20042", "SR_RESTART": "2"}


def test_rank_env_outside_slurm_is_a_clear_error():
    with pytest.raises(ValueError, match="missing SLURM_PROCID"):
        rank_env({}, master_addr="a", master_port=1, restart=0)


# ---------------------------------------------------------------- the loop, with a fake srun and launcher

FAKE_SRUN = f"""#!{sys.executable}
import json, os, sys, time
d = os.environ["FAKE_SRUN_DIR"]
n = len(os.listdir(d))
open(os.path.join(d, f"{{n}}.json"), "w").write(json.dumps({{"argv": sys.argv[1:], "restart": os.environ["SR_RESTART"]}}))
codes = os.environ["FAKE_SRUN_CODES"].split(",")
code = codes[min(n, len(codes) - 1)]
if code == "hang":
    time.sleep(60)
if code == "train":  # the program's rank 0 trains step 11 (docs/restart.md: SR_PROGRESS_FILE) and ends
    open(os.environ["SR_PROGRESS_FILE"], "a").write(f"11 {{time.time():.6f}}\\n")
    code = 0
if code == "badexit":  # srun --kill-on-bad-exit=1 after MPI rank 1 was SIGKILLed
    sys.stderr.write("srun: error: n3: task 1: Killed\\nsrun: error: n2: task 0: Terminated\\n")
    code = 143
if code == "stall":  # an MPI program whose rank 1 is stopped after step 3: the others wait in MPI
    for step in (1, 2, 3):
        open(os.environ["SR_PROGRESS_FILE"], "a").write(f"{{step}} {{time.time():.6f}}\\n")
        time.sleep(0.02)
    time.sleep(60)
if code == "print":  # a program that only prints its steps (run.step_pattern)
    print("restart 1: world 3, from step 10")
    print("step 11 loss 0.25", flush=True)
    code = 0
sys.exit(int(code))
"""
# a node lost, the step relaunched on the spare, the relaunched program's first step ends the recovery
RECOVERED = ["job_start", "fault_detected", "ladder", "recovery_start", "relaunch", "phase", "phase", "phase",
             "phase", "recovery_done", "job_done"]


class FakeLauncher:
    def __init__(self):
        self.down: set[str] = set()
        self.isolated: list[tuple[str, str, str]] = []
        self.killed: list[str] = []

    def node_reachable(self, node, timeout_s):
        return node not in self.down

    def node_states(self, nodes):
        return {n: "MIXED" for n in nodes}

    def isolate(self, node, state, reason):
        self.isolated.append((node, state, reason))

    def address(self, node):
        return "127.0.0.1"

    def kill(self, step):
        self.killed.append(step.name)
        if step.process.poll() is None:
            step.process.kill()


@pytest.fixture
def fake_srun(tmp_path, monkeypatch):
    bindir, calls = tmp_path / "bin", tmp_path / "calls"
    bindir.mkdir()
    calls.mkdir()
    srun = bindir / "srun"
    srun.write_text(FAKE_SRUN)
    srun.chmod(stat.S_IRWXU)
    monkeypatch.setenv("PATH", f"{bindir}:{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_SRUN_DIR", str(calls))

    def launches():
        return [json.loads((calls / f"{i}.json").read_text()) for i in range(len(list(calls.iterdir())))]
    return launches


def _supervisor(tmp_path, launcher, spares=("n5",), retries=3, out=None, step_pattern="", mpi=False, detect=None):
    cfg = load_config({"recovery": {"fault_retry_times": retries}, "detect": {"node_poll_s": 0.1, **(detect or {})},
                       "run": {"warm": False, "step_pattern": step_pattern}})  # the cold srun path; warm: tests/e2e/test_warm_restart_slurm.py
    lay = layout(["n1", "n2", "n3", "n4", *spares], "n1", 3)
    return RelaunchExecutor(config=cfg, command=["python", "t.py"], job_dir=str(tmp_path / "job"), job_id="77",
                             layout=lay, allocation=["n1", "n2", "n3", "n4", *spares], launcher=launcher,
                             poll_s=0.02, probe_every_s=0.05, out=out, mpi=mpi)


def _kinds(tmp_path):
    return [e["kind"] for e in read_events(str(tmp_path / "job" / "events.jsonl"))]


@pytest.mark.timeout(30)
def test_loop_node_lost_relaunches_on_spare(tmp_path, fake_srun, monkeypatch):
    monkeypatch.setenv("FAKE_SRUN_CODES", "hang,train")
    launcher, out = FakeLauncher(), io.StringIO()
    threading.Timer(0.3, launcher.down.add, ["n3"]).start()
    assert _supervisor(tmp_path, launcher, out=out).run() == 0
    first, second = fake_srun()
    assert first["argv"][first["argv"].index("-w") + 1] == "n2,n3,n4" and first["restart"] == "0"
    assert second["argv"][second["argv"].index("-w") + 1] == "n2,n4,n5" and second["restart"] == "1"
    assert "--restart" in second["argv"] and second["argv"][second["argv"].index("--restart") + 1] == "1"
    assert launcher.killed == ["sr-restart-0"]
    assert [i[:2] for i in launcher.isolated] == [("n3", "DOWN")]
    # isolation runs in the background: its event comes whenever scontrol returns
    assert [k for k in _kinds(tmp_path) if k != "isolated"] == RECOVERED
    assert _kinds(tmp_path).count("isolated") == 1
    # supervisor.log: the lines a Session job's supervisor writes, in its order
    said = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    lines = [next(i for i, t in enumerate(said) if t.startswith(p)) for p in (
        "job started: 3 ranks on n2,n3,n4", "fault: rank 1 on n3: NODE_LOST",
        "recovery 1: node-replacement, relaunching the step (relaunch 1) on n2,n4,n5",
        "recovery 1: relaunch 1 started on n2,n4,n5", "recovery 1 done: relaunch 1 trained a step",
        "job finished after 1 recovery")]
    assert lines == sorted(lines) and any(t.startswith("isolated node n3") for t in said), said
    events = read_events(str(tmp_path / "job" / "events.jsonl"))
    phases = [e["phase"] for e in events if e["kind"] == "phase"]
    assert phases == ["classify", "replace", "ranktable", "first_step"]
    done = next(e for e in events if e["kind"] == "recovery_done")
    assert done["step"] == 11 and done["first_step"] >= done["detected"] and done["level"] == "node-replacement"
    status = json.loads((tmp_path / "job" / "status.json").read_text())
    assert status["phase"] == "SUCCEEDED" and status["nodes"] == ["n2", "n4", "n5"]  # allocation order


@pytest.mark.timeout(30)
@pytest.mark.parametrize("pattern, step", [(r"^step (?P<step>\d+) loss", 11), (r"loss", None), ("", None)])
def test_loop_first_step_from_the_programs_output_with_run_step_pattern(tmp_path, fake_srun, monkeypatch,
                                                                         pattern, step):
    monkeypatch.setenv("FAKE_SRUN_CODES", "hang,print")
    (tmp_path / "job").mkdir()
    (tmp_path / "job" / "step-001.log").write_text("step 99 loss 1.0\n")  # a reused job dir's: not this step's
    launcher = FakeLauncher()
    threading.Timer(0.3, launcher.down.add, ["n3"]).start()
    assert _supervisor(tmp_path, launcher, step_pattern=pattern).run() == 0
    done = [e for e in read_events(str(tmp_path / "job" / "events.jsonl")) if e["kind"] == "recovery_done"]
    if not pattern:  # SR_PROGRESS_FILE only: no first step, the recovery closes unfinished at the end
        assert done == [] and _kinds(tmp_path).count("phase") == 3
    else:
        assert len(done) == 1 and done[0].get("step") == step


@pytest.mark.timeout(30)
def test_loop_no_spare_left_exits_3_with_one_line(tmp_path, fake_srun, monkeypatch, capsys):
    monkeypatch.setenv("FAKE_SRUN_CODES", "hang")
    launcher = FakeLauncher()
    threading.Timer(0.2, launcher.down.add, ["n2"]).start()
    assert _supervisor(tmp_path, launcher, spares=()).run() == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slurm-resilience: error: node n2 lost and no spare left")
    assert [k for k in _kinds(tmp_path) if k != "isolated"] == ["job_start", "fault_detected", "ladder",
                                                                 "job_failed"]
    assert _kinds(tmp_path).count("isolated") == 1


@pytest.mark.timeout(30)
def test_loop_process_death_restarts_in_place_within_budget(tmp_path, fake_srun, monkeypatch):
    monkeypatch.setenv("FAKE_SRUN_CODES", "1")
    launcher = FakeLauncher()
    assert _supervisor(tmp_path, launcher, retries=2).run() == 3
    launches = fake_srun()
    assert len(launches) == 3  # first try + 2 relaunches
    assert {tuple(c["argv"][c["argv"].index("-w") + 1:][:1]) for c in launches} == {("n2,n3,n4",)}
    assert launcher.isolated == []
    assert _kinds(tmp_path).count("relaunch") == 2 and _kinds(tmp_path)[-1] == "job_failed"


@pytest.mark.timeout(30)
def test_loop_mpi_rank_death_ends_the_step_and_names_the_rank(tmp_path, fake_srun, monkeypatch):
    # an MPI step ends at its first bad task exit (survivors would block in MPI forever);
    # srun's own line names the root cause, and the step is relaunched in place
    monkeypatch.setenv("FAKE_SRUN_CODES", "badexit,train")
    launcher, out = FakeLauncher(), io.StringIO()
    assert _supervisor(tmp_path, launcher, out=out, mpi=True).run() == 0
    first, second = fake_srun()
    assert "--kill-on-bad-exit=1" in first["argv"] and "--kill-on-bad-exit=0" not in first["argv"]
    assert second["argv"][second["argv"].index("-w") + 1] == "n2,n3,n4" and launcher.isolated == []
    said = out.getvalue()
    assert "PROCESS_DIED" in said and "step exit code 143; first bad exit: n3 task 1: Killed" in said, said
    assert "recovery 1: process-restart" in said and "recovery 1 done" in said


@pytest.mark.timeout(30)
def test_loop_mpi_step_without_progress_past_the_hard_timeout_is_hung_and_relaunched(tmp_path, fake_srun,
                                                                                      monkeypatch):
    # a stopped rank ends nothing: the step's progress lines stop; past the hard step
    # timeout the step is a PROCESS_HUNG fault, killed (its own step) and relaunched in place
    monkeypatch.setenv("FAKE_SRUN_CODES", "stall,train")
    fast = {"heartbeat_period_s": 0.1, "heartbeat_timeout_s": 0.3, "slurmd_probe_deadline_s": 0.2,
            "progress_soft_s": 0.4, "progress_hard_s": 0.5}
    launcher, out = FakeLauncher(), io.StringIO()
    assert _supervisor(tmp_path, launcher, out=out, mpi=True, detect=fast).run() == 0
    assert len(fake_srun()) == 2 and launcher.killed == ["sr-restart-0"] and launcher.isolated == []
    said = out.getvalue()
    assert "fault: the step on n[2-4]: PROCESS_HUNG (no progress line for" in said, said
    assert "past the hard step timeout 0.5 s" in said and "recovery 1 done" in said
