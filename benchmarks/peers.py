#!/usr/bin/env python3
"""Recovery against the peers themselves: ours, torchrun elastic, NVIDIA NVRx's ft_launcher and
torchft on the same faults, the same training, the same local Slurm.

Every system trains benchmarks/peers/train.py (torchft: its copy changed as torchft asks,
train_torchft.py): a tiny MLP on seeded synthetic data, gloo on CPU, one thread per rank,
every step padded to --step-time, --steps steps, --nodes nodes x G ranks, its own
snapshot every --snapshot-every steps; the fault comes once rank 0 logged step --kill-at:

    kill-rank    the last rank SIGKILLed
    kill-node    the last node killed (scripts/local-cluster kill-node: slurmd and its processes)
    freeze-node  the last node frozen (freeze-node: slurmd stopped, its job cgroups frozen, nothing closes)
    requeue      the job requeued by Slurm (scontrol requeue, as a preemption with requeue does)

Each system is set up the way its docs give the fastest recovery (benchmarks/peers/systems.py
says how), with the same detection budget (--detect: our heartbeat timeout, the gloo
timeout of the plain script, torchft's timeouts). Per system x fault: MTTR = the fault's
time → the end of rank 0's first step that started after the fault (from the script's
own step log); steps lost (done again); whether the final state's digest equals the
system's own fault-free run; the code lines its script changed against the plain one.
Repeats are interleaved (every system once per fault per round); median, min, max and
the ratio of each peer's median to ours go to --json.

    benchmarks/peers/setup.sh      # once: the peers' venvs (not installed by CI)
    python benchmarks/peers.py --repeats 5 --json docs/results/peers.json

Needs the cluster (eval "$(scripts/local-cluster env)") with --nodes + 2 idle nodes.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "peers"))
import steplog  # noqa: E402
import systems  # noqa: E402
from slurm_resilience import lab  # noqa: E402
from slurm_resilience.slurm import commands  # noqa: E402

OURS = "ours"
DEFAULT_PREFIX = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "slurm_resilience" / "peers"


def case(system: str, fault: str):
    """The runner of one cell, or the reason the system cannot do that fault on Slurm."""
    reason = systems.CANNOT.get((system, fault))
    return reason if reason else systems.LAUNCHERS[system]


def _wait(pred, what: str, timeout: float, alive=lambda: True):
    deadline = time.time() + timeout
    while time.time() < deadline:
        got = pred()
        if got:
            return got
        if not alive():
            raise RuntimeError(f"ended before {what}")
        time.sleep(0.02)
    raise TimeoutError(f"{what}: not within {timeout:.0f} s")


def _rows(run: systems.Launched) -> list[steplog.Step]:
    return steplog.parse(run.log.read_text()) if run.log.exists() else []


def inject(fault: str, run: systems.Launched, args) -> tuple[float, str | None]:
    """Inject the fault; returns its wall time and the node to bring back afterwards."""
    victim = run.victim_node()
    if fault == "kill-rank":
        pid = run.pid(args.nodes * args.g - 1)
        t = time.time()
        os.kill(pid, signal.SIGKILL)  # a rank of the job this benchmark started
        return t, None
    if fault == "kill-node":
        return lab.kill_node(victim), victim
    if fault == "freeze-node":
        return lab.freeze_node(victim), victim
    job = run.job()
    t = time.time()
    commands.run(["scontrol", "requeue", str(job)])
    return t, None


def run_cell(system: str, fault: str | None, root: Path, args) -> dict:
    """One run: launch, inject ``fault`` (None: the fault-free reference) at --kill-at, wait
    for the first step after it and for the end."""
    run = systems.LAUNCHERS[system](root, args, fault or "none")
    victim, t_fault = None, None
    try:
        if fault:
            last = run.root / "pids" / f"rank-{args.nodes * args.g - 1}"  # an elastic start may form a smaller world
            _wait(lambda: last.exists() and any(r.step >= args.kill_at and r.start > last.stat().st_mtime
                                                for r in _rows(run)),
                  f"step {args.kill_at} with all {args.nodes * args.g} ranks", args.start_timeout, run.alive)
            t_fault, victim = inject(fault, run, args)
            try:
                _wait(lambda: steplog.recovery(_rows(run), t_fault)["mttr_s"] is not None,
                      "the first step after the fault", args.recovery_timeout, run.alive)
            except (TimeoutError, RuntimeError) as exc:
                return {**steplog.recovery(_rows(run), t_fault), "recovered": False, "why": str(exc),
                        **run.finish(0)}
        end = run.finish(args.start_timeout + args.steps * args.step_time * 3)
    finally:
        if victim and fault == "kill-node":
            _revive(lambda: lab.cluster("revive-node", victim))
        elif victim:
            _revive(lambda: lab.thaw_and_revive(victim))
    digest = run.digest.read_text().strip() if run.digest.exists() else None
    result = {**(steplog.recovery(_rows(run), t_fault) if fault else {}), **end, "digest": digest}
    if fault:
        result["recovered"] = result["mttr_s"] is not None
    return result


def _revive(fn) -> None:
    try:
        fn()
    except Exception as exc:  # the lab is shared: report, go on
        print(f"warning: bringing the node back: {exc}", file=sys.stderr)


def before_fault(run: dict) -> bool:
    """A run that failed before its fault (the job never reached --kill-at with every rank:
    e.g. lost in a restart of the lab) measures no recovery: it is counted apart."""
    error = str(run.get("error", ""))
    return bool(run.get("before_fault")) or error.startswith(("RuntimeError: ended before step", "TimeoutError: step"))


def summarize(runs: dict, refs: dict[str, str | None]) -> dict:
    """Per fault and system: MTTR and steps-lost statistics, runs not recovered, digests equal to
    the system's fault-free run, the ratio of the median to ours."""
    out: dict = {}
    for fault, by_system in runs.items():
        out[fault] = {}
        for system, rs in by_system.items():
            if isinstance(rs, str):
                out[fault][system] = {"cannot": rs}
                continue
            faulted = [r for r in rs if not before_fault(r)]
            cell = {**steplog.stats([r.get("mttr_s") for r in faulted]),
                    "steps_lost": steplog.stats([r.get("steps_lost") for r in faulted]),
                    "not_recovered": sum(not r.get("recovered") for r in faulted),
                    "no_fault": len(rs) - len(faulted),
                    "digest_equal": sum(bool(refs.get(system)) and r.get("digest") == refs.get(system) for r in faulted),
                    "runs": rs}
            out[fault][system] = cell
        ours = out[fault].get(OURS, {}).get("median_s")
        for system, cell in out[fault].items():
            if system != OURS and ours and cell.get("median_s"):
                cell["ratio_to_ours"] = round(cell["median_s"] / ours, 2)
    return out


