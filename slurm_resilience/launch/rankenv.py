"""torchrun-style environment for one task of a Slurm step, then ``exec`` the program.

    python -m slurm_resilience.launch.rankenv --master-addr A --master-port P --restart N -- cmd ...

Sets RANK=SLURM_PROCID, LOCAL_RANK=SLURM_LOCALID, WORLD_SIZE=SLURM_NTASKS,
LOCAL_WORLD_SIZE (tasks on this node), GROUP_RANK=SLURM_NODEID, MASTER_ADDR,
MASTER_PORT and SR_RESTART (relaunches before this one), so an unmodified
``dist.init_process_group(init_method="env://")`` script runs as under torchrun.
The supervisor picks MASTER_ADDR (NodeAddr of the step's first node, which Slurm
gives task 0) and MASTER_PORT (``supervisor.relaunch.master_port``).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Mapping, Sequence

_FROM_SLURM = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "WORLD_SIZE": "SLURM_NTASKS",
               "GROUP_RANK": "SLURM_NODEID"}


def rank_env(slurm: Mapping[str, str], *, master_addr: str, master_port: int, restart: int) -> dict[str, str]:
    """Pure: the variables to add for one task.

    Raises:
        ValueError: a needed SLURM_* variable is missing (not run inside ``srun``).
    """
    missing = [var for var in _FROM_SLURM.values() if var not in slurm]
    if missing:
        raise ValueError(f"not inside a Slurm task (missing {', '.join(missing)}): run under srun")
    env = {name: slurm[var] for name, var in _FROM_SLURM.items()}
    per_node = slurm.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0].split(",")[0]
    env.update(LOCAL_WORLD_SIZE=per_node, MASTER_ADDR=master_addr, MASTER_PORT=str(master_port),
               SR_RESTART=str(restart))
    return env


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_resilience.launch.rankenv")
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
