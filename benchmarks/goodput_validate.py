#!/usr/bin/env python3
"""Validate the goodput model against real jobs with faults injected at a known rate.

Local mode: a real ``Supervisor`` with ``LocalLauncher`` (real worker processes,
real gloo process groups over loopback, no Slurm) trains ``examples/train_mlp.py``.
First a fault-free control run measures the step time on this box; then, per mean
time between faults (``--mtbf-s``), a run of about ``--train-s`` seconds of
fault-free work gets SIGKILLs of a random rank's process at the arrivals of a
seeded Poisson process. A killed process on a healthy node is restarted in place
(the ladder's online level; the restart budget is set high enough that every kill
stays online and no spare is used).

From each run's ``events.jsonl``: the training window, the recovery phases and
the observed ETTR (see ``slurm_resilience/simulate/measured.py`` for the exact
definitions). Predictions: ``validate_against_run`` (closed form) and the
discrete-event ``simulate`` replaying the injected fault times; for scale, the
spread of ``simulate`` over random placements of the same number of faults (the
closed form's luck) and its mean ± std over Poisson draws at the same rate (a
prediction from the rate alone).

Run it on an otherwise quiet box: restarts are process starts (``import torch``),
and their time is most of each recovery.

    python3 benchmarks/goodput_validate.py --mtbf-s 8
    python3 benchmarks/goodput_validate.py --mtbf-s 8 15 --train-s 60 --json out.json
    python3 benchmarks/goodput_validate.py --reanalyse out.json   # kept runs, analysed again
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from slurm_resilience.config import ResilienceConfig, load_config  # noqa: E402
from slurm_resilience.events import read_events  # noqa: E402
from slurm_resilience.launch.localhost import LocalLauncher  # noqa: E402
from slurm_resilience.protocol import WorkerEvent  # noqa: E402
from slurm_resilience.simulate.goodput import (  # noqa: E402
    Cluster, FailureCategory, FailureModel, FaultClass, RecoveryPath, Rollback, Strategy,
    CheckpointSpec, simulate, summarize, validate_against_run,
)
from slurm_resilience.simulate.measured import (  # noqa: E402
    mean_phases_ms, observed_ettr, poisson_schedule, productive_step_time, recovery_phases_ms, training_window,
)
from slurm_resilience.run_identity import new_run_id  # noqa: E402
sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402
from slurm_resilience.supervisor.executors.online import Supervisor  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
TRAIN = REPO / "examples" / "train_mlp.py"
KILL = "SIGKILL rank"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=3, help="ranks (one process each)")
    p.add_argument("--step-time", type=float, default=0.1, help="emulated compute per step (s)")
    p.add_argument("--control-steps", type=int, default=250, help="steps of the fault-free control run")
    p.add_argument("--train-s", type=float, default=80.0,
                   help="fault-free training time of each faulted run (steps = this / control step time)")
    p.add_argument("--mtbf-s", type=float, nargs="+", default=[8.0],
                   help="mean time between injected faults (s); one faulted run each")
    p.add_argument("--checkpoint-every", type=int, default=10, help="L0/L1 checkpoint every N steps")
    p.add_argument("--collective-at", type=float, default=0.0,
                   help="where in a step the gradient all-reduce sits (fraction); train_mlp.py sleeps its"
                        " emulated compute after the update: 0 (see Strategy.collective_at)")
    p.add_argument("--seed", type=int, default=0, help="fault schedule and victim choice")
    p.add_argument("--sim-seeds", type=int, default=200, help="simulated runs for the Poisson and placement spreads")
    p.add_argument("--timeout-s", type=float, default=300.0,
                   help="per run; a run whose restarts outlast the fault interval may never finish")
    p.add_argument("--work-dir", type=Path, help="keep the job directories here (default: a temp dir)")
    p.add_argument("--json", type=Path, help="write the results here")
    p.add_argument("--reanalyse", type=Path, metavar="JSON",
                   help="run nothing: analyse again the runs a --json file and its work dir describe")
    return p.parse_args(argv)


@dataclass(frozen=True)
class Injection:
    t: float
    node: str | None
    pid: int | None


@dataclass(frozen=True)
class Run:
    job_dir: Path
    code: int
    events: list[dict]
    injections: list[Injection] = field(default_factory=list)
    load: tuple[float, float] = (0.0, 0.0)
    """1-minute load average at the start and the end (the box is shared)."""


def _config(a: argparse.Namespace, root: Path) -> ResilienceConfig:
    return load_config({
        "job": {"nodes": a.ranks, "spares": 0},
        # Every kill stays a restart in place: the budget never runs out.
        "recovery": {"fault_retry_times": 1_000_000},
        "reconnect": {"gloo_ifname": "lo"},
        "checkpoint": {"memory_every": a.checkpoint_every, "local_every": a.checkpoint_every,
                       "local_dir": str(root / "local" / "{node}" / "ckpt")},
    })


class _Launcher(LocalLauncher):
    """LocalLauncher that can be shut: no launch after ``close()``, which kills
    (SIGKILL, by its Popen) every process this job started that is still running."""

    def __init__(self) -> None:
        super().__init__()
        self._closed = threading.Event()

    def launch(self, **kw):
        if self._closed.is_set():
            raise RuntimeError("the benchmark stopped this job")
        return super().launch(**kw)

    def close(self) -> None:
        self._closed.set()
        for step in list(self.steps):
            if step.process.poll() is None:
                step.process.kill()
                step.process.wait(timeout=10)


def run_job(a: argparse.Namespace, root: Path, name: str, steps: int,
            schedule: tuple[float, ...] = (), seed: int = 0) -> Run:
    """Train ``steps`` steps; SIGKILL a random live rank process at each ``schedule``
    offset (seconds after every rank finished its first step)."""
    launcher = _Launcher()
    job_dir = root / name
    deadline = time.monotonic() + a.timeout_s
    with open(root / f"{name}.log", "w") as log:
        sup = Supervisor(
            config=_config(a, root / name),
            command=[sys.executable, str(TRAIN), "--steps", str(steps), "--step-time", str(a.step_time)],
            job_dir=str(job_dir), nodes=[f"local{i}" for i in range(1, a.ranks + 1)],
            launcher=launcher, store_host="127.0.0.1", job_id=name, out=log, run_id=new_run_id())
        result: dict[str, int] = {}
        thread = threading.Thread(target=lambda: result.update(code=sup.run()), daemon=True)
        injections: list[Injection] = []
        load0 = os.getloadavg()[0]
        thread.start()
        try:
            if schedule:
                quiet_from = steps - 2 * a.checkpoint_every
                _inject(job_dir, launcher, thread, schedule, random.Random(seed), injections, deadline, quiet_from)
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive():
                raise TimeoutError(f"{name}: still running after {a.timeout_s:g} s (see {root / name}.log)")
        finally:
            launcher.close()
            thread.join(30)
    return Run(job_dir=job_dir, code=result.get("code", -1),
               events=read_events(str(job_dir / "events.jsonl")), injections=injections,
               load=(load0, os.getloadavg()[0]))


def _status(job_dir: Path) -> dict | None:
    try:
        return json.loads((job_dir / "status.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _inject(job_dir: Path, launcher: LocalLauncher, thread: threading.Thread, schedule: tuple[float, ...],
            rng: random.Random, out: list[Injection], deadline: float, quiet_from: int) -> None:
    """Kill at the schedule's times until a rank reaches step ``quiet_from``: a fault
    while ranks finish can leave the job waiting on a rank that already exited
    (see docs/goodput.md), so the last two checkpoint intervals are fault-free."""
    while thread.is_alive() and time.monotonic() < deadline:
        st = _status(job_dir)
        if st and st["ranks"] and all(r["pid"] and r["step"] >= 1 for r in st["ranks"]):
            break
        time.sleep(0.05)
    t0 = time.time()
    for offset in schedule:
        while thread.is_alive() and time.time() < t0 + offset and time.monotonic() < deadline:
            time.sleep(min(0.01, max(0.0, t0 + offset - time.time())))
        if not thread.is_alive() or time.monotonic() >= deadline:
            return
        st = _status(job_dir)
        if st and max((r["step"] for r in st["ranks"]), default=0) >= quiet_from:
            return
        # Any live process this job started is a rank of the current table (no
        # spares; fenced processes exit on their own), a restarting one included.
        alive = [ls for ls in list(launcher.steps) if ls.process.poll() is None]
        if not alive:
            out.append(Injection(t=time.time(), node=None, pid=None))
            continue
        victim = rng.choice(alive)
        t = time.time()
        victim.process.send_signal(signal.SIGKILL)
        out.append(Injection(t=t, node=victim.node, pid=victim.process.pid))


def analyse(a: argparse.Namespace, run: Run, control_step_s: float, mtbf: float) -> dict:
    """Observed ETTR, the measured phases and the three predictions for one faulted run."""
    if run.code != 0:
        raise RuntimeError(f"{run.job_dir}: the job ended with exit code {run.code}")
    win = training_window(run.events)
    kills = [i.t for i in run.injections if i.pid is not None and win.start <= i.t < win.end]
    rows = recovery_phases_ms(run.events, kills)
    phases = mean_phases_ms(rows)
    # The fault-free step time of this run's own stretches of training (the load of
    # a shared box drifts between runs); the control's is the cross-check.
    st = productive_step_time(run.events, kills, collective_at=a.collective_at)
    step_s = st.step_s
    stalls = [e["stall_ms"] for e in run.events if e["kind"] == WorkerEvent.CHECKPOINT_SAVED.logged]
    seen = observed_ettr(steps=win.steps, step_time_s=step_s, wall_s=win.wall_s)
    v = validate_against_run({
        "wall_time_s": win.wall_s, "faults": len(kills), "phases_ms": phases, "step_time_s": step_s,
        "checkpoint_interval_s": a.checkpoint_every * step_s, "fault_class": "process",
        "collective_at": a.collective_at, "ettr": seen,
    })
    # The discrete-event model of the same run: one process-fault category at the
    # injected rate, restart in place costing the measured downtime.
    path = RecoveryPath(name="restart in place", downtime_s=v["downtime_per_fault_s"], rollback=Rollback.STEP)
    strategy = Strategy(name="toolkit (measured)", step_time_s=step_s, collective_at=a.collective_at,
                        checkpoint=CheckpointSpec(interval_s=a.checkpoint_every * step_s, cost_s=0.0),
                        on_node=path, on_process=path, on_hang=path, on_no_spare=path)
    model = FailureModel(categories=(FailureCategory(name=KILL, share=1.0, fault_class=FaultClass.PROCESS),),
                         interruptions=1.0, period_s=mtbf, reference_gpus=1)
    cluster = Cluster(gpus=1, gpus_per_node=1)
    replay = simulate(cluster, model, strategy, win.wall_s, injected=[(t - win.start, KILL) for t in kills])
    poisson = summarize([simulate(cluster, model, strategy, win.wall_s, seed=s) for s in range(a.sim_seeds)])
    # The same number of faults placed uniformly at random: the closed form's
    # assumption, so its mean should match it; the spread is the placement's luck.
    rng = np.random.default_rng(a.seed)
    placed = summarize([simulate(cluster, model, strategy, win.wall_s,
                                 injected=[(t, KILL) for t in np.sort(rng.uniform(0, win.wall_s, len(kills)))])
                        for _ in range(a.sim_seeds)])
    return {
        "mtbf_s": mtbf, "job_dir": str(run.job_dir), "steps": win.steps, "wall_s": win.wall_s, "load_avg_1m": run.load,
        "step_s": step_s, "stretches": st.stretches, "stretches_left_out": st.left_out,
        "checkpoint_stalls_over_1s": sorted(round(x / 1000, 2) for x in stalls if x > 1000),
        "checkpoints_failed": sum(1 for e in run.events if e["kind"] == WorkerEvent.CHECKPOINT_FAILED.logged),
        "observed_ettr_control_step": observed_ettr(steps=win.steps, step_time_s=control_step_s,
                                                                      wall_s=win.wall_s),
        "faults_injected": len(kills), "kills_skipped": sum(1 for i in run.injections if i.pid is None),
        "recoveries_done": len(rows), "phases_ms": phases, "downtime_per_fault_s": v["downtime_per_fault_s"],
        "observed_ettr": seen, "predicted_ettr_closed_form": v["predicted_ettr"],
        "predicted_ettr_replay": replay.ettr, "replay_lost_work_s": replay.lost_work_s,
        "predicted_ettr_poisson_mean": poisson["ettr_mean"], "predicted_ettr_poisson_std": poisson["ettr_std"],
        "predicted_ettr_placed_mean": placed["ettr_mean"], "predicted_ettr_placed_std": placed["ettr_std"],
        "kills": [{"t": i.t - win.start, "node": i.node, "pid": i.pid} for i in run.injections],
    }


def print_run(r: dict) -> None:
    lo, hi = r["load_avg_1m"]
    print(f"mtbf {r['mtbf_s']:g} s: {r['faults_injected']} kills ({r['kills_skipped']} found no live rank) in"
          f" {r['wall_s']:.1f} s, {r['recoveries_done']} recoveries not superseded; mean phases (ms) "
          + ", ".join(f"{k} {v:.0f}" for k, v in r["phases_ms"].items()) + f"; load average {lo:.1f} -> {hi:.1f}")
    print(f"  step time {1000 * r['step_s']:.1f} ms from {r['stretches'] - r['stretches_left_out']} of"
          f" {r['stretches']} stretches of training; checkpoint writes failed {r['checkpoints_failed']},"
          f" stalls over 1 s: {r['checkpoint_stalls_over_1s'] or 'none'}", flush=True)


def print_table(results: list[dict]) -> None:
    print(f"\n{'MTBF s':>7} {'kills':>5} {'wall s':>7} {'step ms':>7} {'D s':>5} {'observed':>9}"
          f" {'closed form':>11} {'± placed':>8} {'diff pp':>7} {'DES replay':>10} {'diff pp':>7}"
          f" {'DES Poisson mean':>16} {'obs, control step':>17}")
    for r in results:
        o = r["observed_ettr"]
        print(f"{r['mtbf_s']:>7g} {r['faults_injected']:>5} {r['wall_s']:>7.1f} {1000 * r['step_s']:>7.1f}"
              f" {r['downtime_per_fault_s']:>5.2f} {o:>9.4f}"
              f" {r['predicted_ettr_closed_form']:>11.4f} {r['predicted_ettr_placed_std']:>8.4f}"
              f" {100 * (o - r['predicted_ettr_closed_form']):>+7.2f}"
              f" {r['predicted_ettr_replay']:>10.4f} {100 * (o - r['predicted_ettr_replay']):>+7.2f}"
              f" {r['predicted_ettr_poisson_mean']:>8.4f} ± {r['predicted_ettr_poisson_std']:.4f}"
              f" {r['observed_ettr_control_step']:>17.4f}")


def reanalyse(a: argparse.Namespace) -> list[dict]:
    """The results of kept runs, analysed with this code (kill times come from the JSON)."""
    saved = json.loads(a.reanalyse.read_text())
    for k in ("seed", "collective_at", "checkpoint_every", "sim_seeds"):  # as the runs had them
        setattr(a, k, type(getattr(a, k))(saved["args"][k]))
    out = []
    for r in saved["runs"]:
        events = read_events(str(Path(r["job_dir"]) / "events.jsonl"))
        start = training_window(events).start
        kills = [Injection(t=k["t"] + start, node=k["node"], pid=k["pid"]) for k in r["kills"]]
        run = Run(job_dir=Path(r["job_dir"]), code=0, events=events, injections=kills,
                  load=tuple(r["load_avg_1m"]))
        out.append(analyse(a, run, saved["control"]["step_s"], r["mtbf_s"]))
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    if a.reanalyse:
        results = reanalyse(a)
        for r in results:
            print_run(r)
        print_table(results)
        return 0
    # SIGTERM (e.g. timeout(1)) unwinds through the launchers' close(): no orphans.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    # The workers import the package from this checkout, like the supervisor here.
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    root = a.work_dir or Path(tempfile.mkdtemp(prefix="sr-goodput-"))
    root.mkdir(parents=True, exist_ok=True)
    t_all = time.monotonic()
    control = run_job(a, root, "control", a.control_steps)
    if control.code != 0:
        raise RuntimeError(f"the control run ended with exit code {control.code} (see {root}/control.log)")
    cw = training_window(control.events)
    step_s = cw.wall_s / cw.steps
    print(f"control: {cw.steps} steps in {cw.wall_s:.2f} s -> fault-free step time {step_s * 1000:.1f} ms"
          f" (emulated compute {a.step_time * 1000:.0f} ms: nominal ETTR {cw.steps * a.step_time / cw.wall_s:.3f});"
          f" load average {control.load[0]:.1f} -> {control.load[1]:.1f}", flush=True)
    results = []
    for i, mtbf in enumerate(a.mtbf_s):
        steps = max(1, round(a.train_s / step_s))
        schedule = poisson_schedule(mean_interval_s=mtbf, horizon_s=10 * a.train_s + 60, seed=a.seed + i)
        run = run_job(a, root, f"faults-mtbf{mtbf:g}", steps, schedule, seed=a.seed + i)
        r = analyse(a, run, step_s, mtbf)
        results.append(r)
        print_run(r)
    print_table(results)
    print("(observed = steps x step ms / training window; step ms from the run's own stretches of training;"
          f" last column with the control's {step_s * 1000:.1f} ms; work dir {root}; {time.monotonic() - t_all:.0f} s)")
    if a.json:
        a.json.write_text(json.dumps(stamped({"control": {"steps": cw.steps, "wall_s": cw.wall_s, "step_s": step_s,
                                                          "load_avg_1m": control.load},
                                              "runs": results, "args": {k: str(v) for k, v in vars(a).items()}},
                                             __file__), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
