"""A program's own error, as a rank reports it before it exits (both sides of the wire).

A rank whose training program raises (anything but the toolkit's own control flow)
writes one :class:`ProgramError` to the store (``StoreKey.ERROR``) before its process
ends; the supervisor reads it with the rank's death and ``decide`` tells a program's
bug from a node's fault (``supervisor/decide/blame.py``): the same error on ranks of several
nodes, or at the same point again after a recovery, is the program's — the job fails
once with this error, and no node is isolated.

The *signature* of an error is its exception type and a digest of its message with
numbers and addresses blanked (``rank 3`` and ``rank 5`` say the same thing), so the
same bug on different ranks has the same signature.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import re
import traceback
from types import TracebackType
from typing import Any

__all__ = ["ProgramPhase", "ProgramError", "from_exception", "signature_digest"]

MESSAGE_CHARS = 300  # the message line kept (the digest covers the whole first line)
TRACEBACK_LINES = 12  # the lines of the traceback kept: the error's own frames, innermost last


class ProgramPhase(str, enum.Enum):
    """Where in ``Session`` the error left the program.

    START: joining the first generation (``with Session()``).
    STATE_SYNC: agreeing on one state for a generation and restoring it.
    HOOKS: the user's per-generation hooks (``on_generation``: wrappers rebuilt).
    STEP: the body of ``with step:`` (the user's forward, backward, update).
    SAFE_POINT: completing a step (checkpoint agreement, writes).
    FINISH: after the last step (final barrier, final checkpoint).
    """

    START = "start"
    STATE_SYNC = "state_sync"
    HOOKS = "hooks"
    STEP = "step"
    SAFE_POINT = "safe_point"
    FINISH = "finish"


_BLANK = re.compile(r"0x[0-9a-fA-F]+|\d+")


def signature_digest(kind: str, message: str) -> str:
    """Pure: the digest of an error's type and message, numbers and addresses blanked."""
    first = message.splitlines()[0] if message else ""
    return hashlib.sha256(f"{kind}:{_BLANK.sub('#', first)}".encode()).hexdigest()[:16]


@dataclasses.dataclass(frozen=True)
class ProgramError:
    """One rank's uncaught error: what, where (step, phase, generation) and its traceback."""

    type: str  # the exception's qualified class name, e.g. "RuntimeError"
    message: str  # its first line, cut to MESSAGE_CHARS
    digest: str  # signature_digest(type, message)
    phase: ProgramPhase
    step: int | None = None
    generation: int | None = None
    traceback: tuple[str, ...] = ()  # "Traceback (most recent call last):", frames, the error line

    @property
    def signature(self) -> tuple[str, str]:
        return self.type, self.digest

    @property
    def headline(self) -> str:
        """``RuntimeError: Error(s) in loading state_dict for Linear: ...``"""
        return f"{self.type}: {self.message}" if self.message else self.type

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    def to_dict(self) -> dict[str, Any]:
        return {"type": self.type, "message": self.message, "digest": self.digest, "phase": self.phase.value,
                "step": self.step, "generation": self.generation, "traceback": list(self.traceback)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ProgramError":
        """Raises KeyError/ValueError/TypeError on a record that is not one."""
        return cls(type=str(d["type"]), message=str(d["message"]), digest=str(d["digest"]),
                   phase=ProgramPhase(d["phase"]), step=None if d.get("step") is None else int(d["step"]),
                   generation=None if d.get("generation") is None else int(d["generation"]),
                   traceback=tuple(str(x) for x in d.get("traceback", ())))

    @classmethod
    def from_json(cls, text: str | bytes) -> "ProgramError":
        return cls.from_dict(json.loads(text))


def from_exception(exc: BaseException, tb: TracebackType | None, *, phase: ProgramPhase, step: int | None,
                   generation: int | None) -> ProgramError:
    """Pure: the record of ``exc``. The traceback keeps its header and its innermost
    frames (where the error was raised), at most ``TRACEBACK_LINES`` lines."""
    kind = type(exc).__qualname__
    if type(exc).__module__ not in ("builtins", "__main__"):
        kind = f"{type(exc).__module__}.{kind}"
    text = str(exc)
    message = (text.splitlines()[0] if text else "")[:MESSAGE_CHARS]
    lines = [ln.rstrip("\n") for chunk in traceback.format_exception(type(exc), exc, tb, chain=False)
             for ln in chunk.splitlines()]
    if len(lines) > TRACEBACK_LINES:
        lines = [lines[0], f"  ... ({len(lines) - TRACEBACK_LINES} lines above)", *lines[-(TRACEBACK_LINES - 2):]]
    return ProgramError(type=kind, message=message, digest=signature_digest(kind, text), phase=phase, step=step,
                        generation=generation, traceback=tuple(ln[:MESSAGE_CHARS] for ln in lines))