def table(results: dict) -> str:
    """The summary as text: one line per fault x system."""
    def f(x):
        return f"{x:.2f}" if isinstance(x, (int, float)) else "-"
    lines = [f"{'fault':<12}{'system':<10}{'median s':>9}{'min':>7}{'max':>7}{'n':>3}{'/ ours':>8}"
             f"{'lost':>6}{'no rec':>7}{'= ref':>6}"]
    for fault, cells in results.items():
        for system, c in cells.items():
            if "cannot" in c:
                lines.append(f"{fault:<12}{system:<10}  cannot: {c['cannot']}")
                continue
            ratio = f"{c['ratio_to_ours']:.1f}x" if "ratio_to_ours" in c else "-"
            lines.append(f"{fault:<12}{system:<10}{f(c['median_s']):>9}{f(c['min_s']):>7}{f(c['max_s']):>7}"
                         f"{c['n']:>3}{ratio:>8}{f(c['steps_lost']['median_s']):>6}{c['not_recovered']:>7}"
                         f"{c['digest_equal']:>6}")
    return "\n".join(lines)


def markdown(doc: dict) -> str:
    """The docs' table of a JSON this script wrote: per fault and system, MTTR median (min-max),
    runs, ratio to ours, steps lost, final state equal to the system's fault-free run, lines changed."""
    changed = doc.get("script_lines_changed", {})
    lines = ["| fault | system | MTTR median (min–max), s | runs recovered | / ours | steps lost | "
             "= own fault-free | script lines +/− |", "|---|---|---|---|---|---|---|---|"]
    order = {f: i for i, f in enumerate(systems.FAULTS)}
    for fault, cells in sorted(doc["results"].items(), key=lambda fc: order.get(fc[0], len(order))):
        for system, c in cells.items():
            ch = changed.get(system, {})
            ch = f"+{ch.get('added', 0)}/−{ch.get('removed', 0)}" if ch else "-"
            if "cannot" in c:
                lines.append(f"| {fault} | {system} | cannot: {c['cannot']} | | | | | {ch} |")
                continue
            runs = len(c["runs"]) - c.get("no_fault", 0)
            mttr = f"{c['median_s']:.2f} ({c['min_s']:.2f}–{c['max_s']:.2f})" if c["median_s"] is not None else "none"
            ratio = f"{c['ratio_to_ours']:.1f}×" if "ratio_to_ours" in c else ("1" if system == OURS else "-")
            lost = c["steps_lost"]["median_s"]
            lines.append(f"| {fault} | {system} | {mttr} | {runs - c['not_recovered']}/{runs} | {ratio} | "
                         f"{'-' if lost is None else f'{lost:g}'} | {c['digest_equal']}/{runs} | {ch} |")
    return "\n".join(lines)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--systems", default=",".join(systems.SYSTEMS), help="comma-separated, of: %(default)s")
    ap.add_argument("--faults", default=",".join(systems.FAULTS), help="comma-separated, of: %(default)s")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--nodes", type=int, default=2, help="training nodes (ours adds a spare)")
    ap.add_argument("--g", type=int, default=1, choices=(1, 2), help="ranks per node, the same for all")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--kill-at", type=int, default=12)
    ap.add_argument("--step-time", type=float, default=0.2)
    ap.add_argument("--snapshot-every", type=int, default=5)
    ap.add_argument("--detect", type=float, default=2.0, help="detection budget for all (s): our heartbeat "
                    "timeout, the gloo timeout of the plain script and torchft's (default %(default)s)")
    ap.add_argument("--max-restarts", type=int, default=3)
    ap.add_argument("--last-call", type=int, default=5, help="torchrun/NVRx rendezvous last_call_timeout (s): "
                    "the wait for more nodes once --nnodes MIN is there; less and the start may form a smaller world")
    ap.add_argument("--join-ms", type=float, default=10000, help="torchft lighthouse --join_timeout_ms")
    ap.add_argument("--port", type=int, default=20000 + os.getpid() % 120 * 100,
                    help="base TCP port; each run takes the next 50, below the ephemeral range (32768)")
    ap.add_argument("--prefix", default=str(DEFAULT_PREFIX), help="the venvs of setup.sh (default %(default)s)")
    ap.add_argument("--ours-src", help="run ours from this directory's slurm_resilience (e.g. `git archive HEAD "
                    "slurm_resilience | tar -x -C DIR`) instead of the imported one")
    ap.add_argument("--start-timeout", type=float, default=180.0)
    ap.add_argument("--recovery-timeout", type=float, default=90.0)
    ap.add_argument("--no-reference", action="store_true", help="skip the fault-free runs (no digest check)")
    ap.add_argument("--json", default="peers.json")
    ap.add_argument("--add-to", help="a JSON this script wrote: keep its runs and references, add this run's "
                    "(the same settings; the commands of both are listed)")
    args = ap.parse_args(argv)
    args.systems = [s for s in args.systems.split(",") if s]
    args.faults = [s for s in args.faults.split(",") if s]
    bad = [s for s in args.systems if s not in systems.SYSTEMS] + [f for f in args.faults if f not in systems.FAULTS]
    if bad:
        ap.error(f"unknown: {', '.join(bad)} (systems: {', '.join(systems.SYSTEMS)}; "
                 f"faults: {', '.join(systems.FAULTS)})")
    if args.repeats < 1 or not 0 < args.kill_at < args.steps or (args.g != 1 and "torchft" in args.systems):
        ap.error("need --repeats >= 1, 0 < --kill-at < --steps, and --g 1 with torchft (one rank per replica group)")
    peers = [s for s in args.systems if s in ("nvrx", "torchft", "lightning")]
    missing = [s for s in peers if not (Path(args.prefix) / s / "bin" / "python").exists()]
    if missing:
        ap.error(f"no venv for {', '.join(missing)} under {args.prefix}: run benchmarks/peers/setup.sh")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--markdown"]:  # --markdown JSON: print the docs' table of an earlier run
        if len(argv) != 2 or not Path(argv[1]).is_file():
            print("peers.py: error: --markdown needs one JSON file this script wrote", file=sys.stderr)
            return 2
        print(markdown(json.loads(Path(argv[1]).read_text())))
        return 0
    args = parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="peers-"))
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    runs: dict = {f: {s: [] if not isinstance(case(s, f), str) else case(s, f) for s in args.systems}
                  for f in args.faults}
    refs: dict[str, str | None] = {}
    loads: list[str] = []
    earlier = _load(args, runs, refs, loads) if args.add_to else []
    for system in ([] if args.no_reference else [s for s in args.systems if not refs.get(s)]):
        r = _safe(system, None, root / f"ref-{system}", args)
        refs[system] = r.get("digest")
        print(f"reference {system:<9} {json.dumps(r)}", flush=True)
    for rep in range(args.repeats):
        for fault in args.faults:
            for system in args.systems:
                if isinstance(runs[fault][system], str):
                    continue
                args.port = 20000 + (args.port - 20000 + 50) % 12000  # a fresh range per run, below 32768
                loads.append(Path("/proc/loadavg").read_text().split()[0])
                r = _safe(system, fault, root / f"r{rep}-{fault}-{system}", args)
                runs[fault][system].append(r)
                print(f"{fault:<12}{system:<9} {rep + 1}/{args.repeats} {json.dumps(r)}", flush=True)
                _write(args, argv, started, root, runs, refs, loads, earlier)
    _write(args, argv, started, root, runs, refs, loads, earlier)
    print("\n" + table(summarize(runs, refs)) + f"\n\nwrote {args.json}")
    return 0


