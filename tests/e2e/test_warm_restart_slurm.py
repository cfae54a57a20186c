"""End to end on the real local Slurm: warm relaunches of unmodified programs (the zygotes).

1. Equivalence: the same unmodified probe script runs as the relaunch executor's cold
   srun step and forked by the zygotes (``supervisor/adapters/warm.py``) in one allocation, 2
   ranks per node, three endings (exit 0, exit 3, an uncaught exception); what each
   rank observes must be equal but for the variables listed in :data:`DIFFERS`.
2. A node lost under ``slurm-resilience run`` with the zygotes up: every generation is
   forked by the zygotes (no ``srun`` step imports torch), the relaunch puts the spare
   in the lost node's slot, and the final weights equal a cold (``run.warm: false``)
   fault-free run's bit for bit.
"""

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from slurm_resilience import lab
from slurm_resilience.slurm import commands

from .test_restart_slurm import ENV, TORCH_EXAMPLE, _check_recovered, _finish, _kill_after_first_snapshot

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent
# What legitimately differs between a cold task and a forked one: the step's id and
# the srun client's ports (no srun step exists for a warm rank), slurmstepd's own
# per-task extras, the task's PID, and the agent-store flag (a warm step's store is hosted
# by node 0's zygote before the ranks start). Everything else must be equal.
DIFFERS = {"SLURM_STEP_ID", "SLURM_STEPID", "SLURM_TASK_PID", "SLURM_SRUN_COMM_PORT", "SLURM_STEP_LAUNCHER_PORT",
           "SLURM_STEP_RESV_PORTS", "SLURM_LAUNCH_NODE_IPADDR", "SLURM_SRUN_COMM_HOST", "SLURM_PRIO_PROCESS",
           "SLURM_CPU_BIND", "SLURM_CPU_BIND_LIST", "SLURM_CPU_BIND_TYPE", "SLURM_CPU_BIND_VERBOSE",
           "SLURM_DISTRIBUTION", "SLURM_CPUS_PER_TASK",
           "TORCHELASTIC_USE_AGENT_STORE"}  # warm only: env:// connects to the zygote's store host


def _sbatch_wait(argv: list[str], out: Path, timeout: float = 240) -> None:
    job = commands.run(["sbatch", "--parsable", *argv], timeout=30).stdout.strip().split(";")[0]
    deadline = time.time() + timeout
    while commands.job_state(job) is not None:
        assert time.time() < deadline, f"job {job} still running"
        time.sleep(0.3)


