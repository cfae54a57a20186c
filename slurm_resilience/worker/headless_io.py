"""The headless ending's files and Slurm call (the decisions are in ``headless.py``).

    JOBDIR/headless/r{restarts}-rank{R}     rank R of run ``restarts`` persisted: TIME STEP (0600)
    JOBDIR/headless/r{restarts}-requeue-rank{R}  what rank R did in its requeue turn, and when (JSON)
    L2ROOT/step-S/rank-R.h5                 its shard: the state of its last completed step
    L2ROOT/step-S/manifest.json             lists only shards already renamed into place
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys
import time

from ..checkpoint import layout
from ..checkpoint import manifest as mf
from ..checkpoint.hdf5_format import shard_crc32, write_shard
from ..errors import CheckpointError, SlurmCommandError
from ..files import write_private
from ..slurm import commands
from ..slurm.steps import deferred
from ..slurm.parse import parse_scontrol_jobs, validate_node_name
from .fence import ask_slurm
from .headless import (SETTLE_S, STAGGER_S, RequeueStep, batch_host_mark, exclusion, manifest_ranks, requeue_step,
                       requeue_turn, should_requeue)


__all__ = ["HEADLESS_DIR", "ENGINE_DRAIN_S", "persist", "commit", "mark", "record", "marked", "requeue", "end_headless"]


HEADLESS_DIR = "headless"
ENGINE_DRAIN_S = 5.0  # a checkpoint in flight gets this long to end (its peers are leaving too)
_MARK = re.compile(r"r(\d+)-rank(\d+)$")
_SHARD = re.compile(r"rank-(\d+)\.h5$")


def persist(state, checkpoints, *, rank: int, world_size: int) -> str | None:
    """Write this rank's state (its last completed step) to the shared tier and commit
    what is complete. Returns the shard's path, or None without a shared tier.

    Raises:
        CheckpointError: the shard or the manifest cannot be written.
    """
    spec = next((s for s in checkpoints.specs if s.storage == "shared"), None)
    if spec is None:
        return None
    checkpoints.wait(timeout=ENGINE_DRAIN_S)
    root = checkpoints.root(spec, rank)
    step = state.step
    own = checkpoints.ownership
    if own.committed(root, step):
        return layout.step_dir(root, step)  # committed already (a regular checkpoint of this step)
    if os.path.isfile(layout.manifest_path(root, step)):  # its shards would count as ours
        raise CheckpointError(f"step {step} under {root} is another run's: not persisted there")
    path = layout.shard_path(root, step, rank)
    write_shard(path, state.state_dict(), attrs={"step": step, "rank": rank, "world_size": world_size})
    commit(root, step, world_size, spec.name, sharded=bool(state.sharded), ownership=own)
    return path


def commit(root: str, step: int, world_size: int, tier: str, *, sharded: bool, ownership=None) -> bool:
    """Write the manifest of ``step`` listing the complete shards, when they make a
    restorable set (:func:`~.headless.manifest_ranks`) and no manifest exists yet.
    Every rank calls this after its own rename, so the last one sees every shard.
    ``ownership`` (the engine's ``ownership.Ownership``) names the run in the manifest."""
    if os.path.isfile(layout.manifest_path(root, step)):
        return False
    sdir = layout.step_dir(root, step)
    present = {int(m.group(1)) for name in os.listdir(sdir) if (m := _SHARD.fullmatch(name))}
    ranks = manifest_ranks(present, world_size, sharded)
    if ranks is None:
        return False
    shards = {}
    for r in sorted(ranks):
        p = layout.shard_path(root, step, r)
        shards[r] = mf.ShardRecord(layout.shard_name(r), os.path.getsize(p), shard_crc32(p))
    mf.write_manifest(root, mf.Manifest(step=step, world_size=world_size, tier=tier, shards=shards,
                                        created=time.time(), extra={"headless": True},
                                        **(ownership.stamp() if ownership is not None else {})))
    return True


def mark(job_dir: str, restarts: int, rank: int, step: int | None = None) -> None:
    """Rank ``rank`` of run ``restarts`` persisted: ``TIME [STEP]`` (the step it persisted:
    a headless one, or one a regular checkpoint had committed already)."""
    text = f"{time.time()}" + ("" if step is None else f" {step}")
    write_private(os.path.join(job_dir, HEADLESS_DIR, f"r{restarts}-rank{rank}"), text + "\n")


def record(job_dir: str, restarts: int, rank: int, said: str) -> None:
    """``JOBDIR/headless/r{restarts}-requeue-rank{R}``: what rank R did when its turn to
    requeue came (the first requeues; the later ones find it done), and when.
    The job's one trace of it where the rank's stderr went to a lost ``srun`` client
    (a het job's steps are run from component 0)."""
    write_private(os.path.join(job_dir, HEADLESS_DIR, f"r{restarts}-requeue-rank{rank}"),
                  json.dumps({"t": time.time(), "rank": rank, "said": said}) + "\n")


def marked(job_dir: str, restarts: int) -> set[int]:
    """Ranks of run ``restarts`` that have persisted."""
    try:
        names = os.listdir(os.path.join(job_dir, HEADLESS_DIR))
    except FileNotFoundError:
        return set()
    return {int(m.group(2)) for n in names if (m := _MARK.fullmatch(n)) and int(m.group(1)) == restarts}


def requeue(job_id: str, restarts: int, *, isolate_state: str = "auto", probe_timeout_s: float = 0.3) -> str:
    """Requeue the job, excluding its lost batch host, unless this run was requeued
    already. The host is first marked DOWN when its slurmd does not answer and this
    user may (:func:`~.headless.batch_host_mark`): Slurm then completes the requeue at
    once instead of after ``SlurmdTimeout``. A het job (``job_id``: the leader, whose
    ``BatchHost`` is component 0's node) is requeued whole by Slurm itself as soon as
    that node is DOWN; then only the exclusion is set (:func:`~.headless.requeue_step`).
    Returns what was done.

    Raises:
        SlurmCommandError: ``scontrol`` failed (the job may be requeued already).
    """
    job = commands.show_job(job_id)
    if not should_requeue(job, restarts):
        return f"job {job_id} is {job.get('JobState')} with {job.get('Restarts')} restarts: not requeued again"
    host = job.get("BatchHost", "")
    host = "" if host in ("", "(null)") else host
    note = _mark(job_id, host, isolate_state, probe_timeout_s) if host else ""
    with deferred(signal.SIGTERM):  # SIGTERM: Slurm's for the requeue waits until the exclusion is set
        step = requeue_step(commands.show_job(job_id), restarts)
        if step is RequeueStep.REQUEUE:
            try:
                problem = commands.requeue_excluding(job_id, [host] if host else [])
            except SlurmCommandError:  # Slurm requeued it meanwhile ("Job is pending execution")?
                step = requeue_step(commands.show_job(job_id), restarts)
                if step is not RequeueStep.EXCLUDE:
                    raise
            else:
                return f"requeued job {job_id} without its lost batch host {host}{note}" + _why(problem)
        if step is RequeueStep.NOTHING:
            return f"job {job_id} ran on after its batch host {host} was marked{note}: not requeued"
        problem = _exclude(job_id, host) if host else None
    return f"Slurm requeued job {job_id} itself once its batch host {host} was DOWN{note}; excluded it" + _why(problem)


def _why(problem: str | None) -> str:
    return f" ({problem})" if problem else ""


def _exclude(job_id: str, host: str) -> str | None:
    """Keep ``host`` out of the pending (requeued) job's batch component
    (:func:`~.headless.exclusion`); None, or why not."""
    try:
        records = parse_scontrol_jobs(commands.run(["scontrol", "-o", "show", "job", job_id]).stdout)
        update = exclusion(records, job_id, validate_node_name(host))
        if update is not None:
            commands.run(["scontrol", "update", f"JobId={update[0]}", f"ExcNodeList={update[1]}"],
                         timeout=3)  # short: Slurm kills this process KillWait after the requeue
    except (SlurmCommandError, ValueError) as exc:
        return f"requeued, but excluding {host} failed: {exc}"
    return None


def _mark(job_id: str, host: str, isolate_state: str, probe_timeout_s: float) -> str:
    """Mark the lost batch host as :func:`batch_host_mark` says; returns a note for the log."""
    try:
        addr, port = commands.node_address(commands.show_nodes([host])[host])
        operator = commands.operator_rights()[0] if isolate_state == "auto" else True
    except (SlurmCommandError, KeyError, ValueError) as exc:
        return f" (not marked: {exc})"
    try:
        with socket.create_connection((addr, port or 6818), timeout=probe_timeout_s):
            reachable = True
    except OSError:
        reachable = False
    state = batch_host_mark(isolate_state, operator, reachable)
    if state is None:
        return " (node not marked: " + ("its slurmd answers)" if reachable else f"isolate_state {isolate_state})")
    try:
        commands.set_node_state(host, state, f"slurm_resilience: batch host of job {job_id} lost")
    except (SlurmCommandError, ValueError) as exc:
        return f" (marking it {state} failed: {exc})"
    return f", marked {state}"


def end_headless(*, state, checkpoints, rank: int | None, world_size: int | None, job_id: str,
                 job_dir: str, config=None, out=sys.stderr, node: str | None = None) -> None:
    """This rank's headless ending: persist (when it holds state), mark, requeue in turn.

    First Slurm is asked whether this rank is still the job's (``fence.ask_slurm``;
    ``node``: this rank's node, by default ``SLURMD_NODENAME``): a rank whose own node
    was cut off and replaced is fenced and writes nothing, requeues nothing.

    Returns when this rank's part is over (Slurm's SIGTERM for the requeue usually ends
    the process first)."""
    if rank is None or world_size is None or not (state.live and state.objects):
        print("slurm_resilience: the job's store is gone; no state held here, exiting", file=out)
        return
    fenced = ask_slurm(job_id, node if node is not None else os.environ.get("SLURMD_NODENAME"))
    if fenced:
        print(f"slurm_resilience: rank {rank} lost the job's store and is fenced: {fenced}; "
              f"nothing written, nothing requeued", file=out, flush=True)
        return
    restarts = int(os.environ.get("SLURM_RESTART_COUNT", "0") or 0)
    try:
        where = persist(state, checkpoints, rank=rank, world_size=world_size)
    except (CheckpointError, OSError) as exc:
        print(f"slurm_resilience: rank {rank}: persisting step {state.step} failed: {exc}", file=out)
        where = None
    else:
        mark(job_dir, restarts, rank, state.step)
    print(f"slurm_resilience: the job's store is gone (batch host lost); rank {rank} persisted step "
          f"{state.step} ({where or 'nothing written'})", file=out, flush=True)
    t0 = time.monotonic()
    last_turn = SETTLE_S + STAGGER_S * world_size
    while not requeue_turn(rank, marked(job_dir, restarts), world_size, time.monotonic() - t0):
        if time.monotonic() - t0 > last_turn:
            return
        time.sleep(0.1)
    if not job_id.isdigit():
        print("slurm_resilience: no scheduler to requeue with: run the job again in the same job "
              "directory to resume", file=out)
        return
    try:
        opts = {} if config is None else {"isolate_state": config.recovery.isolate_state,
                                          "probe_timeout_s": config.detect.probe_timeout_s}
        said = requeue(job_id, restarts, **opts)
    except (SlurmCommandError, ValueError) as exc:
        said = f"requeue after losing the batch host failed: {exc}"
    record(job_dir, restarts, rank, said)
    print(f"slurm_resilience: rank {rank}: {said}", file=out, flush=True)
