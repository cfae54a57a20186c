"""Exit a process without the interpreter's tear-down.

A process that has imported torch spends 0.35–0.4 s on this 2-core box in the
interpreter's tear-down (atexit handlers, module clean-up, the destructors of torch's
objects; a parked gloo group's destructor may block longer). On a requeue that time
is serial three times over, between the STOP plan and the restarted job: the stopped
ranks' exit (the supervisor reaps them), then the supervisor's, then the batch step's.
Everything that must outlive the process is written before these are called: the
checkpoint writer is joined (``CheckpointEngine.close``), ``result.json``, the event
log and ``supervisor.json`` are closed; only the standard streams and the logging
handlers are left to flush, and these functions flush them.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys

__all__ = ["FAST_EXIT_ENV", "exit_now", "exit_fast_at_exit"]

# Set to "1" by the supervisor in the environment of the workers it launches: a
# ``Session`` ended by the job (``JobEnded``) then exits through ``exit_fast_at_exit``.
# Never on by default: a program that catches the ``SystemExit`` and goes on (a test
# runner running a Session in-process) must keep its own exit status.
FAST_EXIT_ENV = "SR_FAST_EXIT"


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):  # closed or replaced by the user
            pass
    logging.shutdown()


def exit_now(code: int) -> None:
    """Flush the standard streams and the logging handlers, then end the process with
    ``code`` at once (``os._exit``: no atexit handler, no module clean-up)."""
    _flush()
    os._exit(code)


def exit_fast_at_exit(code: int) -> None:
    """Let the current ``SystemExit`` unwind through the caller's code (its ``finally``
    and ``with`` blocks run), then end the process with ``code`` as the interpreter's
    tear-down starts: atexit handlers registered after this call run first (LIFO),
    those registered before it and the module clean-up are skipped."""
    atexit.register(exit_now, code)