def _safe(system: str, fault: str | None, root: Path, args) -> dict:
    root.mkdir(parents=True)
    try:
        return run_cell(system, fault, root, args)
    except Exception as exc:  # one failed run is reported, the others still run
        return {"error": f"{type(exc).__name__}: {exc}", "recovered": False,
                "trace": traceback.format_exc(limit=3).replace(str(Path(__file__).resolve().parents[1]) + "/", "")}


def _load(args, runs: dict, refs: dict, loads: list) -> list[dict]:
    """Take the runs, references and loads of ``--add-to``'s JSON into this run's; returns
    the earlier commands."""
    doc = json.loads(Path(args.add_to).read_text())
    for fault, cells in doc["results"].items():
        for system, cell in cells.items():
            if "runs" in cell:
                runs.setdefault(fault, {}).setdefault(system, [])
                if not isinstance(runs[fault][system], str):
                    runs[fault][system][:0] = cell["runs"]
    refs.update({k: v for k, v in doc.get("reference_digests", {}).items() if v})
    loads.extend(doc.get("loadavg_1min_at_each_run", []))
    return [*doc.get("earlier", []), {k: doc[k] for k in ("command", "started", "work_dir") if k in doc}]


def _write(args, argv, started, root, runs, refs, loads, earlier=()) -> None:
    plain = systems.TRAIN.read_text()
    present = {s for cells in runs.values() for s in cells} | set(args.systems)
    changed = {s: steplog.lines_changed(plain, systems.SCRIPTS[s].read_text()) for s in systems.SYSTEMS if s in present}
    doc = {"benchmark": "peers", "command": "python " + " ".join([sys.argv[0], *(argv or sys.argv[1:])]),
           "started": started, "machine": platform.node(), "cpus": os.cpu_count(),
           "loadavg_1min_at_each_run": loads, "versions": _versions(args),
           "args": {**vars(args), "prefix": args.prefix.replace(str(Path.home()), "~", 1)},  # no home of this machine
           "work_dir": str(root), "script_lines_changed": changed, "reference_digests": refs,
           "earlier": list(earlier), "results": summarize(runs, refs)}
    Path(args.json).write_text(json.dumps(doc, indent=2, default=str))


def _versions(args) -> dict:
    import importlib.metadata as md
    out = {"torch": md.version("torch")}
    for system, pkg in (("nvrx", "nvidia-resiliency-ext"), ("torchft", "torchft"), ("lightning", "pytorch-lightning")):
        for d in (Path(args.prefix) / system / "lib").glob("python*/site-packages"):
            out[pkg] = next((p.name[:-len(".dist-info")].split("-")[1]
                             for p in d.glob(f"{pkg.replace('-', '_')}-*.dist-info")), None)
        if not out.get(pkg):  # not in the venv: the system's, which the venv sees (--system-site-packages)
            try:
                out[pkg] = md.version(pkg)
            except md.PackageNotFoundError:
                out[pkg] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
