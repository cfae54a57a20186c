"""Fault injection into a running job (``slurm-resilience inject FAULT --job JOBDIR``).

Every fault targets processes this job started, found through its status file
(PIDs of ranks and standbys) or the local cluster's own tooling; nothing is killed
by name. Node-level faults need the one-machine cluster (``scripts/local-cluster``).

    kill-rank     SIGKILL one rank's process
    kill-node     hard loss of the node running a rank (slurmd, slurmstepd, tasks)
    freeze-node   silent loss of that node: slurmd stopped, its job cgroups frozen; no
                  connection closes (thaw: ``scripts/local-cluster thaw-node NODE``)
    hang-rank     SIGSTOP one rank (found by its stale heartbeat)
    slow-rank     straggler: SIGSTOP/SIGCONT duty cycle for a while
    kill-spare    SIGKILL a warm standby
    kill-supervisor  SIGKILL the supervisor (the batch step)
    corrupt-checkpoint  flip a byte inside the newest L2 shard's data
    fill-disk     fill a directory's filesystem (leave ``keep_mb`` free)
    preempt       the preemption signal to the batch step (scancel --signal --batch)

Network faults on the local cluster, whose nodes each have an address (iptables
rules in the lab's chain SR_LAB; all of them undone by ``heal`` or ``local-cluster
reset``):

    partition-node   the rank's node reaches no one, no one reaches it (slurmctld too)
    partition-peers  the rank's node is cut from the nodes of the other ranks only
    partition-supervisor  the rank's node is cut from the supervisor's store and
                  liveness ports only; its peers and slurmctld still reach it
    flap-node     a partition-node for ``--seconds``, then healed (returns when healed)
    lossy-node    each packet of the rank's node dropped with ``--probability``
    slow-node     every connection of the rank's node shaped to ``--rate`` (a narrow link)
    delay-node    every packet to or from the rank's node held ``--delay-ms`` (a long link)
    heal          remove every network fault: a partitioned node comes back

Each injection is appended to ``JOBDIR/injected.jsonl`` (0600, one JSON line: what
:func:`inject` returns), so ``slurm-resilience timeline`` can measure a recovery from
the fault itself rather than from its first sign: for a silent node the first sign
*is* the detection, two seconds later.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

from .errors import ResilienceError


__all__ = [
    "INJECTED", "NETWORK_FAULTS", "FAULTS", "inject", "read_injections", "network_args", "network_fault",
    "corrupt_newest", "fill"
]


INJECTED = "injected.jsonl"
NETWORK_FAULTS = ("partition-node", "partition-peers", "partition-supervisor", "flap-node", "lossy-node",
                  "slow-node", "delay-node", "heal")
FAULTS = ("kill-rank", "kill-node", "freeze-node", "hang-rank", "slow-rank", "kill-spare", "kill-supervisor",
          "corrupt-checkpoint", "fill-disk", "preempt", *NETWORK_FAULTS)


def _status(job_dir: str) -> dict[str, Any]:
    try:
        with open(os.path.join(job_dir, "status.json")) as f:
            return json.load(f)
    except FileNotFoundError:
        raise ResilienceError(f"no status.json in {job_dir}: is the job running?") from None


def _rank(st: dict[str, Any], rank: int) -> dict[str, Any]:
    ranks = st["ranks"]
    if not 0 <= rank < len(ranks):
        raise ResilienceError(f"rank {rank} does not exist (world size {len(ranks)})")
    if not ranks[rank]["pid"]:
        raise ResilienceError(f"rank {rank} has no pid yet: wait until it is running")
    return ranks[rank]


def inject(fault: str, job_dir: str, *, rank: int = 1, seconds: float = 5.0,
           duty: float = 0.5, path: str | None = None, keep_mb: int = 1,
           probability: float = 0.05, rate: str = "1mbit", delay_ms: float = 20.0) -> dict[str, Any]:
    """Inject ``fault``; returns what was done (with ``at``, the wall time), also
    appended to ``JOBDIR/injected.jsonl`` (``record_error`` instead when that fails:
    the fault is in, the record is not)."""
    if fault in NETWORK_FAULTS:
        done = network_fault(fault, _status(job_dir), rank=rank, seconds=seconds, probability=probability,
                             rate=rate, delay_ms=delay_ms)
    else:
        done = _inject(fault, job_dir, rank=rank, seconds=seconds, duty=duty, path=path, keep_mb=keep_mb)
    try:
        fd = os.open(os.path.join(job_dir, INJECTED), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        with os.fdopen(fd, "a") as f:
            f.write(json.dumps(done) + "\n")  # one write: a line is whole or absent
    except OSError as exc:
        done["record_error"] = f"{INJECTED} not written: {exc}"
    return done


def read_injections(job_dir: str) -> list[dict[str, Any]]:
    """The faults injected into the job (``injected.jsonl``), oldest first; [] when none.
    A line that is not a JSON object with a numeric ``at`` (a torn last line) is skipped."""
    try:
        with open(os.path.join(job_dir, INJECTED)) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("at"), (int, float)):
            out.append(rec)
    return sorted(out, key=lambda r: r["at"])


def _inject(fault: str, job_dir: str, *, rank: int, seconds: float, duty: float, path: str | None,
            keep_mb: int) -> dict[str, Any]:
    if fault not in FAULTS:
        raise ResilienceError(f"unknown fault {fault!r}; one of: {', '.join(FAULTS)}")
    st = _status(job_dir)
    at = time.time()
    if fault == "kill-rank":
        r = _rank(st, rank)
        os.kill(r["pid"], signal.SIGKILL)
        return {"fault": fault, "rank": rank, "pid": r["pid"], "at": at}
    if fault == "hang-rank":
        r = _rank(st, rank)
        os.kill(r["pid"], signal.SIGSTOP)
        return {"fault": fault, "rank": rank, "pid": r["pid"], "at": at}
    if fault == "slow-rank":
        r = _rank(st, rank)
        threading.Thread(target=_duty_cycle, args=(r["pid"], seconds, duty), daemon=True).start()
        return {"fault": fault, "rank": rank, "pid": r["pid"], "at": at, "seconds": seconds}
    if fault == "kill-node":
        from . import lab

        node = _rank(st, rank)["node"]
        return {"fault": fault, "rank": rank, "node": node, "at": lab.kill_node(node)}
    if fault == "freeze-node":
        from . import lab

        node = _rank(st, rank)["node"]
        return {"fault": fault, "rank": rank, "node": node, "at": lab.freeze_node(node)}
    if fault == "kill-spare":
        spares = [s for s in st["spares"] if s["pid"]]
        if not spares:
            raise ResilienceError("no running spare to kill")
        os.kill(spares[0]["pid"], signal.SIGKILL)
        return {"fault": fault, "node": spares[0]["node"], "pid": spares[0]["pid"], "at": at}
    if fault == "kill-supervisor":
        pid = st.get("supervisor_pid")
        if not pid:
            raise ResilienceError("the status file has no supervisor pid")
        os.kill(pid, signal.SIGKILL)
        return {"fault": fault, "pid": pid, "at": at}
    if fault == "corrupt-checkpoint":
        from .checkpoint.layout import job_checkpoints

        return {"fault": fault, "at": at, **corrupt_newest(path or job_checkpoints(job_dir))}
    if fault == "fill-disk":
        if not path:
            raise ResilienceError("fill-disk needs --path (a directory on the filesystem to fill)")
        return {"fault": fault, "at": at, "file": fill(path, keep_mb)}
    from .slurm import commands

    sig = "USR2"
    commands.run(["scancel", f"--signal={sig}", "--batch", str(st["job_id"])])
    return {"fault": fault, "job_id": st["job_id"], "signal": sig, "at": at}


def network_args(fault: str, st: dict[str, Any], *, rank: int, seconds: float,
                 probability: float, rate: str = "1mbit", delay_ms: float = 20.0) -> tuple[str, list[str]]:
    """(the victim node or "", the ``local-cluster`` arguments) for a network fault on
    the node of ``rank`` of the job whose status is ``st``. Pure."""
    if fault == "heal":
        return "", ["heal"]
    node = _rank(st, rank)["node"]
    if fault == "partition-node":
        return node, [fault, node]
    if fault == "partition-peers":
        peers = sorted({r["node"] for r in st["ranks"]} - {node})
        if not peers:
            raise ResilienceError("partition-peers: every rank is on one node; no peer node to cut it from")
        return node, [fault, node, "--peers", ",".join(peers)]
    if fault == "partition-supervisor":
        ep = st.get("endpoints") or {}
        if not (ep.get("host") and ep.get("store_port") and ep.get("liveness_port")):
            raise ResilienceError("partition-supervisor: the status file names no supervisor endpoints")
        return node, [fault, node, "--supervisor-addr", ep["host"],
                      "--ports", f"{ep['store_port']},{ep['liveness_port']}"]
    if fault == "flap-node":
        if not 0 < seconds <= 600:
            raise ResilienceError(f"flap-node: --seconds must be in (0, 600], not {seconds}")
        return node, [fault, node, f"{seconds:g}"]
    if fault == "slow-node":
        if not re.fullmatch(r"\d+(\.\d+)?(bit|kbit|mbit|gbit)", rate) or not float(re.match(r"[\d.]+", rate).group()):
            raise ResilienceError(f"slow-node: --rate must be a link rate such as 800kbit or 2mbit, not {rate!r}")
        return node, [fault, node, rate]
    if fault == "delay-node":
        if not 0 < delay_ms <= 10000:
            raise ResilienceError(f"delay-node: --delay-ms must be in (0, 10000], not {delay_ms:g}")
        return node, [fault, node, f"{delay_ms:g}"]
    if not 0 < probability < 1:
        raise ResilienceError(f"lossy-node: --probability must be in (0, 1), not {probability}")
    return node, [fault, node, f"{probability:g}"]


def network_fault(fault: str, st: dict[str, Any], *, rank: int, seconds: float,
                  probability: float, rate: str = "1mbit", delay_ms: float = 20.0) -> dict[str, Any]:
    """Make a network fault on the local cluster (``local-cluster`` runs the rules)."""
    from . import lab

    node, args = network_args(fault, st, rank=rank, seconds=seconds, probability=probability, rate=rate,
                              delay_ms=delay_ms)
    at = lab.net_fault(*args, timeout=60 + (seconds if fault == "flap-node" else 0))
    done: dict[str, Any] = {"fault": fault, "at": at}
    if node:
        done.update(rank=rank, node=node)
    if fault == "flap-node":
        done["seconds"] = seconds
    if fault == "lossy-node":
        done["probability"] = probability
    if fault == "slow-node":
        done["rate"] = rate
    if fault == "delay-node":
        done["delay_ms"] = delay_ms
    return done


def _duty_cycle(pid: int, seconds: float, duty: float) -> None:
    end = time.time() + seconds
    try:
        while time.time() < end:
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.1 * duty)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.1 * (1 - duty))
    except ProcessLookupError:
        return
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def corrupt_newest(root: str) -> dict[str, Any]:
    """Flip one byte inside a tensor's data in the newest complete step's first shard.

    On a deduplicated L2 step (``checkpoint/dedup.py``) that file may hold tensors
    every rank reads: the whole step is then invalid for every rank, not one rank's copy."""
    import h5py

    from .checkpoint import manifest as mf

    steps = mf.complete_steps(root)
    if not steps:
        raise ResilienceError(f"no complete checkpoint under {root}")
    man = mf.read_manifest(root, steps[-1])
    shard = mf.shard_path(root, steps[-1], min(man.shards))
    with h5py.File(shard, "r") as f:
        names: list[str] = []
        f.visititems(lambda n, o: names.append(n) if isinstance(o, h5py.Dataset) and o.size > 8 else None)
        offset = f[names[0]].id.get_offset()
    with open(shard, "r+b") as f:
        f.seek(offset + 1)
        b = f.read(1)
        f.seek(offset + 1)
        f.write(bytes([b[0] ^ 0xFF]))
    return {"step": steps[-1], "shard": shard, "dataset": names[0]}


def fill(directory: str, keep_mb: int = 1) -> str:
    """Fill the filesystem of ``directory`` up to ``keep_mb`` MiB free; returns the filler path."""
    Path(directory).mkdir(parents=True, exist_ok=True)
    filler = os.path.join(directory, ".sr-fill")
    st = os.statvfs(directory)
    free = st.f_bavail * st.f_frsize - keep_mb * (1 << 20)
    with open(filler, "wb") as f:
        chunk = b"\0" * (1 << 20)
        while free > 0:
            try:
                f.write(chunk[: min(len(chunk), free)])
            except OSError:
                break
            free -= len(chunk)
    return filler
