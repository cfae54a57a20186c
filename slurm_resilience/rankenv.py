"""torchrun-style environment for one task of a Slurm step, then ``exec`` the program.

    python -m slurm_resilience.rankenv --master-addr A --master-port P --restart N -- cmd ...

Sets RANK=SLURM_PROCID, LOCAL_RANK=SLURM_LOCALID, WORLD_SIZE (the step's tasks),
LOCAL_WORLD_SIZE (the step's tasks on this node), GROUP_RANK=SLURM_NODEID (this
node's index in the step), MASTER_ADDR, MASTER_PORT and SR_RESTART (relaunches
before this one), so an unmodified ``dist.init_process_group(init_method="env://")``
script runs as under torchrun. With G tasks per node (``srun -N W -n W*G
--ntasks-per-node=G``, block distribution) rank r is local rank r % G of node r // G:

    node   n2          n3          n4           SLURM_STEP_TASKS_PER_NODE=2(x3)
    RANK   0  1        2  3        4  5         WORLD_SIZE=6
    LOCAL  0  1        0  1        0  1         LOCAL_WORLD_SIZE=2
    GROUP  0           1           2

Tasks per node come from the *step's* variable (SLURM_STEP_TASKS_PER_NODE, a
compressed list like ``2(x3)`` or ``3,2(x2)``), read at this node's index: the job's
SLURM_TASKS_PER_NODE / SLURM_NTASKS_PER_NODE are inherited from the batch step and
describe the allocation, not this step.
The supervisor picks MASTER_ADDR (NodeAddr of the step's first node, which Slurm
gives task 0) and MASTER_PORT (``supervisor.executors.relaunch.master_port``).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from typing import Mapping, Sequence


__all__ = ["expand_tasks_per_node", "rank_env", "main"]


_REQUIRED = ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NODEID")
# Most precise first: the step's own view, then what srun or sbatch exported.
_WORLD_VARS = ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS")
_PER_NODE_VARS = ("SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
_COUNT = re.compile(r"(\d+)(?:\(x(\d+)\))?")


def expand_tasks_per_node(spec: str) -> list[int]:
    """Pure: Slurm's compressed tasks-per-node list, one count per node.

    ``"2(x3)"`` → [2, 2, 2]; ``"3,2(x2)"`` → [3, 2, 2]; ``"4"`` → [4].

    Raises:
        ValueError: not such a list.
    """
    counts: list[int] = []
    for part in spec.split(","):
        m = _COUNT.fullmatch(part.strip())
        if not m:
            raise ValueError(f"bad tasks-per-node list {spec!r}: expected e.g. 2(x3) or 3,2(x2)")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def rank_env(slurm: Mapping[str, str], *, master_addr: str, master_port: int, restart: int) -> dict[str, str]:
    """Pure: the variables to add for one task.

    Raises:
        ValueError: a needed SLURM_* variable is missing (not run inside ``srun``), not an
            integer, or inconsistent (a rank or local rank outside its count).
    """
    missing = [var for var in _REQUIRED if var not in slurm]
    if missing:
        raise ValueError(f"not inside a Slurm task (missing {', '.join(missing)}): run under srun")
    try:
        rank, local_rank, node = (int(slurm[v]) for v in ("SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID"))
        world = int(next(slurm[v] for v in _WORLD_VARS if v in slurm))
    except ValueError:
        raise ValueError("SLURM_PROCID, SLURM_LOCALID, SLURM_NODEID and SLURM_NTASKS must be integers") from None
    spec = next((slurm[v] for v in _PER_NODE_VARS if slurm.get(v)), "1")
    counts = expand_tasks_per_node(spec)
    if len(counts) == 1:  # one count for every node (SLURM_NTASKS_PER_NODE=2)
        local_world = counts[0]
    elif 0 <= node < len(counts):
        local_world = counts[node]
    else:
        raise ValueError(f"SLURM_NODEID={node} but the step's tasks per node are {spec!r}")
    if not (0 <= rank < world and 0 <= local_rank < local_world):
        raise ValueError(f"inconsistent Slurm task: SLURM_PROCID={rank} of {world} tasks, "
                         f"SLURM_LOCALID={local_rank} of {local_world} on node {node} ({spec!r})")
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world),
            "GROUP_RANK": str(node), "LOCAL_WORLD_SIZE": str(local_world), "MASTER_ADDR": master_addr,
            "MASTER_PORT": str(master_port), "SR_RESTART": str(restart)}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slurm_resilience.rankenv -- cmd``: exec ``cmd`` with this task's rank variables set."""
    ap = argparse.ArgumentParser(prog="python -m slurm_resilience.rankenv")
    ap.add_argument("--master-addr", required=True)
    ap.add_argument("--master-port", type=int, required=True)
    ap.add_argument("--restart", type=int, default=0)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        ap.error("no command given: add `-- python train.py ...`")
    try:
        env = rank_env(os.environ, master_addr=args.master_addr, master_port=args.master_port,
                       restart=args.restart)
    except ValueError as exc:
        print(f"rankenv: error: {exc}", file=sys.stderr)
        return 2
    os.environ.update(env)
    os.execvp(command[0], command)  # never returns; raises OSError if command is not found


if __name__ == "__main__":
    sys.exit(main())
