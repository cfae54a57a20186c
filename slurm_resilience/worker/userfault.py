"""A fault seen by a collective the toolkit does not own (DDP's, the user's).

The toolkit's own collectives are bounded waits (``reconnect.py``). A collective issued
by DDP (its bucket all-reduce in ``backward``) or by user code (``dist.all_reduce``) on
the default group is not: on a killed peer it raises (gloo: "Connection closed/reset
by peer", within milliseconds); on a hung peer it blocks until the group timeout
(``reconnect.pg_timeout_s``) and then raises. Inside ``with step:`` such an error makes
the step aborted — if the supervisor publishes the next generation's plan within
``detect.heartbeat_timeout_s + recovery.online_timeout_s``; otherwise (no fault the
supervisor knows of: a bug) the error propagates. Any other exception propagates at once.
"""

from __future__ import annotations

import torch.distributed as dist


__all__ = ["is_distributed_error", "plan_wait_s"]


# What gloo and NCCL put in the RuntimeError of a failed collective (torch 2.13 raises a
# plain RuntimeError for most of them, not a DistError subclass).
_MARKERS = (
    "connection closed by peer", "connection reset by peer", "broken pipe",
    "timed out waiting", "socket timeout", "gloo/transport", "nccl error", "ncclremoteerror",
    "ncclsystemerror", "processgroup", "watchdog caught collective operation timeout",
)


def is_distributed_error(exc: BaseException) -> bool:
    """Pure: ``exc`` (or an exception it was raised from) is a failed collective."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, dist.DistError):
            return True
        if isinstance(exc, RuntimeError):
            text = str(exc).lower()
            if any(m in text for m in _MARKERS):
                return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def plan_wait_s(heartbeat_timeout_s: float, online_timeout_s: float) -> float:
    """Pure: how long a rank whose collective failed waits for the next plan."""
    return heartbeat_timeout_s + online_timeout_s
