"""An unmodified script that reports what it can observe of how it was started.

    python observe_probe.py OUT.json [--exit N | --raise]

Writes the environment, ``__name__``, ``sys.argv``, ``__file__``, ``sys.path[0]``,
signal dispositions and mask, cwd, umask, process group/session leadership, open file
descriptors, then prints one line to stdout and one to stderr, and ends with exit
code N (default 0) or an uncaught exception.
"""

import json
import os
import signal
import sys


def disposition(sig):
    h = signal.getsignal(sig)
    return h if isinstance(h, str) else getattr(h, "__name__", None) if callable(h) else int(h) if h is not None else None


umask = os.umask(0)
os.umask(umask)
observed = {
    "env": dict(os.environ),
    "name": __name__,
    "argv": sys.argv,
    "orig_argv": sys.orig_argv,
    "file": __file__,
    "path0": sys.path[0],
    "signals": {str(int(s)): disposition(s) for s in signal.valid_signals()
                if s not in (signal.SIGKILL, signal.SIGSTOP)},
    "sigmask": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])),
    "cwd": os.getcwd(),
    "umask": umask,
    "ids": {"pid": os.getpid(), "pgid": os.getpgid(0), "sid": os.getsid(0)},
    "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd") if int(fd) > 2),
    "stdin": os.path.realpath("/proc/self/fd/0"),
}
with open(sys.argv[1].format(rank=os.environ.get("RANK")), "w") as f:
    json.dump(observed, f)
print(f"probe stdout rank {os.environ.get('RANK')}", flush=True)
print(f"probe stderr rank {os.environ.get('RANK')}", file=sys.stderr, flush=True)
if "--raise" in sys.argv:
    raise RuntimeError("probe: uncaught")
if "--exit" in sys.argv:
    sys.exit(int(sys.argv[sys.argv.index("--exit") + 1]))
