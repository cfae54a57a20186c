"""Wrappers bound to a process group, rebuilt for every generation.

``DistributedDataParallel`` (and anything else that captures the default group when
it is built) keeps using the group it was built on. After a recovery that group is
destroyed, so such wrappers must be built again on the new one. The session runs the
``on_generation`` callbacks after the state sync of every generation (the first
included) and before its first step; :class:`RebuiltDDP` is one such callback.

DDP and bit-identical recovery: DDP starts with every parameter in one bucket and
re-buckets after its first backward by gradient-ready order. gloo's ring all-reduce
sums an element in an order that depends on its position in the bucket, so with 3 or
more ranks a DDP built in the middle of a run (first iteration: the initial layout)
reduces differently from the fault-free run (rebuilt layout) and the weights diverge
in the last bits (measured: ``tests/local/test_ddp.py``). :func:`static_buckets`
fixes the layout once, at construction, from parameter order (the order does not
depend on when DDP was built), and no rebuild follows. The cost: buckets fill in
parameter order, so less of the all-reduce overlaps the backward pass.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable

import torch
from torch.nn.parallel import DistributedDataParallel

from ..errors import ResilienceError


__all__ = ["GenerationHooks", "static_buckets", "RebuiltDDP"]


log = logging.getLogger(__name__)


class GenerationHooks:
    """Callbacks run once per generation, after its state sync, in registration order.

    A callback added after the current generation's callbacks ran is run at once, so
    the order of ``on_generation`` and the first step does not matter to the user."""

    def __init__(self) -> None:
        self._fns: list[Callable[[], Any]] = []
        self.ran_for: int | None = None  # the generation whose callbacks last ran

    def add(self, fn: Callable[[], Any]) -> None:
        if not callable(fn):
            raise ResilienceError(f"on_generation needs a callable, got {type(fn).__name__}")
        self._fns.append(fn)
        if self.ran_for is not None:
            fn()

    def run(self, generation: int) -> None:
        """Run every callback for ``generation`` (once; a repeated call does nothing)."""
        if self.ran_for == generation:
            return
        for fn in self._fns:
            fn()
        self.ran_for = generation


def static_buckets(ddp: DistributedDataParallel) -> None:
    """Fix ``ddp``'s bucket layout now, from parameter order, so it never re-buckets.

    Uses the reducer's own rebuild with every parameter pushed in order (the path DDP
    takes for a static graph), before any backward ran."""
    reducer = ddp.reducer
    reducer._push_all_rebuilt_params()
    if not reducer._rebuild_buckets():
        raise ResilienceError("DDP did not accept a static bucket layout "
                              "(find_unused_parameters=True is not supported by session.ddp)")


class RebuiltDDP:
    """Use like ``DistributedDataParallel(module, **kwargs)``; rebuilt for every generation.

    ``forward``/call, ``no_sync()``, ``.module`` and other attributes go to the current
    DDP. Register ``module`` (the unwrapped model) for state, not this object. At each
    rebuild the module's gradients are reset (``None``): an aborted step may have left
    partial sums in them, and the step is redone from scratch.
    """

    def __init__(self, module: torch.nn.Module, hooks: GenerationHooks, park: Callable[[object], None],
                 **ddp_kwargs: Any) -> None:
        if not isinstance(module, torch.nn.Module):
            raise ResilienceError(f"session.ddp needs a torch.nn.Module, got {type(module).__name__}")
        if ddp_kwargs.get("find_unused_parameters"):
            raise ResilienceError("session.ddp: find_unused_parameters=True is not supported "
                                  "(its bucket layout depends on each iteration's graph)")
        self.module = module
        self._kwargs = ddp_kwargs
        self._park = park
        self._ddp: DistributedDataParallel | None = None
        self.builds = 0
        hooks.add(self.rebuild)

    def rebuild(self) -> None:
        """Collective (DDP's construction broadcasts buffers): a new DDP on the current
        default group. The old one is detached (its autograd hooks removed) and parked."""
        old, self._ddp = self._ddp, None
        if old is not None:
            old.reducer._remove_autograd_hooks()  # else its hooks fire on the old group
            self._park(old)
        for p in self.module.parameters():
            p.grad = None
        ddp = DistributedDataParallel(self.module, init_sync=False, **self._kwargs)
        static_buckets(ddp)
        self._ddp = ddp
        self.builds += 1

    @property
    def ddp(self) -> DistributedDataParallel:
        if self._ddp is None:
            raise ResilienceError("session.ddp(...) is usable inside the steps loop "
                                  "(it is built after each generation's state sync)")
        return self._ddp

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)

    def no_sync(self) -> contextlib.AbstractContextManager:
        return self.ddp.no_sync()

    def __getattr__(self, name: str) -> Any:  # train(), eval(), parameters(), ...
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.ddp, name)
