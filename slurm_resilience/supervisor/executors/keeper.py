"""Keep the supervisor alive: the batch step hosts the store and restarts a killed supervisor.

    batch step (this module, tiny and long-lived)
        ├─ hosts the job's TCPStore (the workers' rendezvous, plans, heartbeats, events)
        └─ runs the supervisor as a child process
              killed (SIGKILL, OOM, a crash by signal) → restarted with ``--reattach``:
              it reloads ``JOBDIR/supervisor.json`` and takes over the running
              workers without restarting them (see ``reattach.py``)

The batch step also settles the run's identity once per start
(``run_identity.establish``: the ``SR_RUN_ID`` it was given, or the one a requeue
recorded in ``JOBDIR/run.json``, or a fresh one) and hands it to the supervisor in
``SR_RUN_ID``; a restarted supervisor gets the same.

The store lives here and not in the supervisor so that it outlives the supervisor:
the workers keep training (their gloo groups do not need it) and keep writing
heartbeats and events into it while the supervisor is down. The preemption signal
(``--signal=B:…``) reaches this process and is forwarded to the supervisor.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from datetime import timedelta
from typing import Mapping, Sequence

from ...files import write_private


__all__ = [
    "STORE_FILE", "STORE_BACKLOG", "EXIT_SUPERVISOR_LOST", "bind_store", "host_store", "read_store_address", "ORDERLY",
    "keep", "keep_supervisor"
]


STORE_FILE = "store.json"
STORE_BACKLOG = 1024  # every rank and standby may connect before the store serves
EXIT_SUPERVISOR_LOST = 5  # the supervisor was killed more often than job.supervisor_respawns


def bind_store(host: str, job_dir: str, started: float | None = None) -> socket.socket:
    """The store's listening socket, bound at once (no torch needed): its port goes into
    ``store.json`` before the supervisor starts, so the supervisor launches the workers
    without waiting for the store (``host_store`` takes the socket over when torch is
    imported; a client that connects before queues in the backlog). Listens on every
    interface, as TCPStore's own server does; ``host`` is where clients reach it."""
    sock = None
    if socket.has_dualstack_ipv6():
        try:
            sock = socket.create_server(("", 0), family=socket.AF_INET6, backlog=STORE_BACKLOG, dualstack_ipv6=True)
        except OSError:  # IPv6 off on this host: IPv4 only, as TCPStore falls back to
            sock = None
    if sock is None:
        sock = socket.create_server(("", 0), backlog=STORE_BACKLOG)
    write_private(os.path.join(job_dir, STORE_FILE),
                  json.dumps({"host": host, "port": sock.getsockname()[1], "pid": os.getpid(), "started": started}))
    return sock


def host_store(host: str, job_dir: str, started: float | None = None, sock: socket.socket | None = None):
    """Start the job's store server in this process (on ``sock``, from ``bind_store``, or a
    port of its own); record where it listens, and when the batch step (``started``) and
    the store (``t``) were up (a requeue's breakdown)."""
    import torch.distributed as dist

    port = sock.getsockname()[1] if sock is not None else 0
    fd = sock.detach() if sock is not None else None  # the store owns the descriptor from now on
    store = dist.TCPStore(host, port, None, True, timedelta(seconds=30), wait_for_workers=False,
                          master_listen_fd=fd)
    write_private(os.path.join(job_dir, STORE_FILE),
                  json.dumps({"host": host, "port": store.port, "pid": os.getpid(), "started": started,
                              "t": time.time()}))
    return store


def read_store_address(job_dir: str, keeper_pid: int | None = None, timeout_s: float = 120.0) -> tuple[str, int]:
    """Where the keeper's store listens. With ``keeper_pid``, wait until that keeper has
    written it (``bind_store``, before it starts the supervisor; a requeued job's
    directory still holds the previous run's file)."""
    path = os.path.join(job_dir, STORE_FILE)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with open(path) as f:
                d = json.load(f)
            if keeper_pid is None or int(d["pid"]) == keeper_pid:
                return str(d["host"]), int(d["port"])
        except (FileNotFoundError, json.JSONDecodeError, KeyError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"no store address from keeper pid {keeper_pid} in {path}")
        time.sleep(0.02)


