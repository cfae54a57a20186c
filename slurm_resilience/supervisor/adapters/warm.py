"""Warm relaunch: the supervisor's side of the per-node zygotes (``launch/zygote.py``).

:class:`ZygotePool` starts one zygote step per worker and spare node with the job
(``srun -N1 -w NODE --job-name sr-zygote-NODE``), then, for a relaunch whose every
node has a live zygote, :meth:`ZygotePool.fork_step` asks each to fork its ranks and
returns a :class:`WarmStep` — the same ``name``/``node``/``process.poll()`` shape as a
cold srun step, so ``RelaunchExecutor.observe`` watches both alike. When any node
lacks a live zygote the relaunch runs cold (the caller starts the srun step) and a
new zygote is started for that node in the background.

Fencing: :meth:`WarmStep.kill` sends KILL to every node's zygote and waits only for
the nodes still reachable; a zygote that does not answer (a lost node) has its step
cancelled by Slurm in the background (``scancel --signal=KILL``), which kills its
forked ranks (they are in its cgroup) and nothing else.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Client, Connection, wait
from typing import Sequence

from ...files import write_private
from ...zygote_protocol import (
    INFO_DIR, KEY_FILE, ForkRequest, Kind, Reply, decode, encode, step_exit_code, warm_entry,
)


__all__ = ["ZygotePool", "WarmStep"]


class _Zygote:
    def __init__(self, node: str, step) -> None:
        self.node, self.step, self.conn = node, step, None
        self.name = step.name

    @property
    def process(self):
        """The ``Popen`` of the zygote's step."""
        return self.step.process


class ZygotePool:
    """The zygotes of one job. ``launcher``: a ``slurm.steps.SrunLauncher``."""

    def __init__(self, *, job_dir: str, nodes: Sequence[str], launcher, preload: Sequence[str] = (),
                 python: str = sys.executable, env: dict[str, str] | None = None) -> None:
        self.job_dir, self.launcher, self.preload, self.python = job_dir, launcher, tuple(preload), python
        self.env = dict(env or {})  # for the zygote steps, so their forks have it (e.g. NCCL's watchdog)
        self.key = secrets.token_hex(32).encode()
        write_private(os.path.join(job_dir, KEY_FILE), self.key)
        self.zygotes: dict[str, _Zygote] = {}
        for node in nodes:
            self.start(node)

    def start(self, node: str) -> None:
        """Start ``node``'s zygote step (returns at once; it is ready when its info file is)."""
        try:
            os.unlink(self._info(node))
        except FileNotFoundError:
            pass
        argv = [self.python, "-m", "slurm_resilience.launch.zygote", "--job-dir", self.job_dir, "--node", node,
                "--addr", self.launcher.address(node)]
        if self.preload:
            argv += ["--preload", ",".join(self.preload)]
        step = self.launcher.launch(name=f"sr-zygote-{node}", node=node, argv=argv, env=dict(self.env),
                                    log_path=os.path.join(self.job_dir, f"zygote-{node}.log"))
        self.zygotes[node] = _Zygote(node, step)

    def _info(self, node: str) -> str:
        return os.path.join(self.job_dir, INFO_DIR, f"{node}.json")

    def connect(self, node: str) -> Connection | None:
        """``node``'s zygote connection, or None when it is not (or no longer) there."""
        z = self.zygotes.get(node)
        if z is None or z.process.poll() is not None:
            return None
        if z.conn is None:
            try:
                with open(self._info(node)) as f:
                    info = json.load(f)
                z.conn = Client((info["addr"], info["port"]), authkey=self.key)
            except (OSError, ValueError, KeyError, EOFError):
                return None
        return z.conn

    def wait_ready(self, nodes: Sequence[str], timeout_s: float) -> bool:
        """Block until every one of ``nodes`` has a connected zygote, or ``timeout_s`` passed
        or one of them exited (it could not preload: its log says why)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self.connect(n) is not None for n in nodes):
                return True
            if any(self.zygotes.get(n) is None or self.zygotes[n].process.poll() is not None for n in nodes):
                return False
            time.sleep(0.05)
        return False

    def fork_step(self, *, name: str, nodes: Sequence[str], tasks_per_node: int, command: Sequence[str],
                  master_addr: str, port: int, attempt: int, log_path: str,
                  progress_file: str = "", job_dir: str = "") -> "WarmStep | None":
        """Fork every rank of the step through the zygotes; None (nothing started) when a
        node has no live zygote (a new one is started for it), a zygote refused, or the
        command is not ``python script.py ...`` (``warm_entry``)."""
        if warm_entry(command, self.python) is None:
            return None
        conns = {}
        for node in nodes:
            conn = self.connect(node)
            if conn is None:
                self.drop(node)
                self.start(node)  # for the next relaunch; this one runs cold
                return None
            conns[node] = conn
        step = WarmStep(name=name, node=nodes[0], conns=conns, pool=self)
        umask = os.umask(0o077)
        os.umask(umask)
        for index, node in enumerate(nodes):
            for local in range(tasks_per_node):
                req = ForkRequest(rank=index * tasks_per_node + local, local_rank=local, node_index=index,
                                  step_nodes=tuple(nodes), tasks_per_node=tasks_per_node, step_name=name,
                                  master_addr=master_addr, master_port=port, restart=attempt,
                                  command=tuple(command), cwd=os.getcwd(), umask=umask, log_path=log_path,
                                  progress_file=progress_file, job_dir=job_dir)
                try:
                    conns[node].send_bytes(encode(req))
                except OSError:
                    step.kill(skip=(node,))
                    self.drop(node)
                    return None
        if not step.wait_forked(len(nodes) * tasks_per_node, timeout_s=30):
            step.kill(skip=())
            return None
        return step

    def drop(self, node: str) -> None:
        """Forget ``node``'s zygote and fence it: its step is cancelled in the background."""
        z = self.zygotes.pop(node, None)
        if z is None:
            return
        if z.conn is not None:
            z.conn.close()
        threading.Thread(target=self._cancel, args=(z,), daemon=True, name=f"fence-{node}").start()

    def _cancel(self, z: _Zygote) -> None:
        try:
            self.launcher.kill(z)
        except Exception as exc:  # the controller is slow: Slurm ends the step with the job
            print(f"slurm-resilience: warning: zygote step of {z.node} not cancelled: {exc}", file=sys.stderr,
                  flush=True)

    def close(self) -> None:
        """Close every zygote's connection and cancel its step."""
        for node in list(self.zygotes):
            z = self.zygotes.pop(node)
            if z.conn is not None:
                z.conn.close()
            self._cancel(z)
            try:
                z.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass


class WarmStep:
    """A relaunch step forked by the zygotes: ``process`` is itself (``poll()``)."""

    def __init__(self, *, name: str, node: str, conns: dict[str, Connection], pool: ZygotePool) -> None:
        self.name, self.node, self.conns, self.pool = name, node, conns, pool
        self.process = self
        self.pids: dict[int, tuple[str, int]] = {}  # rank → (node, pid)
        self.codes: dict[int, int] = {}  # rank → exit code
        self.refused: list[str] = []

    def _pump(self, timeout: float) -> None:
        by_conn = {c: n for n, c in self.conns.items()}
        for conn in wait(list(by_conn), timeout):
            try:
                reply = decode(conn.recv_bytes())
            except (EOFError, OSError, ValueError):  # the zygote is gone, and its ranks with its step
                node = by_conn[conn]
                self.conns.pop(node, None)
                self.pool.drop(node)
                for rank in [r for r, (where, _) in self.pids.items() if where == node]:
                    self.codes.setdefault(rank, -9)  # fenced with the zygote's step
                continue
            if isinstance(reply, Reply):
                self._note(by_conn[conn], reply)

    def _note(self, node: str, reply: Reply) -> None:
        if reply.kind is Kind.FORKED:
            self.pids[reply.rank] = (node, reply.pid)
        elif reply.kind is Kind.EXITED:
            self.codes[reply.rank] = reply.code
        elif reply.kind is Kind.REFUSED:
            self.refused.append(f"{node}: {reply.reason}")
            print(f"slurm-resilience: warning: zygote of {node} refused rank {reply.rank}: {reply.reason}",
                  file=sys.stderr, flush=True)
        elif reply.kind is Kind.KILLED:
            self.conns.pop(node, None)

    def wait_forked(self, ranks: int, timeout_s: float) -> bool:
        """Wait until ``ranks`` ranks were forked (False: refused, every zygote gone, or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        while len(self.pids) < ranks and not self.refused and time.monotonic() < deadline and self.conns:
            self._pump(0.05)
        return len(self.pids) == ranks

    def poll(self) -> int | None:
        """The step's exit code once every rank has exited, else None."""
        self._pump(0)
        if self.pids and len(self.codes) >= len(self.pids):
            return step_exit_code([self.codes[r] for r in sorted(self.codes)])
        return None

    def kill(self, *, skip: Sequence[str], timeout_s: float = 10) -> None:
        """SIGKILL every rank through its zygote; wait for the answers of the nodes not in
        ``skip`` (known lost: their zygote steps are cancelled by Slurm instead)."""
        for node in list(self.conns):
            if node in skip:
                self.conns.pop(node)
                self.pool.drop(node)
                continue
            try:
                self.conns[node].send_bytes(encode(Kind.KILL))
            except OSError:
                self.conns.pop(node)
                self.pool.drop(node)
        deadline = time.monotonic() + timeout_s
        while self.conns and time.monotonic() < deadline:
            self._pump(0.05)
        for node in list(self.conns):  # no answer: fence through Slurm
            self.conns.pop(node)
            self.pool.drop(node)
