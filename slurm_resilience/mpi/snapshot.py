"""The registered state of a rank as one flat byte buffer, and back in place.

A program registers named numpy arrays or CPU torch tensors. ``pack`` copies them,
in name order, into one ``uint8`` buffer (the message sent to the buddy and the
rank's own rollback copy); ``unpack_into`` writes such a buffer back into the very
objects the program holds, so its references stay valid after a restore. Shapes and
dtypes never change during a run, so every rank knows the buffer's size.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from .errors import StateMismatchError

__all__ = ["Layout"]


def _view(obj: Any, name: str) -> np.ndarray:
    """A numpy view of ``obj``'s memory (no copy)."""
    if isinstance(obj, np.ndarray):
        arr = obj
    elif type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu":
            raise StateMismatchError(f"state {name!r} is on {obj.device}: register CPU tensors only")
        arr = obj.detach().numpy()
    else:
        raise StateMismatchError(f"state {name!r} is a {type(obj).__name__}: register numpy arrays "
                                 "or CPU torch tensors")
    if not arr.flags.c_contiguous:
        raise StateMismatchError(f"state {name!r} is not contiguous: register a contiguous array")
    return arr


class Layout:
    """The byte layout of one registered state (names, offsets, sizes)."""

    def __init__(self, state: Mapping[str, Any]) -> None:
        if not state:
            raise StateMismatchError("no state registered: pass at least one array")
        self.names = sorted(state)
        self.views = {n: _view(state[n], n) for n in self.names}
        self.offsets: dict[str, int] = {}
        off = 0
        for n in self.names:
            self.offsets[n] = off
            off += self.views[n].nbytes
        self.nbytes = off

    def signature(self) -> str:
        """What must match between ranks: names, shapes and dtypes."""
        return ";".join(f"{n}:{self.views[n].dtype.str}:{self.views[n].shape}" for n in self.names)

    def pack(self) -> np.ndarray:
        """A copy of the state as one byte buffer."""
        buf = np.empty(self.nbytes, dtype=np.uint8)
        for n in self.names:
            v = self.views[n]
            buf[self.offsets[n]:self.offsets[n] + v.nbytes] = v.reshape(-1).view(np.uint8)
        return buf

    def unpack_into(self, buf: np.ndarray) -> None:
        """Write ``buf`` (from ``pack``) back into the registered objects, in place."""
        if buf.dtype != np.uint8 or buf.size != self.nbytes:
            raise StateMismatchError(f"a state copy of {buf.size} bytes does not fit the registered "
                                     f"state ({self.nbytes} bytes)")
        for n in self.names:
            v = self.views[n]
            v.reshape(-1).view(np.uint8)[:] = buf[self.offsets[n]:self.offsets[n] + v.nbytes]
