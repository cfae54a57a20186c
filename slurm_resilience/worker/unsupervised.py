"""``Session()`` outside a supervised job: the same API, no recovery.

Without the supervisor's ``SR_*`` variables a script still runs, for debugging:
under ``torchrun`` (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``: the
default group is ``init_process_group(init_method="env://")``) or as a single process
(``python train.py``: a world of one, on a local ``HashStore``, so ``dist.*`` calls
and ``DistributedDataParallel`` work unchanged). Steps, ``step.batch``/``samples``,
``register``, ``is_logger``, ``ddp``, ``on_generation`` (run once) and
``all_reduce_gradients`` behave as in a supervised job; ``step.replay`` is always
False; there are no checkpoints, no heartbeats and no recovery: a failed collective
propagates. One line on stderr (from rank 0) says so.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from datetime import timedelta
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist

from ..errors import ConfigError, ResilienceError
from ..protocol import _ENV_VARS
from .facade import StateFacade
from .reconnect import choose_backend
from .step import Step


__all__ = ["supervised", "FallbackEnv", "fallback_environ", "UnsupervisedSession"]


_TORCHRUN = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def supervised(environ: Mapping[str, str]) -> bool:
    """Pure: the process was started by the supervisor (any ``SR_*`` variable of a
    worker is set; a partial set is then reported by ``WorkerEnv`` with what is missing)."""
    return any(v in environ for v in _ENV_VARS.values())


@dataclasses.dataclass(frozen=True)
class FallbackEnv:
    """Where an unsupervised process stands: torchrun's variables, or a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    launcher: str = "single process"  # or "torchrun"


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None:
        if default is None:
            raise ConfigError(f"{name} is not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"{name}={raw!r} is not an integer") from None


def fallback_environ(environ: Mapping[str, str]) -> FallbackEnv:
    """Pure: the fallback environment, or ConfigError (one line) for a torchrun
    environment that is incomplete or inconsistent."""
    if not any(v in environ for v in ("RANK", "WORLD_SIZE")):
        return FallbackEnv()
    missing = [v for v in _TORCHRUN if v not in environ]
    if missing:
        raise ConfigError(f"unsupervised run: {', '.join(missing)} not set (set all of "
                          f"{', '.join(_TORCHRUN)}, as torchrun does, or none of them)")
    rank, world = _int(environ, "RANK"), _int(environ, "WORLD_SIZE")
    if world < 1 or not 0 <= rank < world:
        raise ConfigError(f"unsupervised run: RANK={rank} must be in [0, WORLD_SIZE={world})")
    port = _int(environ, "MASTER_PORT")
    if not 0 < port < 65536:
        raise ConfigError(f"unsupervised run: MASTER_PORT={port} is not a TCP port")
    local_world = _int(environ, "LOCAL_WORLD_SIZE", 1)
    local = _int(environ, "LOCAL_RANK", 0)
    if local_world < 1 or not 0 <= local < local_world:
        raise ConfigError(f"unsupervised run: LOCAL_RANK={local} must be in [0, LOCAL_WORLD_SIZE={local_world})")
    return FallbackEnv(rank, world, local, local_world, "torchrun")


class UnsupervisedSession(StateFacade):
    """The Session API without a supervisor (see the module docstring)."""

    generation = 0
    checkpoints = None

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        self.env = fallback_environ(os.environ if environ is None else environ)
        super().__init__()
        self._parked: list[object] = []
        self._own_group = False
        self._current: Step | None = None

    def __enter__(self) -> "UnsupervisedSession":
        env = self.env
        if not dist.is_initialized():  # a script may have called init_process_group itself
            backend = choose_backend("auto")
            if backend == "nccl":
                torch.cuda.set_device(env.local_rank)
            if env.launcher == "torchrun":
                dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=300))
            else:
                dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
            self._own_group = True
        if self.is_logger:
            print(f"slurm_resilience: running unsupervised ({env.launcher}, {self.world_size} rank(s)): "
                  "no fault tolerance, no checkpoints", file=sys.stderr, flush=True)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if self._own_group and dist.is_initialized():
            dist.destroy_process_group()

    @property
    def rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else self.env.rank

    @property
    def world_size(self) -> int:
        return dist.get_world_size() if dist.is_initialized() else self.env.world_size

    @property
    def local_rank(self) -> int:
        return self.env.local_rank

    @property
    def local_world_size(self) -> int:
        return self.env.local_world_size

    def state_dict(self) -> dict[str, Any]:
        """What a supervised job would restore (registered objects, RNG, step, extras)."""
        return self._state.state_dict()

    def _park(self, obj: object) -> None:
        self._parked.append(obj)

    def device_mesh(self, device_type: str, mesh_shape: tuple[int, ...], *,
                    mesh_dim_names: tuple[str, ...] | None = None):
        from torch.distributed.device_mesh import init_device_mesh

        return init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names)

    def steps(self, total_steps: int) -> Iterator[Step]:
        """Yield steps ``self.step .. total_steps-1`` (none is ever redone)."""
        self._hooks.run(0)
        st = self._state
        while st.step < total_steps:
            step = self._current = Step(self, st.step)
            yield step
            if not step.entered:
                raise ResilienceError("wrap the body of each step in `with step:` so a fault can abort it")
            st.step += 1
            st.position += step.consumed
        if self.world_size > 1:
            dist.barrier()

    def all_reduce_gradients(self, *modules: torch.nn.Module) -> None:
        """Collective: average gradients over ranks (one flat SUM)."""
        grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: in-place SUM."""
        dist.all_reduce(tensor)
        return tensor
