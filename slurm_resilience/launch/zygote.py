"""The per-node zygote: import torch once, fork ranks of an unmodified script on request.

    python -m slurm_resilience.launch.zygote --job-dir D --node N --addr A [--preload numpy,...]

Started by the relaunch supervisor as its own one-task ``srun`` step on every worker
and spare node (``supervisor/adapters/warm.py``), before it is needed. It imports torch (with ``torch._dynamo``) and
the ``run.preload`` modules, listens on ``A:<free port>`` for connections that pass
the ``multiprocessing.connection`` challenge with the per-job key (``job_dir/
zygote.key``, 0600; no unauthenticated request is ever read), and writes
``job_dir/zygotes/N.json`` (0600) when ready. For each FORK it forks a child that
becomes the rank as a cold task of the relaunch step would be
(:func:`_become_rank`), and reports FORKED, then EXITED with the rank's exit code.
KILL SIGKILLs the process group of every rank the connection started. The zygote
stays single-threaded: it waits with ``select`` and reaps with ``waitpid(WNOHANG)``.

Before the first rank of a step on the step's first node, the zygote forks a *store
host* (:func:`_host_store`): a child that serves the step's ``TCPStore`` on
``MASTER_PORT`` — torchrun's agent store; the ranks get ``TORCHELASTIC_USE_AGENT_STORE``
and all connect to it as clients — so no rank's ``init_process_group`` backs off
waiting for rank 0's server. The zygote forks the ranks only once it listens (bounded
by ``STORE_WAIT_S``; else REFUSED, the relaunch runs cold) and ends it when the step's
ranks on this node have all exited, or on KILL; it dies with the zygote.

The children stay in the zygote's step (its cgroup), so losing the node kills them
with it, and ``scancel`` of the zygote step fences them like a cold step.
"""

from __future__ import annotations

import argparse
import atexit
import builtins
import ctypes
import importlib
import importlib.machinery
import os
import select
import signal
import socket
import struct
import sys
import threading
import types
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge
from typing import Sequence

from ..files import makedirs_private, write_private
from ..slurm.parse import compress_hostlist
from ..zygote_protocol import (
    INFO_DIR, KEY_FILE, STORE_WAIT_S, ForkRequest, Kind, Reply, decode, encode, fork_refusal, hosts_store, warm_env,
)


__all__ = ["Zygote", "main"]


_SIGNALS = [s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP)]

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
# torch, and what torch imports lazily on first use in nearly every training script: the
# first ``torch.optim`` optimizer imports ``torch._dynamo`` (0.78 s measured here, torch
# 2.13 CPU; no thread, no CUDA), which a forked rank would otherwise pay after the fault
_ALWAYS = ("torch", "torch._dynamo")