def test_cold_and_warm_ranks_observe_the_same(cluster, jobs_root):
    out = jobs_root / "zygote-equiv"
    out.mkdir(mode=0o700)
    _sbatch_wait(["-N", "3", "--ntasks-per-node=2", f"--output={out}/batch.log", "--wrap",
                  f"{sys.executable} {HERE / 'zygote_equiv_driver.py'} {out}"], out)
    assert (out / "codes.json").exists(), (out / "batch.log").read_text()
    codes = json.loads((out / "codes.json").read_text())
    assert codes["cold-ok"] == codes["warm-ok"] == 0
    assert codes["cold-exit3"] == codes["warm-exit3"] == 3
    assert codes["cold-raise"] != 0 and codes["warm-raise"] == 1
    assert set(codes["warm-raise-ranks"].values()) == {1} and set(codes["warm-exit3-ranks"].values()) == {3}
    for case in ("ok", "exit3", "raise"):
        groups = {}
        for mode in ("cold", "warm"):  # process groups and sessions, as relations between the ranks
            ids = [json.loads((out / f"{mode}-{case}-{r}.json").read_text())["ids"] for r in range(4)]
            pids = [i["pid"] for i in ids]
            groups[mode] = [(pids.index(i["pgid"]) if i["pgid"] in pids else None,
                             pids.index(i["sid"]) if i["sid"] in pids else None) for i in ids]
        assert groups["warm"] == groups["cold"], groups
        for rank in range(4):
            cold = json.loads((out / f"cold-{case}-{rank}.json").read_text())
            warm = json.loads((out / f"warm-{case}-{rank}.json").read_text())
            cold.pop("ids"), warm.pop("ids")
            ce, we = cold.pop("env"), warm.pop("env")
            assert we["RANK"] == str(rank) and we["SR_RESTART"] == ce["SR_RESTART"]
            assert we["TORCHELASTIC_USE_AGENT_STORE"] == "True" and "TORCHELASTIC_USE_AGENT_STORE" not in ce
            diff = {k for k in set(ce) | set(we) if ce.get(k) != we.get(k)}
            assert diff <= DIFFERS, {k: (ce.get(k), we.get(k)) for k in diff - DIFFERS}
            for key in ("argv", "orig_argv"):  # the probe's output path names its mode
                warm[key] = [a.replace(f"warm-{case}", f"cold-{case}") for a in warm[key]]
            # stdin: srun gives a cold task a pipe fed from the executor's /dev/null, a warm rank
            # gets /dev/null itself; both read EOF at once (listed in docs/restart.md)
            assert warm.pop("stdin") == "/dev/null" and cold.pop("stdin").startswith(("/dev/null", "/proc/", "pipe:"))
            assert warm == cold, (case, rank)
        for mode in ("cold", "warm"):  # stdout and stderr of every rank land in the step's log
            log = (out / f"{mode}-{case}.log").read_text()
            for rank in range(4):
                assert f"probe stdout rank {rank}" in log and f"probe stderr rank {rank}" in log, (mode, log)
            if case == "raise":
                assert log.count("RuntimeError: probe: uncaught") == 4, (mode, log)
                assert "zygote.py" not in log  # the traceback starts at the script, as cold


def _run(root: Path, *, warm: bool) -> tuple[subprocess.Popen, Path]:
    out = root / "final.pt"
    root.mkdir(parents=True)
    cfg = root / "config.yaml"
    cfg.write_text(f"run:\n  warm: {'true' if warm else 'false'}\n")
    argv = [sys.executable, "-m", "slurm_resilience.cli", "run", "--wait", "--config", str(cfg), "--nodes", "3",
            "--spares", "1", "--job-dir", str(root / "job"),
            "--", sys.executable, str(TORCH_EXAMPLE), "--steps", "40", "--ckpt", str(root / "ckpt"), "--out", str(out)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, **ENV}), out


def test_warm_relaunch_on_spare_identical_to_cold_fault_free_run(cluster, jobs_root):
    import torch

    ref_root = jobs_root / "warm-ref-cold"
    proc, ref = _run(ref_root, warm=False)
    assert _finish(proc, ref_root) == 0, proc.output
    assert not list((ref_root / "job").glob("zygote-*.log"))  # run.warm: false starts none

    lab.cluster("reset")
    root = jobs_root / "warm-node-loss"
    proc, out = _run(root, warm=True)
    victim = _kill_after_first_snapshot(root, "snapshot.pt")
    assert _finish(proc, root) == 0, proc.output
    _check_recovered(root, victim)
    # both generations were forked by the zygotes: gen 0 on the workers, gen 1 with n5 in the lost slot
    forked = {p.name: p.read_text() for p in (root / "job").glob("zygote-*.log")}
    assert re.search(r"forked rank \d as pid \d+ \(sr-restart-1\)", forked["zygote-n5.log"]), forked
    assert sum(len(re.findall(r"\(sr-restart-0\)", t)) for t in forked.values()) == 3, forked
    assert sum(len(re.findall(r"\(sr-restart-1\)", t)) for t in forked.values()) == 3, forked
    ref_state, got = torch.load(ref, weights_only=False), torch.load(out, weights_only=False)
    assert got["step"] == ref_state["step"] == 40
    for name, tensor in ref_state["model"].items():
        assert torch.equal(tensor, got["model"][name]), name
    for a, b in zip(ref_state["optimizer"]["state"].values(), got["optimizer"]["state"].values()):
        assert torch.equal(a["momentum_buffer"], b["momentum_buffer"])
