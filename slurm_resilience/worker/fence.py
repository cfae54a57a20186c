"""Is this rank still the job's? Slurm's answer, for a rank that lost the store.

A rank that cannot reach the job's store cannot tell two cases apart by itself: the
batch host is lost (the store with it), and the rank should persist its state and
requeue the job (``headless.py``); or *its own node* was cut off the network, the
supervisor has replaced it meanwhile, and the job trains on without it: then the
rank is fenced, and anything it wrote — a shard committed to the shared tier, a
requeue of the running job — would be a split brain. Slurm is the arbiter: the
supervisor takes a lost node out of the job (``scontrol update JobId NodeList``) and
isolates it (DRAIN/DOWN). So before the headless ending writes anything, the rank
asks slurmctld (:func:`ask_slurm`) and goes on only when its node is still one of
the job's and is not isolated; no answer from slurmctld counts as fenced too (a
node that reaches neither the store nor slurmctld is the one cut off, or nothing
could be requeued anyway).
"""

from __future__ import annotations

from typing import Mapping

from ..errors import SlurmCommandError
from ..slurm import commands
from ..slurm.parse import expand_hostlist, node_state_flags, parse_scontrol_jobs


__all__ = ["ISOLATED", "slurm_fence", "ask_slurm"]


ISOLATED = frozenset({"DOWN", "DRAIN", "DRAINED", "DRAINING", "FAIL", "FAILING"})


def slurm_fence(records: Mapping[str, Mapping[str, str]], job_id: str, node: str,
                node_state: str | None) -> str | None:
    """Pure: why ``node``'s rank is no longer part of job ``job_id``, or None when it is.

    ``records``: ``scontrol -o show job JOB`` parsed (a het job's components are
    records of their own: the node may be in any of them); ``node_state``: the
    node's ``State`` (None: unknown)."""
    mine = [r for r in records.values() if job_id in (r.get("JobId"), r.get("HetJobId"))]
    if not mine:
        return f"Slurm has no record of job {job_id}"
    if not any(node in expand_hostlist(r.get("NodeList", "") or "") for r in mine if r.get("NodeList") != "(null)"):
        return f"node {node} is no longer one of job {job_id}'s nodes"
    flags = node_state_flags(node_state or "")
    if flags & ISOLATED:
        return f"node {node} is {node_state} in Slurm"
    return None


def ask_slurm(job_id: str, node: str | None) -> str | None:
    """Why this rank is fenced according to slurmctld (:func:`slurm_fence`), or None;
    slurmctld not answering is a reason too. No node name (not under Slurm): None."""
    if not node or not str(job_id).isdigit():
        return None
    try:
        out = commands.run(["scontrol", "-o", "show", "job", str(job_id)], timeout=5).stdout
        state = commands.show_nodes([node]).get(node, {}).get("State")
        return slurm_fence(parse_scontrol_jobs(out), str(job_id), node, state)
    except (SlurmCommandError, OSError) as exc:
        return f"slurmctld did not answer ({exc})"
    except ValueError as exc:  # a node list or name Slurm should never print
        return f"Slurm's answer is unreadable ({exc})"
