#!/usr/bin/env python3
"""Predicted ETTR per recovery strategy at Llama-3 scale (simulation, not a measurement).

16,384 GPUs (G=8 per node: 2,048 worker nodes + spares; one node fault takes all G
ranks of its node, and one spare node replaces them), failure rates from Dubey et
al. 2024, "The Llama 3 Herd of Models", Table 5 (419 unexpected interruptions in a
54-day snapshot; slurm_resilience/simulate/failures.py), several seeds, mean ± std.

Inputs come from what was measured (benchmarks/goodput_inputs.py): --mttr-json (the
JSON benchmarks/mttr.py writes: online phases from the kill-node case, process and
hang downtimes from kill-rank and hang-rank, the silent-loss downtime from
freeze-node) and --checkpoint-json (benchmarks/checkpoint.py: the toolkit's stall and
torch.save's synchronous write, scaled to --state-gb-per-rank). The requeue and
in-job restart downtimes come from --peers-json (benchmarks/peers.py: the fastest
peer's requeue, the fastest torchrun/NVRx restart after a killed rank) and from
--mttr-json (our own no-spare requeue; the plain sbatch + resubmit where peers.json has
no requeue); a figure neither has falls back to the old assumption (600 s requeue,
300 s in-job restart), and the output and the JSON name the source of each. These are
lab figures (a tiny model on one machine), not a 16,384-GPU job's restart: they favour
every restart path alike. Without the JSONs the built-in defaults are used and the
output says so. The toolkit is reported twice:
with the kill MTTR for node faults, and with the silent-loss MTTR (a node that loses
power or hangs sends nothing; --silent-mttr-s when mttr.json has no freeze-node case).

    python3 benchmarks/goodput.py --mttr-json mttr.json --checkpoint-json checkpoint.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import goodput_inputs as inputs  # noqa: E402
from provenance import stamped  # noqa: E402
from slurm_resilience.simulate.goodput import (  # noqa: E402
    DAY_S, PHASE_NAMES, CheckpointSpec, Cluster, FailureModel, PhaseTimes, Strategy,
    in_job_restart, requeue_baseline, simulate, summarize, toolkit_default,
)

TARGET = 0.98
PEERS_JSON = Path(__file__).resolve().parents[1] / "docs" / "results" / "peers.json"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpus", type=int, default=16_384)
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--days", type=float, default=54.0)
    p.add_argument("--seeds", type=int, default=10)
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiplier on the Llama 3 rates")
    p.add_argument("--step-time-s", type=float, default=6.0)
    p.add_argument("--spares", type=int, default=32, help="toolkit spare nodes")
    p.add_argument("--repair-h", type=float, default=24.0, help="hours until a failed node is a spare again")
    p.add_argument("--toolkit-ckpt-interval-s", type=float, default=1800.0)
    p.add_argument("--toolkit-ckpt-cost-s", type=float, default=1.0, help="blocking part (async tiers)")
    p.add_argument("--baseline-ckpt-interval-s", type=float, default=1800.0)
    p.add_argument("--baseline-ckpt-cost-s", type=float, default=30.0, help="synchronous persistent write")
    p.add_argument("--requeue-s", type=float, default=None,
                   help="the baselines' requeue: detect + relaunch + init + load (default: measured, see --peers-json)")
    p.add_argument("--toolkit-requeue-s", type=float, default=None,
                   help="the toolkit's requeue without a spare (default: --mttr-json's requeue-resubmit)")
    p.add_argument("--queue-wait-s", type=float, default=0.0)
    p.add_argument("--in-job-restart-s", type=float, default=None,
                   help="in-job restart of every rank (default: --peers-json's fastest torchrun/NVRx kill-rank)")
    p.add_argument("--peers-json", type=Path, default=PEERS_JSON if PEERS_JSON.exists() else None,
                   help="the JSON benchmarks/peers.py wrote (default: docs/results/peers.json when present)")
    p.add_argument("--phase-json", type=Path, help="measured toolkit phase times in ms ({phase: ms})")
    p.add_argument("--mttr-json", type=Path, help="the JSON benchmarks/mttr.py wrote")
    p.add_argument("--checkpoint-json", type=Path, help="the JSON benchmarks/checkpoint.py wrote")
    p.add_argument("--state-gb-per-rank", type=float, default=4.0,
                   help="checkpointed state per rank (Llama 3 405B: 1 MB to 4 GB per GPU)")
    p.add_argument("--silent-mttr-s", type=float, help="silent node loss MTTR (default: mttr.json's freeze-node)")
    p.add_argument("--json", type=Path, default=Path("goodput.json"), help="write the results here")
    return p.parse_args(argv)


def strategies(a: argparse.Namespace, phases: PhaseTimes) -> list[Strategy]:
    base_ckpt = CheckpointSpec(interval_s=a.baseline_ckpt_interval_s, cost_s=a.baseline_ckpt_cost_s)
    return [
        toolkit_default(phases=phases, step_time_s=a.step_time_s, spare_nodes=a.spares,
                        repair_s=a.repair_h * 3600, requeue_s=a.toolkit_requeue_s, queue_wait_s=a.queue_wait_s,
                        checkpoint=CheckpointSpec(interval_s=a.toolkit_ckpt_interval_s, cost_s=a.toolkit_ckpt_cost_s)),
        requeue_baseline(step_time_s=a.step_time_s, checkpoint=base_ckpt, requeue_s=a.requeue_s,
                         queue_wait_s=a.queue_wait_s),
        in_job_restart(step_time_s=a.step_time_s, checkpoint=base_ckpt, restart_s=a.in_job_restart_s,
                       requeue_s=a.requeue_s, queue_wait_s=a.queue_wait_s),
    ]


def run(cluster: Cluster, model: FailureModel, s: Strategy, horizon: float, seeds: int) -> dict:
    results = [simulate(cluster, model, s, horizon, seed=seed) for seed in range(seeds)]
    out = summarize(results)
    paths: dict[str, float] = {}
    for r in results:
        for k, v in r.recoveries_by_path.items():
            paths[k] = paths.get(k, 0) + v / len(results)
    out["recoveries_by_path_mean"] = paths
    return out


def pct(m: float, s: float) -> str:
    return f"{100 * m:7.3f} ± {100 * s:5.3f}"


def print_table(title: str, rows: list[tuple[str, dict]]) -> None:
    print(f"\n{title}")
    print(f"{'strategy':<46} {'ETTR %':>15} {'lost work %':>15} {'recovery %':>15} {'checkpoint %':>15} {'failures':>12}")
    for name, r in rows:
        print(f"{name:<46} {pct(r['ettr_mean'], r['ettr_std'])} {pct(r['lost_work_mean'], r['lost_work_std'])}"
              f" {pct(r['recovery_mean'], r['recovery_std'])} {pct(r['checkpoint_mean'], r['checkpoint_std'])}"
              f" {r['failures_mean']:6.1f} ± {r['failures_std']:4.1f}")


def measured(a: argparse.Namespace) -> tuple[PhaseTimes, dict]:
    """Phase times and the other measured inputs; ``used`` says where each came from."""
    used: dict = {"phases": "built-in defaults (README demo)"}
    phases = PhaseTimes()
    mttr = json.loads(a.mttr_json.read_text()) if a.mttr_json else None
    if a.phase_json:
        phases, used["phases"] = PhaseTimes.from_ms(json.loads(a.phase_json.read_text())), str(a.phase_json)
    elif mttr:
        phases = PhaseTimes.from_ms(inputs.phases_ms(mttr))
        used["phases"] = f"{a.mttr_json} (kill-node medians, G={inputs.ranks_per_node(mttr)} in the lab)"
    if mttr:
        for case in ("kill-rank", "hang-rank", "freeze-node"):
            used[case] = inputs.case_mttr_s(mttr, case)
    if a.silent_mttr_s is not None:
        used["freeze-node"] = a.silent_mttr_s
    peers = json.loads(a.peers_json.read_text()) if a.peers_json else None
    measured_s = inputs.downtimes(mttr, peers, {"mttr": _shown(a.mttr_json), "peers": _shown(a.peers_json)})
    for key, arg in (("baseline_requeue", "requeue_s"), ("in_job_restart", "in_job_restart_s"),
                     ("toolkit_requeue", "toolkit_requeue_s")):
        if getattr(a, arg) is None:
            setattr(a, arg, measured_s[key][0])
            used[key] = {"s": measured_s[key][0], "from": measured_s[key][1]}
        else:
            used[key] = {"s": getattr(a, arg), "from": f"--{arg.replace('_', '-')}"}
    if a.checkpoint_json:
        c = inputs.checkpoint_costs(json.loads(a.checkpoint_json.read_text()), a.state_gb_per_rank)
        a.toolkit_ckpt_cost_s = c["toolkit_s"]
        a.baseline_ckpt_cost_s = c.get("baseline_s", a.baseline_ckpt_cost_s)
        used["checkpoint"] = {**c, "from": str(a.checkpoint_json), "state_gb_per_rank": a.state_gb_per_rank}
    return phases, used


def _shown(path: Path | None) -> str:
    """``path`` as the output names it: relative to the repository when inside it."""
    if path is None:
        return "None"
    try:
        return str(Path(path).resolve().relative_to(PEERS_JSON.parents[2]))
    except ValueError:
        return str(path)


def with_measured(tk: Strategy, used: dict) -> Strategy:
    """The toolkit strategy with the measured process-fault and hang downtimes."""
    if used.get("kill-rank"):
        tk = replace(tk, on_process=replace(tk.on_process, downtime_s=used["kill-rank"]))
    if used.get("hang-rank"):
        tk = replace(tk, on_hang=replace(tk.on_hang, downtime_s=used["hang-rank"]))
    return tk


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    phases, used = measured(a)
    cluster = Cluster(gpus=a.gpus, gpus_per_node=a.gpus_per_node)
    model = FailureModel(rate_scale=a.rate_scale)
    horizon = a.days * DAY_S
    strats = strategies(a, phases)
    strats[0] = with_measured(strats[0], used)
    silent = used.get("freeze-node")
    if silent:
        strats.insert(1, replace(strats[0], name="toolkit, silent node loss",
                                 on_node=replace(strats[0].on_node, downtime_s=silent)))

    print("Assumptions (simulation; see slurm_resilience/simulate/goodput.py):")
    print(f"  cluster: {cluster.gpus} GPUs, {cluster.gpus_per_node}/node = {cluster.nodes} worker nodes;"
          f" toolkit adds {a.spares} spare nodes, failed nodes return as spares after {a.repair_h:g} h")
    print(f"  failures: Llama 3 (Dubey et al. 2024, Table 5: 419 in 54 days on 16,384 GPUs) x {a.rate_scale:g},"
          f" linear in GPUs: expected {model.expected_failures(cluster.gpus, horizon):.1f} in {a.days:g} days;"
          " node faults need a new node, software bug/dependency are process faults, NCCL watchdog a hang")
    print(f"  step {a.step_time_s:g} s; a failure during a recovery restarts it; requeue = {a.queue_wait_s:g} s queue"
          f" + {a.requeue_s:g} s restart (toolkit without a spare: {a.toolkit_requeue_s:g} s), from the last"
          f" persistent checkpoint; in-job restart {a.in_job_restart_s:g} s")
    for key in ("baseline_requeue", "in_job_restart", "toolkit_requeue"):
        print(f"    {key}: {used[key]['s']:g} s from {used[key]['from']}")
    print(f"  inputs: {json.dumps(used)}")
    if not silent:
        print("  silent node loss: NOT modelled (no freeze-node case in --mttr-json and no --silent-mttr-s)")
    print(f"  toolkit phases ({used['phases']}): "
          + ", ".join(f"{n} {1000 * getattr(phases, n):.1f} ms" for n in PHASE_NAMES)
          + f" -> online MTTR {phases.online_s * 1000:.1f} ms")
    for s in strats:
        paths = {s.on_node.name: s.on_node.downtime_s, s.on_process.name: s.on_process.downtime_s,
                 s.on_hang.name: s.on_hang.downtime_s, s.on_no_spare.name: s.on_no_spare.downtime_s}
        print(f"  {s.name}: checkpoint every {s.checkpoint_every_s:g} s costing {s.checkpoint.cost_s:g} s;"
              " downtime " + ", ".join(f"{k} {v:.3g} s" for k, v in paths.items()))

    rows = [(s.name, run(cluster, model, s, horizon, a.seeds)) for s in strats]
    print_table(f"Predicted ETTR over {a.days:g} days, {a.seeds} seeds (mean ± std)", rows)

    tk = strats[0]
    at_scale = toolkit_default(phases=replace(phases, reconnect=60.0, restore=30.0), step_time_s=a.step_time_s,
                               spare_nodes=a.spares, repair_s=a.repair_h * 3600, requeue_s=a.toolkit_requeue_s,
                               checkpoint=tk.checkpoint)
    sens = [
        ("toolkit, reconnect 60 s + restore 30 s", at_scale),
        (f"toolkit, {max(1, a.spares // 8)} spares", replace(tk, spare_nodes=max(1, a.spares // 8))),
        ("toolkit, 0 spares (every node fault requeues)", replace(tk, spare_nodes=0)),
    ]
    sens_rows = [(n, run(cluster, model, s, horizon, a.seeds)) for n, s in sens]
    sens_rows.append(("toolkit, failure rate x4", run(cluster, FailureModel(rate_scale=4 * a.rate_scale), tk,
                                                      horizon, a.seeds)))
    print_table("Sensitivity (toolkit default)", sens_rows)

    ettr = rows[0][1]["ettr_mean"]
    print(f"\nTarget: toolkit default predicted ETTR >= {100 * TARGET:.0f}%:"
          f" {'met' if ettr >= TARGET else 'NOT met'} ({100 * ettr:.3f}%)")
    if a.json:
        shown = {k: _shown(v) if isinstance(v, Path) else str(v) for k, v in vars(a).items()}
        a.json.write_text(json.dumps(stamped({"benchmark": "goodput", "inputs": used, "args": shown,
                                      "main": dict(rows), "sensitivity": dict(sens_rows)}, __file__), indent=2))
    return 0 if ettr >= TARGET else 1


if __name__ == "__main__":
    sys.exit(main())
