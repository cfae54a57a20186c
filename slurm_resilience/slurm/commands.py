"""The only place that runs Slurm commands: argv lists, a timeout, typed errors.

Never a shell; node names are validated before they reach argv.
"""

from __future__ import annotations

import os
import pwd
import subprocess
from typing import Mapping, Sequence

from slurm_resilience.errors import SlurmCommandError
from slurm_resilience.slurm.parse import (
    compress_hostlist,
    expand_hostlist,
    parse_sbatch_job_id,
    parse_scontrol_jobs,
    parse_scontrol_nodes,
    validate_node_name,
)
from slurm_resilience.slurm.rights import operator_verdict, parse_show_config, uses_slurmdbd

__all__ = [
    "run",
    "show_nodes",
    "set_node_state",
    "cancel_step",
    "step_stat",
    "hostnames",
    "sbatch",
    "job_state",
    "node_address",
    "show_job",
    "set_job_nodes",
    "slurm_config",
    "operator_rights",
    "requeue_excluding",
]

_NODE_STATES = frozenset({"DOWN", "DRAIN", "RESUME", "UNDRAIN", "IDLE", "FAIL", "POWER_DOWN", "POWER_UP"})


def run(
    argv: Sequence[str],
    *,
    timeout: float = 10.0,
    env: Mapping[str, str] | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (no shell) and capture text output.

    Raises:
        SlurmCommandError: non-zero exit (when ``check``), timeout
            (``returncode`` None) or missing binary.
    """
    argv = list(argv)
    try:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=dict(env) if env is not None else None,
        )
    except FileNotFoundError:
        raise SlurmCommandError(
            argv, None, f"`{argv[0]}` not found: install Slurm (scripts/install-deps.sh)"
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmCommandError(argv, None, f"timed out after {timeout:g}s") from None
    if check and proc.returncode != 0:
        raise SlurmCommandError(argv, proc.returncode, proc.stderr or "")
    return proc


def show_nodes(names: Sequence[str] | None = None) -> dict[str, dict[str, str]]:
    """``scontrol -o show node [names]`` parsed into ``{node: {key: value}}``.

    Raises:
        SlurmCommandError, ValueError (invalid node name).
    """
    argv = ["scontrol", "-o", "show", "node"]
    if names:
        argv.append(",".join(validate_node_name(n) for n in names))
    return parse_scontrol_nodes(run(argv).stdout)


def set_node_state(node: str, state: str, reason: str) -> None:
    """``scontrol update nodename=NODE state=STATE reason=REASON``.

    Raises:
        SlurmCommandError, ValueError (invalid node name or state).
    """
    validate_node_name(node)
    if state.upper() not in _NODE_STATES:
        raise ValueError(f"invalid node state {state!r}: expected one of {', '.join(sorted(_NODE_STATES))}")
    run(["scontrol", "update", f"nodename={node}", f"state={state.upper()}", f"reason={reason}"])


def cancel_step(job_id: str, step_id: str, signal: str | None = None) -> None:
    """``scancel --ctld [--signal=SIG] JOB.STEP``.

    ``--ctld``: the request goes to slurmctld, which passes it on to the step's
    slurmds in the background. Without it, ``scancel --signal`` sends the signal to
    each slurmd itself and waits for it: on a hung or powered-off node that is
    ``MessageTimeout`` (5.0 s measured on the lab cluster with a frozen node) spent
    inside a recovery. With it: 6 ms, frozen node or not.

    Raises:
        SlurmCommandError, ValueError (non-numeric ids or odd signal name).
    """
    if not str(job_id).isdigit() or not str(step_id).isdigit():
        raise ValueError(f"invalid step {job_id!r}.{step_id!r}: ids must be numeric")
    argv = ["scancel", "--ctld"]
    if signal is not None:
        if not signal.isalnum():
            raise ValueError(f"invalid signal {signal!r}")
        argv.append(f"--signal={signal}")
    argv.append(f"{job_id}.{step_id}")
    run(argv)


def step_stat(job_id: str, step_id: str, timeout: float) -> None:
    """``sstat -n -P -j JOB.STEP -o JobID``: a request that the step's node's slurmd
    must answer (slurmd asks its slurmstepd), bounded by ``timeout``. The node-level
    liveness probe (``SrunLauncher.probe_slurmd``): a stopped or hung slurmd still
    accepts TCP connections into its listen backlog, but never answers this.

    Raises:
        SlurmCommandError: no answer within ``timeout`` (``returncode`` None) or an
            error answer; ValueError (non-numeric ids).
    """
    if not str(job_id).isdigit() or not str(step_id).isdigit():
        raise ValueError(f"invalid step {job_id!r}.{step_id!r}: ids must be numeric")
    run(["sstat", "-n", "-P", "-j", f"{job_id}.{step_id}", "-o", "JobID"], timeout=timeout)


def show_job(job_id: str) -> dict[str, str]:
    """``scontrol -o show job ID`` parsed into ``{key: value}`` (one record: for a
    heterogeneous job component, pass the component's own job id).

    Raises:
        SlurmCommandError: scontrol failed or printed no record for ``job_id``.
        ValueError: a non-numeric job id.
    """
    if not str(job_id).isdigit():
        raise ValueError(f"invalid job id {job_id!r}: must be numeric")
    argv = ["scontrol", "-o", "show", "job", str(job_id)]
    jobs = parse_scontrol_jobs(run(argv).stdout)
    if str(job_id) not in jobs:
        raise SlurmCommandError(argv, 0, f"no record for job {job_id} in the output")
    return jobs[str(job_id)]


def set_job_nodes(job_id: str, nodes: Sequence[str]) -> None:
    """Shrink a running job to ``nodes``: ``scontrol update JobId=ID NodeList=…``.

    Slurm kills the job's steps on the nodes left out and frees them; it refuses to
    leave out the job's BatchHost.

    Raises:
        SlurmCommandError, ValueError (non-numeric job id, no nodes, invalid node name).
    """
    if not str(job_id).isdigit():
        raise ValueError(f"invalid job id {job_id!r}: must be numeric")
    if not nodes:
        raise ValueError(f"job {job_id}: a running job keeps at least one node")
    nodelist = compress_hostlist(validate_node_name(n) for n in nodes)
    run(["scontrol", "update", f"JobId={job_id}", f"NodeList={nodelist}"])


def slurm_config() -> dict[str, str]:
    """``scontrol show config`` as ``{Key: value}``.

    Raises:
        SlurmCommandError.
    """
    return parse_show_config(run(["scontrol", "show", "config"]).stdout)


def operator_rights(config: Mapping[str, str] | None = None) -> tuple[bool, str]:
    """May this process's user change node states? ``(verdict, why)`` from the
    Slurm config (root, SlurmUser) and, where accounting runs through slurmdbd,
    ``sacctmgr show user`` (AdminLevel). See :mod:`slurm.rights`.

    Raises:
        SlurmCommandError: ``scontrol show config`` failed (sacctmgr failing only
            means no admin level is known).
    """
    uid = os.getuid()
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = str(uid)
    config = slurm_config() if config is None else config
    level = None
    if uid != 0 and uses_slurmdbd(config):
        proc = run(["sacctmgr", "-nP", "show", "user", user, "format=AdminLevel"], check=False)
        level = proc.stdout.strip().splitlines()[0] if proc.returncode == 0 and proc.stdout.strip() else None
    return operator_verdict(uid=uid, user=user, config=config, admin_level=level)


def requeue_excluding(job_id: str, exclude: Sequence[str] = ()) -> str | None:
    """Requeue a running job so that it never runs on ``exclude`` again: ``scontrol
    requeue``, then ``scontrol update JobId=… ExcNodeList=…`` (the job's own
    exclusions kept) while the requeued job waits for its begin time.

    Measured on Slurm 22.05 as the job's owner: a running job's ``ExcNodeList``
    cannot be changed ("Job is no longer pending execution"); a requeued one's can,
    even after the job was shrunk. ``requeuehold`` first is no better: after a
    shrink, without slurmdbd, every update of the held job waits for a DB index
    that never comes, and a job left held never runs again. Nor can the update
    always land: while a step of the job is still on a dead node, the requeue does
    not complete until Slurm declares that node down, and until then the job has no
    DB index and every update is refused (measured without slurmdbd; an operator's
    DOWN ends that at once).

    Returns None, or why the exclusion failed (the job is requeued regardless).

    Raises:
        SlurmCommandError: the requeue itself failed.
        ValueError: non-numeric job id, invalid node name.
    """
    if not str(job_id).isdigit():
        raise ValueError(f"invalid job id {job_id!r}: must be numeric")
    bad = [validate_node_name(n) for n in exclude]
    kept: list[str] = []
    if bad:
        try:
            before = show_job(job_id).get("ExcNodeList", "(null)")
            kept = [] if before in ("", "(null)") else expand_hostlist(before)
        except SlurmCommandError as exc:
            return f"requeued without excluding {', '.join(bad)}: {exc}"
    run(["scontrol", "requeue", str(job_id)], timeout=15)
    if not bad:
        return None
    try:  # a short time-out: Slurm kills this process KillWait after the requeue
        run(["scontrol", "update", f"JobId={job_id}",
             f"ExcNodeList={compress_hostlist(sorted(set(kept) | set(bad)))}"], timeout=3)
    except SlurmCommandError as exc:
        return f"requeued, but excluding {', '.join(bad)} failed: {exc}"
    return None


def hostnames(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist (pure; no command is run)."""
    return expand_hostlist(hostlist)


def sbatch(script_path: str, args: Sequence[str] = ()) -> str:
    """Submit with ``sbatch --parsable [args] script``; returns the job id.

    Raises:
        SlurmCommandError, ValueError (unparsable output).
    """
    proc = run(["sbatch", "--parsable", *args, script_path], timeout=30.0)
    return parse_sbatch_job_id(proc.stdout)


def job_state(job_id: str) -> str | None:
    """``squeue -h -j ID -o %T``: state such as RUNNING, or None once not queued.

    Raises:
        SlurmCommandError: squeue failed for another reason than an unknown job.
    """
    proc = run(["squeue", "-h", "-j", str(job_id), "-o", "%T"], check=False)
    if proc.returncode != 0:
        if "invalid job id" in (proc.stderr or "").lower():
            return None
        raise SlurmCommandError(["squeue", "-h", "-j", str(job_id), "-o", "%T"], proc.returncode, proc.stderr)
    lines = [ln.strip() for ln in proc.stdout.splitlines() if ln.strip()]
    return lines[0] if lines else None


def node_address(info: Mapping[str, str]) -> tuple[str, int | None]:
    """``(NodeAddr, Port)`` from one ``show_nodes`` entry; Port None if absent."""
    addr = info.get("NodeAddr") or info.get("NodeHostName") or info["NodeName"]
    port = info.get("Port")
    return addr, int(port) if port and port.isdigit() else None