class Zygote:
    """One node's fork server (single-threaded)."""

    def __init__(self, *, key: bytes, dispositions: dict, sigmask: set) -> None:
        self.key, self.dispositions, self.sigmask = key, dispositions, sigmask
        self.ranks: dict[int, tuple[int, Connection]] = {}  # pid → (rank, the connection that asked)
        self.step_of: dict[int, tuple[int, str]] = {}  # rank pid → (connection, step)
        self.stores: dict[tuple[int, str], int] = {}  # (connection, step) → its store host's pid
        self.conns: list[Connection] = []
        self.groups: dict[tuple[int, str], int] = {}  # (connection, step) → the step's process group here
        self.stop = False

    # -- the loop ------------------------------------------------------------------------
    def serve(self, server: socket.socket) -> None:
        while not self.stop:
            ready, _, _ = select.select([server, *self.conns], [], [], 0.02)
            for obj in ready:
                if obj is server:
                    self._accept(server)
                else:
                    self._handle(obj)
            self._reap()
        self._kill_all()

    def _accept(self, server: socket.socket) -> None:
        sock, _ = server.accept()
        sock.setblocking(True)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 5, 0))  # a mute peer
        conn = Connection(sock.detach())
        try:
            deliver_challenge(conn, self.key)
            answer_challenge(conn, self.key)
        except Exception as exc:  # a wrong key, a port scanner: log one line, read nothing
            print(f"zygote: refused a connection: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
            conn.close()
            return
        with socket.socket(fileno=os.dup(conn.fileno())) as view:  # authenticated: block again
            view.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", 0, 0))
        self.conns.append(conn)

    def _handle(self, conn: Connection) -> None:
        try:
            msg = decode(conn.recv_bytes())
        except (EOFError, OSError, ValueError):  # the supervisor is gone: fence what it started
            self._kill(conn)
            self.conns.remove(conn)
            conn.close()
            return
        if msg is Kind.KILL:
            self._kill(conn)
            self._send(conn, Reply(kind=Kind.KILLED))
        elif isinstance(msg, ForkRequest):
            self._fork(conn, msg)

    def _send(self, conn: Connection, reply: Reply) -> None:
        try:
            conn.send_bytes(encode(reply))
        except OSError:
            pass  # the supervisor is gone; _handle sees EOF next

    # -- acting ----------------------------------------------------------------------------
    def _fork(self, conn: Connection, req: ForkRequest) -> None:
        import torch

        why = fork_refusal(cuda_initialized=torch.cuda.is_initialized(), python_threads=threading.active_count())
        if why is None:
            try:
                env = warm_env(os.environ, req, job_nodelist=compress_hostlist(req.step_nodes))
            except ValueError as exc:
                why = str(exc)
        key = (id(conn), req.step_name)
        if why is None and hosts_store(req, started=key in self.stores):
            why = self._start_store(key, req)
        if why is not None:
            print(f"zygote: error: {why}", file=sys.stderr, flush=True)
            self._send(conn, Reply(kind=Kind.REFUSED, rank=req.rank, reason=why))
            return
        sys.stdout.flush()
        sys.stderr.flush()
        group = self.groups.get(key, 0)  # slurmstepd: the node's first task's pid
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            _become_rank(req, env, self.dispositions, self.sigmask, group, parent)
        try:
            os.setpgid(pid, group or pid)  # also here, so a KILL right after the fork finds the group
        except OSError:
            pass  # the child did it first, or already exited
        self.groups.setdefault(key, pid)
        self.ranks[pid] = (req.rank, conn)
        self.step_of[pid] = key
        print(f"zygote: forked rank {req.rank} as pid {pid} ({req.step_name})", flush=True)
        self._send(conn, Reply(kind=Kind.FORKED, rank=req.rank, pid=pid))

    def _reap(self, block_for: set[int] = frozenset()) -> None:
        while self.ranks:
            try:
                pid, status = os.waitpid(-1, 0 if block_for else os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            rank, conn = self.ranks.pop(pid, (None, None))
            self.groups = {k: g for k, g in self.groups.items() if g != pid}  # a later step: a new group
            self.stores = {k: p for k, p in self.stores.items() if p != pid}  # a store host that died
            key = self.step_of.pop(pid, None)
            if key is not None and key not in self.step_of.values():
                self._end_store(key)  # the step's last rank here: nobody else needs its store
            if conn is not None:
                self._send(conn, Reply(kind=Kind.EXITED, rank=rank, pid=pid, code=os.waitstatus_to_exitcode(status)))
            block_for = block_for - {pid}

    def _kill(self, conn: Connection) -> None:
        mine = {pid for pid, (_, c) in self.ranks.items() if c is conn}
        for pid in mine:
            try:
                group = os.getpgid(pid)
                if group != os.getpgid(0):  # never the zygote's own group
                    os.killpg(group, signal.SIGKILL)  # the step's ranks here, and what they started
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass  # already gone (a zombie is reaped below)
        self._reap(block_for=mine)
        for key in [k for k in self.stores if k[0] == id(conn)]:
            self._end_store(key)

    def _start_store(self, key: tuple[int, str], req: ForkRequest) -> str | None:
        """Fork the step's store host and wait until it listens; None, or why not."""
        sys.stdout.flush()
        sys.stderr.flush()
        ready_r, ready_w = os.pipe()
        parent = os.getpid()
        pid = os.fork()
        if pid == 0:  # the child: never returns
            os.close(ready_r)
            _host_store(req, ready_w, self.dispositions, self.sigmask, parent)
        os.close(ready_w)
        try:
            os.setpgid(pid, pid)  # its own group: the ranks' groups stay as slurmstepd makes them
        except OSError:
            pass  # the child did it first, or already exited
        self.stores[key] = pid
        try:
            ready, _, _ = select.select([ready_r], [], [], STORE_WAIT_S)
            word = os.read(ready_r, 512).decode(errors="replace") if ready else ""
        finally:
            os.close(ready_r)
        if word == "ok":
            print(f"zygote: store host pid {pid} listens on port {req.master_port} for step {req.step_name}",
                  flush=True)
            return None
        self._end_store(key)
        return f"the rendezvous store could not listen on port {req.master_port}: {word or 'timed out'} (run cold)"

    def _end_store(self, key: tuple[int, str]) -> None:
        pid = self.stores.pop(key, None)
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass  # already reaped


def _host_store(req: ForkRequest, ready_w: int, dispositions: dict, sigmask: set, parent: int) -> None:
    """In the forked child: serve the step's TCPStore on MASTER_PORT until killed; write
    ``ok`` (or why not) to ``ready_w`` once it listens."""
    try:
        os.setpgid(0, 0)
        _die_with(parent)
        signal.set_wakeup_fd(-1)
        for sig, handler in dispositions.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, sigmask)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.closerange(3, ready_w)
        os.closerange(ready_w + 1, os.sysconf("SC_OPEN_MAX"))
        from torch.distributed import TCPStore

        world = len(req.step_nodes) * req.tasks_per_node
        store = TCPStore(req.master_addr, req.master_port, world, is_master=True, wait_for_workers=False)
        os.write(ready_w, b"ok")
        os.close(ready_w)
        while store is not None:
            signal.pause()  # until the zygote (or the step's end) kills it
    except BaseException as exc:
        try:
            os.write(ready_w, f"{type(exc).__name__}: {exc}".encode()[:500])
        except OSError:
            pass
    os._exit(1)

    def _kill_all(self) -> None:
        for conn in list(self.conns):
            self._kill(conn)


def _die_with(parent: int) -> None:
    """The rank is KILLed when the zygote dies (``PR_SET_PDEATHSIG``). Under Slurm the
    zygote's step ending kills its ranks anyway (one cgroup); without it (``local``
    mode, tests) ranks in their own process group would outlive a killed zygote, whose
    pool already counts them killed."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # the zygote died before the prctl
        os._exit(128 + signal.SIGKILL)


def _become_rank(req: ForkRequest, env: dict[str, str], dispositions: dict, sigmask: set, group: int,
                 parent: int) -> None:
    """In the forked child: become a cold task of the relaunch step, run the script, exit."""
    code = 1
    try:
        # slurmstepd puts a step's tasks on a node in one process group, the first task's
        # (``group`` 0: this is the first); the session stays the step's, as for a cold task
        os.setpgid(0, group)
        _die_with(parent)
        signal.set_wakeup_fd(-1)
        for sig, handler in dispositions.items():
            signal.signal(sig, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, sigmask)
        log = os.open(req.log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))  # the zygote's sockets and files stay behind
        os.chdir(req.cwd)
        os.umask(req.umask)
        os.environ.clear()
        os.environ.update(env)
        _reseed()
        script = os.path.abspath(req.command[1])
        sys.argv = list(req.command[1:])
        sys.orig_argv = list(req.command)  # what rankenv's exec would have given the interpreter
        sys.path[0] = os.path.dirname(script)
        code = _run_main(script)
    except BaseException as exc:  # the setup failed: say so in the step's log
        print(f"zygote: error: rank {req.rank} could not start: {type(exc).__name__}: {exc}", file=sys.stderr)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def _run_main(script: str) -> int:
    """Run ``script`` as ``python script.py`` does (CPython's ``pymain_run_file``): a fresh
    ``__main__`` module with ``__file__`` absolute, ``__cached__`` None, a source loader,
    ``sys.argv`` untouched (``runpy.run_path`` would rewrite ``sys.argv[0]``); then its
    own ending: SystemExit's code, or a traceback and 1; non-daemon threads joined and
    atexit handlers run."""
    main = types.ModuleType("__main__")
    main.__dict__.update(__file__=script, __cached__=None, __builtins__=builtins,
                         __loader__=importlib.machinery.SourceFileLoader("__main__", script))
    sys.modules["__main__"] = main
    try:
        with open(script, "rb") as f:
            code_obj = compile(f.read(), script, "exec", dont_inherit=True)
        exec(code_obj, main.__dict__)
        code = 0
    except SystemExit as exc:
        if exc.code is None:
            code = 0
        elif isinstance(exc.code, int):
            code = exc.code & 0xFF
        else:
            print(exc.code, file=sys.stderr)
            code = 1
    except BaseException:
        kind, exc, tb = sys.exc_info()
        exc = exc.with_traceback(tb.tb_next if tb is not None else None)  # from the script's frame, as cold
        sys.excepthook(kind, exc, exc.__traceback__)
        code = 1
    threading._shutdown()  # what the interpreter does at exit: wait for non-daemon threads
    atexit._run_exitfuncs()
    return code


def _reseed() -> None:
    """A cold process seeds ``random`` (and numpy's global state) from the OS; a fork
    would share the zygote's state in every rank."""
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m slurm_resilience.launch.zygote``: preload, listen, serve forks until SIGTERM; 2 on error."""
    ap = argparse.ArgumentParser(prog="python -m slurm_resilience.launch.zygote")
    ap.add_argument("--job-dir", required=True)
    ap.add_argument("--node", required=True)
    ap.add_argument("--addr", required=True)
    ap.add_argument("--preload", default="", help="comma-separated modules to import besides torch")
    args = ap.parse_args(argv)
    dispositions = {s: signal.getsignal(s) for s in _SIGNALS}  # a fresh interpreter's, kept for the ranks
    dispositions = {s: h for s, h in dispositions.items() if h is not None}
    sigmask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    environ = dict(os.environ)  # as the step gave it: what the ranks' env is built from
    for name in [*_ALWAYS, *filter(None, args.preload.split(","))]:
        try:
            importlib.import_module(name)
        except Exception as exc:  # a typo in run.preload: one line; the supervisor runs cold
            print(f"zygote: error: cannot preload {name!r}: {type(exc).__name__}: {exc}", file=sys.stderr)
            return 2
    os.environ.clear()  # what an import wrote (torch._dynamo sets TORCHINDUCTOR_CACHE_DIR; torch
    os.environ.update(environ)  # recomputes it when unset): a cold rank's env has none of it yet
    try:
        with open(os.path.join(args.job_dir, KEY_FILE), "rb") as f:
            key = f.read().strip()
    except OSError as exc:
        print(f"zygote: error: no job key: {exc}", file=sys.stderr)
        return 2
    zygote = Zygote(key=key, dispositions=dispositions, sigmask=sigmask)
    signal.signal(signal.SIGTERM, lambda *_: setattr(zygote, "stop", True))
    server = socket.create_server((args.addr, 0), backlog=16)
    info_dir = os.path.join(args.job_dir, INFO_DIR)
    makedirs_private(info_dir)
    write_private(os.path.join(info_dir, f"{args.node}.json"),
                  f'{{"addr": "{args.addr}", "port": {server.getsockname()[1]}, "pid": {os.getpid()}}}')
    print(f"zygote: {args.node} ready on port {server.getsockname()[1]}", flush=True)
    zygote.serve(server)
    return 0


if __name__ == "__main__":
    sys.exit(main())
