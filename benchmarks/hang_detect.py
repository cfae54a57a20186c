#!/usr/bin/env python3
"""How fast the watchdog finds a rank whose main thread blocks while its heartbeat beats on.

A real Supervisor with LocalLauncher (3 ranks + 1 spare on localhost, gloo,
examples/train_mlp.py, the tests/local job's shape). Once every rank has done
--inject-after steps the injector writes rank 1's worker id into the file the script
polls (``--block-file``) and notes the time: rank 1's main thread blocks on a lock
forever at its next step; its process, heartbeat thread and pulse live on, its
peers wait in the gradient all-reduce. Contenders, the same job otherwise, run
interleaved (a slow spell of the shared box hits both alike):

    block   the defaults: a rank every other rank waits on is hung after the blocking
            timeout, max(detect.progress_block_s = 2.5 x heartbeat_timeout_s = 5 s,
            factor/2 x the longest recent step)
    hard    detect.progress_block_s = progress_hard_s: only the hard timeout
            (max(20 s, factor x the longest recent step)), the rule before the blocking
            timeout existed

Per run: fault → fault_detected (``detect_s``), fault → recovery_start, fault → the
first step after the recovery (the last rank's, ``mttr_s``), and the rule named in
the fault's evidence. Median, min, max, the hard/block ratio; --json writes them.
Not a test (tests/local/test_watchdog.py is).

    python3 benchmarks/hang_detect.py --repeats 3 --json /tmp/hang_detect.json
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from figures import emit, stats, utc_now  # noqa: E402
from slurm_resilience.config import load_config  # noqa: E402
from slurm_resilience.events import read_events  # noqa: E402
from slurm_resilience.launch.localhost import LocalLauncher  # noqa: E402
from slurm_resilience.run_identity import new_run_id  # noqa: E402
from slurm_resilience.supervisor.executors.online import Supervisor  # noqa: E402

TRAIN = REPO / "examples" / "train_mlp.py"
CONTENDERS = {"block": {}, "hard": {"progress_block_s": 20.0}}


def run_once(root: Path, detect: dict, args: argparse.Namespace) -> dict:
    cfg = load_config({"reconnect": {"gloo_ifname": "lo"}, "job": {"nodes": 3, "spares": 1},
                       "checkpoint": {"local_dir": str(root / "local" / "{node}/ckpt")},
                       "recovery": {"local_standbys": False}, "detect": detect})
    flag, job_dir, launcher = root / "block", root / "job", LocalLauncher()
    sup = Supervisor(config=cfg, command=[sys.executable, str(TRAIN), "--steps", str(args.steps), "--step-time",
                                          str(args.step_time), "--block-file", str(flag)],
                     job_dir=str(job_dir), nodes=[f"local{i}" for i in range(1, 5)], launcher=launcher,
                     store_host="127.0.0.1", job_id="bench", out=io.StringIO(), run_id=new_run_id())
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(code=sup.run()), daemon=True)
    thread.start()
    try:
        status = _wait_for_step(job_dir, args.inject_after, thread)
        tmp = flag.with_suffix(".tmp")
        tmp.write_text(status["ranks"][1]["worker_id"])
        t_fault = time.time()  # before the rename: the window is never shorter than the truth
        os.replace(tmp, flag)
        thread.join(args.timeout_s)
    finally:
        for step in launcher.steps:  # the workers this run started, by process
            if step.process.poll() is None:
                step.process.kill()
                step.process.wait(timeout=10)
    events = read_events(str(job_dir / "events.jsonl"))
    fault = next((e for e in events if e["kind"] == "fault_detected"), None)
    start = next((e for e in events if e["kind"] == "recovery_start"), None)
    done = next((e for e in events if e["kind"] == "recovery_done"), None)
    detail = fault["fault"]["detail"] if fault else ""
    return {"exit_code": result.get("code"), "detect_s": _since(fault, "t", t_fault),
            "recovery_start_s": _since(start, "t", t_fault), "mttr_s": _since(done, "first_step", t_fault),
            "level": done["level"] if done else None,
            "rule": "blocking" if "blocking timeout" in detail else "hard" if "hard timeout" in detail else detail}


def _since(event: dict | None, key: str, t0: float) -> float | None:
    return round(event[key] - t0, 3) if event and event.get(key) is not None else None


def _wait_for_step(job_dir: Path, step: int, thread: threading.Thread, timeout_s: float = 180.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and thread.is_alive():
        try:
            st = json.loads((job_dir / "status.json").read_text())
        except (FileNotFoundError, json.JSONDecodeError):
            st = None
        if st and all(r["pid"] and r["step"] >= step for r in st["ranks"]):
            return st
        time.sleep(0.05)
    raise RuntimeError(f"the ranks did not pass step {step}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated: block, hard")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--step-time", type=float, default=0.1)
    ap.add_argument("--inject-after", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=200.0, help="per run")
    ap.add_argument("--json", default="")
    args = ap.parse_args()
    names = [n for n in args.contenders.split(",") if n]
    unknown = [n for n in names if n not in CONTENDERS]
    if unknown:
        print(f"unknown contender {unknown[0]!r}; valid: {', '.join(CONTENDERS)}", file=sys.stderr)
        return 2
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="hang-detect-") as tmp:
        for i in range(args.repeats):
            for name in names:  # interleaved
                runs[name].append(run_once(Path(tmp) / f"{name}-{i}", CONTENDERS[name], args))
                print(name, i, runs[name][-1], file=sys.stderr, flush=True)
    out: dict = {"when": utc_now(), "cpus": os.cpu_count(), "load_1m": os.getloadavg()[0],
                 "args": vars(args), "contenders": {n: {"detect": CONTENDERS[n]} for n in names}}
    for name in names:
        for key in ("detect_s", "recovery_start_s", "mttr_s"):
            xs = [r[key] for r in runs[name] if r[key] is not None]
            out["contenders"][name][key] = stats(xs) if xs else None
        out["contenders"][name]["runs"] = runs[name]
    b, h = out["contenders"].get("block"), out["contenders"].get("hard")
    if b and h and b["detect_s"] and h["detect_s"]:
        out["ratio_hard_over_block"] = {k: round(h[k]["median_s"] / b[k]["median_s"], 2)
                                        for k in ("detect_s", "mttr_s") if b[k] and h[k]}
    emit(out, args.json or None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
