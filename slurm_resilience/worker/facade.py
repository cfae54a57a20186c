"""The part of the ``Session`` API that supervised and unsupervised sessions share:
the training state (step, position, extras, registered objects) and the wrappers
rebuilt for every generation (``on_generation``, ``ddp``, ``fsdp``).

:class:`StateFacade` is a base class that owns what it reads: it builds the
``TrainingState`` and the ``GenerationHooks`` itself; a subclass gives ``_park``
(where a wrapper's old process group goes) and ``rank``/``world_size``.
"""

from __future__ import annotations

from typing import Any

import torch

from .rebind import GenerationHooks, RebuiltDDP
from .replay import logger_rank
from .statesync import TrainingState


__all__ = ["StateFacade"]


class StateFacade:
    """Training state and per-generation wrappers (see the module docstring)."""

    def __init__(self) -> None:
        self._state = TrainingState()
        self._hooks = GenerationHooks()

    # -- what a subclass gives ----------------------------------------------------
    @property
    def rank(self) -> int:
        raise NotImplementedError

    @property
    def world_size(self) -> int:
        raise NotImplementedError

    def _park(self, obj: object) -> None:
        """Keep a replaced wrapper's process group until it may be released."""
        raise NotImplementedError

    # -- shared ---------------------------------------------------------------------
    @property
    def is_logger(self) -> bool:
        """This rank logs (rank 0: the same process for the whole job unless it is lost).
        Log a step only ``if session.is_logger and not step.replay``."""
        return self.rank == logger_rank(self.world_size)

    @property
    def step(self) -> int:
        """Completed steps: the index of the next step."""
        return self._state.step

    @property
    def position(self) -> int:
        """Global samples consumed by completed steps: the rollback point."""
        return self._state.position

    @property
    def extras(self) -> dict[str, Any]:
        """User extras saved and restored with the state (picklable values and tensors),
        e.g. an epoch counter. Replicated, like the model: one rank's copy restores every
        rank, so per-rank values do not belong here. A restore replaces the dict."""
        return self._state.extras

    @extras.setter
    def extras(self, value: dict[str, Any]) -> None:
        self._state.extras = value

    def register(self, **objects: Any) -> None:
        """Register state to restore on recovery: anything with state_dict/load_state_dict.
        Raises ResilienceError for an object without them."""
        self._state.register(**objects)

    def register_sharded(self, **objects: Any) -> None:
        """Register objects whose state is sharded over the ranks (ZeRO-style): their
        state_dict is ``{"shards": {key: 1-D slice}, ...replicated...}`` with rank r's
        slice being ``shard_range(total, world_size, r)`` of one global flat tensor.
        Recoveries restore them from the newest complete checkpoint, resharded to the
        new world size (see ``worker/reshard.py``)."""
        self._state.register_sharded(**objects)

    def on_generation(self, fn) -> None:
        """Call ``fn()`` after the state sync of every generation (the first included),
        before its first step: rebuild what is bound to the old process group there.
        Collective when ``fn`` is (all ranks run the same callbacks)."""
        self._hooks.add(fn)

    def ddp(self, module: torch.nn.Module, **ddp_kwargs: Any) -> RebuiltDDP:
        """``DistributedDataParallel(module, **ddp_kwargs)``, rebuilt for every generation
        with a static bucket layout (bit-identical recovery, ``worker/rebind.py``).
        Register ``module`` itself for state."""
        return RebuiltDDP(module, self._hooks, self._park, **ddp_kwargs)

    def fsdp(self, build, *, device_type: str | None = None):
        """FSDP2: ``build(mesh) -> model | (model, optimizer[, scheduler])`` with ``fully_shard``
        on ``mesh`` (1-D, this generation's), called again for every generation. Registers
        "model" and "optimizer" (sharded) and "scheduler"; returns a RebuiltFSDP whose
        ``.model``/``.optimizer``/``.scheduler`` are the current ones (docs/fsdp.md)."""
        from .fsdp import make_fsdp

        return make_fsdp(self, build, device_type, self._park)
