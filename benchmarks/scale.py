#!/usr/bin/env python3
"""The control plane at N ranks: the real supervisor and store, simulated ranks.

The real online ``Supervisor`` (watch, detect, the liveness server, decide, publish)
and the job's real TCPStore, each in a process of its own, driven by N simulated ranks
packed into a few processes (``scale_sim/``: each rank speaks the real protocol —
liveness hello, pulse lines, ``hb/{worker}``, events, ``plan/{g}`` — without torch
compute or a process group). For each N (``--sizes``, G ranks per node):

* steady state (``--steady-s``): the supervisor's and the store's CPU share (% of one
  core, from /proc), their memory, store calls per second (counted at every client),
  false alarms (suspects, faults, slow ranks on healthy ranks);
* a node killed (its ranks' sockets closed, slurmd refusing) → plan published;
* a node gone silent (nothing sent, nothing closed, slurmd never answering) → plan;
* plan published → every rank of it has read it; → every rank has joined
  (``reconnected`` sent); → the supervisor has logged the recovery done.

Median, min and max over ``--repeats``; JSON (``--json``), a growth plot (``--plot``,
N on a log axis; skipped without matplotlib) and a Markdown table (``--markdown``);
``--replot A.json B.json`` draws and tabulates earlier runs side by side (one line per
``--label``).
The slurm_resilience that runs is the first on ``PYTHONPATH``, so an older commit is
measured with ``git worktree add /tmp/before COMMIT`` and ``PYTHONPATH=/tmp/before``.

    python3 benchmarks/scale.py --sizes 256 1024 4096 --steady-s 600 --json docs/results/scale.json \\
        --plot docs/images/scale.png --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from figures import utc_now  # noqa: E402
from provenance import stamped  # noqa: E402
from scale_sim.measure import loadavg, summary  # noqa: E402
from scale_sim.run import Run, RunSpec  # noqa: E402

# (label, key path in one run's result, unit scale) — the table's rows and the plot's lines
METRICS = [
    ("supervisor CPU, % of a core", ("supervisor_cpu_pct",), 1),
    ("store CPU, % of a core", ("store_cpu_pct",), 1),
    ("simulated ranks' CPU, % of a core", ("ranks_cpu_pct",), 1),
    ("supervisor RSS, MB", ("supervisor_rss_mb",), 1),
    ("store calls/s (all clients)", ("store_ops_per_s",), 1),
    ("store calls/s (supervisor)", ("supervisor_store_ops_per_s",), 1),
    ("false alarms in the window", ("false_alarms",), 1),
    ("start → every rank joined gen 0, s", ("start_to_joined_s",), 1),
    ("start → gen 0 events logged, s", ("start_to_logged_s",), 1),
    ("killed node → plan published, ms", ("killed", "fault_to_plan_s"), 1000),
    ("killed node → plan out (store, pulses told), ms", ("killed", "fault_to_plan_out_s"), 1000),
    ("killed: plan → every rank read it, ms", ("killed", "plan_to_all_read_s"), 1000),
    ("killed node → every node's pulse has the plan, ms", ("killed", "fault_to_all_told_s"), 1000),
    ("killed node → every rank read the plan, ms", ("killed", "fault_to_all_read_s"), 1000),
    ("killed: plan → every rank joined, ms", ("killed", "plan_to_all_joined_s"), 1000),
    ("killed: plan → recovery logged done, s", ("killed", "plan_to_recovery_logged_s"), 1),
    ("silent node → plan published, ms", ("silent", "fault_to_plan_s"), 1000),
    ("silent node → plan out (store, pulses told), ms", ("silent", "fault_to_plan_out_s"), 1000),
    ("silent: plan → every rank read it, ms", ("silent", "plan_to_all_read_s"), 1000),
    ("silent node → every rank read the plan, ms", ("silent", "fault_to_all_read_s"), 1000),
    ("silent: plan → every rank joined, ms", ("silent", "plan_to_all_joined_s"), 1000),
    ("silent: plan → recovery logged done, s", ("silent", "plan_to_recovery_logged_s"), 1),
    ("simulator's worst timer lag in the window, ms", ("sim_lag_max_s",), 1000),
]
PLOTTED = ["supervisor CPU, % of a core", "store CPU, % of a core", "killed node → plan published, ms",
           "silent node → plan published, ms", "killed: plan → every rank read it, ms",
           "killed: plan → every rank joined, ms"]


def _shown_path(pythonpath: str) -> str:
    """PYTHONPATH as written to the JSON: this checkout as ``.`` (no path of the machine that ran it)."""
    root = str(Path(__file__).resolve().parents[1])
    return os.pathsep.join("." if p and Path(p).resolve() == Path(root) else p for p in pythonpath.split(os.pathsep))


def pick(result: dict, path: tuple[str, ...], scale: float) -> float | None:
    v = result
    for k in path:
        v = v.get(k) if isinstance(v, dict) else None
    return None if v is None else v * scale


def aggregate(runs: list[dict]) -> dict:
    """Per metric: median, min, max over the repeats (those that reached it)."""
    return {label: summary([pick(r, path, scale) for r in runs]) for label, path, scale in METRICS}


def markdown(sizes: dict[int, dict]) -> str:
    ns = sorted(sizes)
    lines = ["| metric | " + " | ".join(f"N={n:,}" for n in ns) + " |", "|---|" + "---|" * len(ns)]
    for label, _, _ in METRICS:
        cells = []
        for n in ns:
            s = sizes[n]["summary"][label]
            if s is None:
                cells.append("—")
            elif s["n"] == 1:
                cells.append(f"{s['median']:.3g}")
            else:
                cells.append(f"{s['median']:.3g} ({s['min']:.3g}–{s['max']:.3g})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(series: dict[str, dict[int, dict]], path: str) -> bool:
    """One line per label (a run's ``--label``) and metric; N on a log axis."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot", file=sys.stderr)
        return False
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    styles = ["-", "--", ":", "-."]
    for i, (name, sizes) in enumerate(series.items()):
        ns = sorted(sizes)
        for ax, labels in ((axes[0], PLOTTED[:2]), (axes[1], PLOTTED[2:])):
            for j, label in enumerate(labels):
                pts = [(n, sizes[n]["summary"][label]["median"]) for n in ns if sizes[n]["summary"].get(label)]
                if pts:
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % 4], marker="o",
                            color=f"C{j}", label=f"{label} [{name}]" if name else label)
    for ax in axes:
        ax.set_xscale("log", base=2)
        ax.set_xlabel("simulated ranks N (8 per node)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    axes[0].set_ylabel("% of one core")
    axes[1].set_ylabel("ms")
    axes[1].set_yscale("log")
    fig.suptitle("Control plane vs N (real supervisor and store, simulated ranks; 2-core box)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
    return True


def load(paths: list[str]) -> dict[str, dict[int, dict]]:
    """Earlier runs' JSON by label (sizes keyed by N); runs with one label are merged."""
    series: dict[str, dict[int, dict]] = {}
    for path in paths:
        d = json.loads(Path(path).read_text())
        for one in d.get("runs", [d]) if "sizes" not in d else [d]:  # a file of several --json results
            series.setdefault(one.get("label", path), {}).update({int(n): v for n, v in one["sizes"].items()})
    return series


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096, 8192, 16384])
    ap.add_argument("--tasks-per-node", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--steady-s", type=float, default=10.0, help="steady-state window (600 in a full run)")
    ap.add_argument("--settle-s", type=float, default=3.0)
    ap.add_argument("--step-s", type=float, default=0.5, help="simulated step time (a safe point each)")
    ap.add_argument("--hosts", type=int, default=2, help="processes holding the simulated ranks")
    ap.add_argument("--threads", type=int, default=None,
                    help="driver threads per such process (default: at most 256 ranks per driver, at least 2; "
                         "each store call is a blocking round trip, so a driver holds only so many ranks)")
    ap.add_argument("--pulse", choices=["auto", "on", "off"], default="auto",
                    help="pulse connections (auto: where the open-file limit holds two sockets per worker)")
    ap.add_argument("--cases", nargs="+", default=["killed", "silent"], choices=["killed", "silent"])
    ap.add_argument("--max-wait-s", type=float, default=None, help="cap of each wait (default 60 s + N/40 s)")
    ap.add_argument("--job-root", default="/dev/shm" if os.path.isdir("/dev/shm") else None,
                    help="where the job directory lives (default /dev/shm: no fsync cost; a disk path adds it)")
    ap.add_argument("--stop-after-failure", action="store_true", help="skip larger N once a size failed")
    ap.add_argument("--profile", help="cProfile the supervisor's loop at the largest size into this file (its liveness thread into FILE.liveness)")
    ap.add_argument("--skip-state-save", action="store_true",
                    help="diagnostic, not the product: the supervisor never writes supervisor.json (shows the "
                         "next bottleneck past the O(N) state save per change)")
    ap.add_argument("--keep", action="store_true", help="keep each run's job directory (events.jsonl, the logs) and say where")
    ap.add_argument("--label", default="", help="a name for this run in the JSON (e.g. the commit)")
    ap.add_argument("--json")
    ap.add_argument("--plot")
    ap.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    ap.add_argument("--replot", nargs="+", metavar="JSON",
                    help="run nothing: plot (--plot) and tabulate (--markdown) earlier runs, one line per label")
    args = ap.parse_args(argv)
    if args.replot:
        series = load(args.replot)
        if args.plot:
            plot(series, args.plot)
        if args.markdown:
            for name, sizes in series.items():
                print(f"\n{name}\n\n{markdown(sizes)}")
        return 0
    started = utc_now()
    sizes: dict[int, dict] = {}
    for n in sorted(args.sizes):
        runs = []
        for _ in range(args.repeats):
            spec = RunSpec(ranks=n, tasks_per_node=args.tasks_per_node, steady_s=args.steady_s,
                           settle_s=args.settle_s, step_s=args.step_s, hosts=args.hosts,
                           threads=args.threads or max(2, -(-n // (256 * args.hosts))),
                           pulse={"auto": None, "on": True, "off": False}[args.pulse], cases=tuple(args.cases),
                           max_wait_s=args.max_wait_s, skip_save=args.skip_state_save,
                           profile=args.profile if args.profile and n == max(args.sizes) else None)
            with Run(spec, root=args.job_root, keep=args.keep) as run:
                if args.keep:
                    print(f"N={n}: job directory {run.job_dir} (kept)", file=sys.stderr, flush=True)
                try:
                    result = run.measure()
                except Exception as exc:  # recorded, not fatal: larger N are still tried
                    result = dict(run.result, errors=run.result["errors"] + [f"{type(exc).__name__}: {exc}"])
            print(f"N={n}: {result}", file=sys.stderr, flush=True)
            runs.append(result)
        sizes[n] = {"runs": runs, "summary": aggregate(runs)}
        if args.stop_after_failure and any(r["errors"] for r in runs):
            break
    out = {"label": args.label, "started": started, "finished": utc_now(), "machine": os.uname().nodename,
           "cpus": os.cpu_count(), "load_at_end": loadavg(), "pythonpath": _shown_path(os.environ.get("PYTHONPATH", "")),
           "args": vars(args), "sizes": {str(n): v for n, v in sizes.items()}}
    if args.plot:
        plot({args.label: sizes}, args.plot)
    if args.json:
        Path(args.json).write_text(json.dumps(stamped(out, __file__), indent=2))
        print(f"wrote {args.json}")
    if args.markdown:
        print(markdown(sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