# Signals that end a supervisor on purpose (Slurm ending or requeueing the job, a
# user's scancel or Ctrl-C): the supervisor is not restarted after these.
ORDERLY = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP})


def keep(child_argv: Sequence[str], *, restarts: int, forward: Sequence[int] = (),
         out=sys.stderr, env: Mapping[str, str] | None = None) -> int:
    """Run ``child_argv`` (a supervisor; environment ``env``, default this process's);
    rerun it with ``--reattach`` each time it is killed by a signal (SIGKILL, SIGSEGV,
    …), at most ``restarts`` times. Returns its exit code (128 + N for a signal N). A
    signal in ``ORDERLY``, to the supervisor or to this process, ends the job instead:
    no restart."""
    child: subprocess.Popen | None = None
    ending = False

    def relay(signum, _frame) -> None:
        nonlocal ending
        ending = ending or signum in ORDERLY
        if child is not None and child.poll() is None:
            child.send_signal(signum)

    for sig in forward:
        signal.signal(sig, relay)
    argv = list(child_argv)
    for attempt in range(restarts + 1):
        child = subprocess.Popen(argv, env=None if env is None else dict(env))
        code = child.wait()
        if code >= 0:
            return code
        if ending or -code in ORDERLY:
            return 128 - code
        left = restarts - attempt
        print(f"[sr keeper {time.strftime('%H:%M:%S')}] supervisor pid {child.pid} killed by signal "
              f"{-code}; {'restarting it to re-attach' if left else 'no restart left'} "
              f"({attempt + 1}/{restarts} restarts used)", file=out, flush=True)
        if "--reattach" not in argv:
            argv = _with_reattach(argv)
    return EXIT_SUPERVISOR_LOST


def keep_supervisor(cfg, command: Sequence[str], job_dir: str, host: str, *, mode: str = "supervise",
                    started: float | None = None, run_id: str | None = None, resumed: bool = False) -> int:
    """The batch step: settle the run id, host the store, run ``slurm-resilience {mode}
    --child`` with this config, restart it (``--reattach``) when it is killed. Returns
    the job's exit code. ``started``: when the batch step's CLI was up (recorded in
    ``store.json``); ``run_id``: the one this start was given (``SR_RUN_ID``), None to
    keep the recorded one (``resumed``: a requeue) or draw one (``run_identity.choose``).

    Raises:
        ConfigError: ``run_id`` is not a run id.
    """
    import yaml

    from ...config import config_to_dict
    from ...files import makedirs_private
    from ...run_identity import RUN_ID_ENV, establish

    makedirs_private(job_dir)
    run_id = establish(job_dir, run_id, resumed=resumed)
    cfg_path = write_private(os.path.join(job_dir, "supervisor-config.yaml"), yaml.safe_dump(config_to_dict(cfg)))
    stores: list = []  # the store serves the workers for as long as this process lives;
    # its port is known at once (bind_store); it serves once torch is imported, in a thread,
    # while the supervisor starts and launches the workers
    sock = bind_store(host, job_dir, started)
    threading.Thread(target=lambda: stores.append(host_store(host, job_dir, started, sock)), daemon=True).start()
    forward = [cfg.job.preempt_signum] if cfg.job.preempt_signum is not None else []
    child = [sys.executable, "-m", "slurm_resilience.cli", mode, "--child", "--config", cfg_path,
             "--job-dir", job_dir, "--", *command]
    try:
        return keep(child, restarts=cfg.job.supervisor_respawns, forward=[*forward, signal.SIGTERM],
                    env={**os.environ, RUN_ID_ENV: run_id})
    finally:
        stores.clear()


def _with_reattach(argv: list[str]) -> list[str]:
    """Insert ``--reattach`` before the ``--`` that starts the training command."""
    if "--" in argv:
        i = argv.index("--")
        return [*argv[:i], "--reattach", *argv[i:]]
    return [*argv, "--reattach"]
