"""The real online Supervisor over simulated nodes, in a process of its own.

Usage (by ``scale.py``): ``python -m scale_sim.supervisor_host SPEC_JSON``. Prints the
port of its control listener, then runs the job. The orchestrator sets node fates
(``("fate", node, kind)``) and reads the supervisor's store call count (``("stats",)``)
through it. Whatever ``slurm_resilience`` is first on ``PYTHONPATH`` is what runs, so
the same harness measures an older commit (docs/scale.md).
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import secrets
import sys
import threading

from .common import HOST, Channel, CountingStore, listen, raise_fd_limit
from .launcher import SimLauncher, node_name
from .measure import cpu_s


def build(spec: dict, out):
    from slurm_resilience.config import load_config
    from slurm_resilience.supervisor.executors.online import Supervisor

    class CountedSupervisor(Supervisor):
        """The real supervisor; only its store client is wrapped to count the calls."""

        def _connect_store(self):
            self.counted = CountingStore(super()._connect_store())
            return self.counted

        if spec.get("skip_save"):  # diagnostic only (--skip-state-save): what the loop costs without it
            def _save(self, state) -> None:
                return None

    w, s = spec["nodes"], spec["spares"]
    cfg = load_config({
        "job": {"nodes": w, "spares": s, "tasks_per_node": spec["tasks_per_node"]},
        "recovery": {"local_standbys": False, **spec.get("recovery", {})},
        "detect": spec.get("detect", {}),
        "reconnect": spec.get("reconnect", {}),
        "checkpoint": {"local_dir": os.path.join(spec["job_dir"], "local", "{node}")},
    })
    launcher = SimLauncher(spec["hosts"])
    kwargs = dict(config=cfg, command=["simulated-rank"], job_dir=spec["job_dir"],
                  nodes=[node_name(i) for i in range(w + s)], launcher=launcher, store_host=HOST,
                  store_port=spec["store_port"], job_id="scale", out=out)
    if "run_id" in inspect.signature(Supervisor.__init__).parameters:  # newer than 8b8a2a4
        kwargs["run_id"] = secrets.token_hex(16)
    return CountedSupervisor(**kwargs), launcher


def serve(listener, sup, launcher) -> None:
    ch = Channel(listener.accept())
    while True:
        try:
            msg = ch.recv()
        except (EOFError, OSError):
            return
        if msg[0] == "fate":
            launcher.fates[msg[1]] = msg[2]
            ch.send("ok")
        elif msg[0] == "stats":
            counted = getattr(sup, "counted", None)
            ch.send({"store_calls": counted.calls() if counted is not None else 0, "launched": launcher.launched,
                     "isolated": dict(launcher.isolated), "threads": threads_cpu()})


def threads_cpu() -> dict[str, float]:
    """CPU seconds of each Python thread of this process, by name (the loop runs in
    ``MainThread``, the pulse lines are read in ``sr-liveness``)."""
    out: dict[str, float] = {}
    for t in threading.enumerate():
        try:
            out[t.name] = out.get(t.name, 0.0) + cpu_s(os.getpid(), t.native_id)
        except (OSError, TypeError):
            continue  # ended meanwhile
    return out


def profile_liveness(path: str) -> None:
    """cProfile the liveness thread too (its own profile: a profiler sees one thread): the
    pulse lines of every node are read and parsed there, off the loop."""
    import cProfile

    from slurm_resilience.supervisor.observe import detect

    run = detect.LivenessServer._run

    def profiled(self) -> None:
        prof = cProfile.Profile()
        try:
            prof.runcall(run, self)
        finally:
            prof.dump_stats(path)

    detect.LivenessServer._run = profiled


def main() -> int:
    raise_fd_limit()
    spec = json.loads(sys.argv[1])
    os.makedirs(spec["job_dir"], exist_ok=True)
    out = open(os.path.join(spec["job_dir"], "supervisor.out"), "w", buffering=1)
    logging.basicConfig(stream=out, level=logging.WARNING, format="%(asctime)s %(name)s %(message)s")
    listener = listen()
    if spec.get("profile"):
        profile_liveness(spec["profile"] + ".liveness")
    sup, launcher = build(spec, out)
    threading.Thread(target=serve, args=(listener, sup, launcher), name="sim-control", daemon=True).start()
    print(listener.address[1], flush=True)
    if spec.get("profile"):  # the loop runs in this thread: where its time goes, for the changes of item 2
        import cProfile

        prof = cProfile.Profile()
        try:
            code = prof.runcall(sup.run)
        finally:
            prof.dump_stats(spec["profile"])
    else:
        code = sup.run()
    print(f"supervisor exit {code}", file=out, flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
