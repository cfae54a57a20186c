"""FSDP2 (``fully_shard``) models and optimizers as registered state, rebuilt per generation.

    def build(mesh):                                # called once per generation
        model = Net()
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, warmup)

    fsdp = session.fsdp(build)                       # registers model, optimizer, scheduler
    for step in session.steps(n):
        with step:
            loss = loss_fn(fsdp(x), y)              # fsdp.model / fsdp.optimizer: the current ones
            loss.backward(); fsdp.optimizer.step(); fsdp.optimizer.zero_grad()
            fsdp.scheduler.step()

Why rebuild: ``fully_shard`` binds the module to its DeviceMesh (the process group)
in private per-module state (``FSDPParamGroup``'s mesh info, its communication
streams and buffers); after a recovery that group is destroyed. Re-pointing that state
would touch private FSDP2 internals, so every generation builds model, optimizer and
scheduler anew on its mesh (``build(mesh)``, run with the RNG states saved and put
back, so a rebuild draws nothing), then loads the state into them. The old objects
are dropped (parked), with any gradients an aborted step left.

State: ``get_model_state_dict``/``get_optimizer_state_dict`` (sharded DTensors keyed by
FQN: optimizer state independent of parameter order and ids), converted by
``fsdp_state.py`` into the toolkit's nested sharded convention with "rows" layouts, so
all tiers and ``reshard.py`` carry it. A restore's state is held here (``pending``)
until the generation's rebuild loads it: the state sync runs before the rebuild
(``Session.steps``), and the objects it loads into only exist afterwards.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from ..errors import ResilienceError
from . import fsdp_state as fs
from .rebind import GenerationHooks
from .reshard import slice_range
from .statesync import _capture_rng, _restore_rng


__all__ = ["PARTS", "RebuiltFSDP", "FsdpPart", "make_fsdp"]


PARTS = ("model", "optimizer", "scheduler")


def _unpack(out: Any) -> tuple[Any, Any, Any]:
    """``build``'s result as (model, optimizer | None, scheduler | None), checked."""
    from torch.distributed.fsdp import FSDPModule

    items = tuple(out) if isinstance(out, (tuple, list)) else (out,)
    if not 1 <= len(items) <= 3:
        raise ResilienceError(f"session.fsdp: build(mesh) must return model, (model, optimizer) or "
                              f"(model, optimizer, scheduler); got {len(items)} values")
    model, opt, sched = (*items, None, None)[:3]
    if not isinstance(model, FSDPModule):
        raise ResilienceError(f"session.fsdp: build(mesh) must return a model wrapped with fully_shard, "
                              f"got {type(model).__name__}")
    if opt is not None and not isinstance(opt, torch.optim.Optimizer):
        raise ResilienceError(f"session.fsdp: build(mesh)'s second value must be a torch.optim.Optimizer, "
                              f"got {type(opt).__name__}")
    if sched is not None and not (hasattr(sched, "state_dict") and hasattr(sched, "load_state_dict")):
        raise ResilienceError(f"session.fsdp: build(mesh)'s third value (scheduler) has no "
                              f"state_dict()/load_state_dict(): {type(sched).__name__}")
    return model, opt, sched


class RebuiltFSDP:
    """Model, optimizer and scheduler from ``build(mesh)``, rebuilt for every generation.

    ``model``, ``optimizer``, ``scheduler`` and ``mesh`` are the current generation's (take
    them inside the steps loop; do not keep them across steps); calling the object
    calls the model. ``builds`` counts calls of ``build``."""

    def __init__(self, build: Callable[[Any], Any], *, mesh: Callable[[], Any], generation: Callable[[], int],
                 world_size: Callable[[], int], hooks: GenerationHooks, park: Callable[[object], None],
                 rank: Callable[[], int] = lambda: 0) -> None:
        if not callable(build):
            raise ResilienceError(f"session.fsdp needs a callable build(mesh), got {type(build).__name__}")
        self._build, self._mesh_fn, self._gen_fn, self._world_fn = build, mesh, generation, world_size
        self._park, self._rank_fn = park, rank
        self._objs: tuple[Any, Any, Any] | None = None
        self._built_for: int | None = None
        self.mesh = None
        self.pending: dict[str, dict] = {}  # part -> state a restore loaded, applied by the next rebuild
        self.builds = 0
        self._make()  # now: the registered objects must exist before the first state sync
        hooks.add(self.rebuild)

    # -- the current objects ----------------------------------------------------
    @property
    def model(self) -> torch.nn.Module:
        return self._objs[0]

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        return self._objs[1]

    @property
    def scheduler(self) -> Any:
        return self._objs[2]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def parts(self) -> tuple[dict[str, "FsdpPart"], dict[str, "FsdpPart"]]:
        """(sharded parts, replicated parts) to register, by part name."""
        sharded = {"model": FsdpPart(self, "model")}
        if self.optimizer is not None:
            sharded["optimizer"] = FsdpPart(self, "optimizer")
        return sharded, ({"scheduler": FsdpPart(self, "scheduler")} if self.scheduler is not None else {})

    # -- building -----------------------------------------------------------------
    def _make(self) -> None:
        mesh = self._mesh_fn()
        rng = _capture_rng()  # a rebuild draws nothing: the run's RNG stream stays the fault-free one
        try:
            objs = _unpack(self._build(mesh))
        finally:
            _restore_rng(rng)
        for name, p in objs[0].named_parameters():
            fs.check_placement(name, p, "session.fsdp")
            if p.device_mesh.size() != self._world_fn():
                raise ResilienceError(f"session.fsdp: parameter {name!r} is on a mesh of {p.device_mesh.size()} "
                                      f"ranks, the job has {self._world_fn()}; use the mesh build() is given")
        if self._objs is not None and (objs[1] is None) != (self.optimizer is None) or \
                self._objs is not None and (objs[2] is None) != (self.scheduler is None):
            raise ResilienceError("session.fsdp: build(mesh) must return the same kinds of objects every time")
        self._objs, self.mesh = objs, mesh
        self._built_for = self._gen_fn()
        self.builds += 1

    def rebuild(self) -> None:
        """After each generation's state sync: build on the new mesh (unless the objects
        were built for this generation) and load the synced state: a restore's, or else
        the old objects' own (every rank kept its live shards in an unchanged world)."""
        old = self._objs
        if self._built_for != self._gen_fn():
            live = {p: self._current_state(p) for p in PARTS if p not in self.pending and self._has(p)}
            self._make()
            for p in PARTS:
                self.pending.setdefault(p, live.get(p))
            self._park(old)
        if any(v is not None for v in self.pending.values()):
            self._load(self.pending)
        self.pending = {}

    def adopt(self, part: str, state: dict[str, Any]) -> None:
        """A restored ``state`` of ``part`` for the next rebuild to load. Full plain tensors
        an import left in a nested state's ``replicated`` dict become this rank's rows
        (``fs.shard_full_leaves``), so every later save holds shards only."""
        if part != "scheduler" and isinstance(state, dict) and state.get(fs.NESTED):
            shapes = {n: list(p.shape) for n, p in self.model.named_parameters()}
            state = fs.shard_full_leaves(state, shapes, self._world_fn(), self._rank_fn())
        self.pending[part] = state

    def _has(self, part: str) -> bool:
        return self._objs[PARTS.index(part)] is not None

    # -- state ----------------------------------------------------------------------
    def state_of(self, part: str) -> dict[str, Any]:
        """``part``'s state: the one a restore loaded and the rebuild has not applied yet,
        or the current object's."""
        return self.pending[part] if self.pending.get(part) is not None else self._current_state(part)

    def _current_state(self, part: str) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
        from torch.distributed.fsdp import FSDPModule

        model, opt, sched = self._objs
        if part == "scheduler":
            return sched.state_dict()
        for m in model.modules():  # an aborted step may have left parameters unsharded
            if isinstance(m, FSDPModule):
                m.reshard()
        if part == "model":
            return fs.split_tree(get_model_state_dict(model), "session.fsdp model")
        if not opt.state:  # get_optimizer_state_dict would run a step with zero grads to fill it
            fqn = {id(p): n for n, p in model.named_parameters()}
            groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [fqn[id(p)] for p in g["params"]]}
                      for g in opt.param_groups]
            return fs.split_tree({"state": {}, "param_groups": groups}, "session.fsdp optimizer")
        return fs.split_tree(get_optimizer_state_dict(model, opt), "session.fsdp optimizer")

    def _load(self, states: dict[str, dict | None]) -> None:
        """Load nested states into the current objects: optimizer first (its loader may run
        a zero-learning-rate step to create state), then the model, then the scheduler."""
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

        model, opt, sched = self._objs
        make, params = self._dtensor, dict(model.named_parameters())
        o = states.get("optimizer")
        if o is not None and opt is not None:
            if o[fs.REPLICATED].get("state") or o["shards"]:
                tree = fs.join_tree(o, make)
                for fqn, per in tree.get("state", {}).items():
                    for k, v in per.items():
                        per[k] = self._distribute(f"state/{fqn}/{k}", v, params.get(fqn))
                set_optimizer_state_dict(model, opt, tree)
            else:  # no per-parameter state yet: the hyperparameters (lr) only
                for g, saved in zip(opt.param_groups, o[fs.REPLICATED]["param_groups"]):
                    g.update({k: v for k, v in saved.items() if k != "params"})
        if states.get("model") is not None:
            tree = fs.join_tree(states["model"], make)
            set_model_state_dict(model, {k: self._distribute(k, v, params.get(k)) for k, v in tree.items()})
        if states.get("scheduler") is not None and sched is not None:
            sched.load_state_dict(states["scheduler"])
        for p in model.parameters():
            p.grad = None

    def _distribute(self, path: str, value: Any, param: Any) -> Any:
        """A full (global) plain tensor of a sharded parameter's shape, e.g. from an imported
        checkpoint whose keys the template lacked: this rank's torch.chunk rows as a DTensor."""
        if param is None or not isinstance(value, torch.Tensor) or value.dim() == 0 \
                or type(value) is not torch.Tensor or tuple(value.shape) != tuple(param.shape):
            return value
        layout = {"shape": list(value.shape), "split": fs.ROWS}
        mesh = param.device_mesh
        a, b = slice_range(layout, value.numel(), mesh.size(), mesh.get_local_rank())
        return self._dtensor(path, value.reshape(-1)[a:b], layout)

    def _dtensor(self, path: str, flat: torch.Tensor, layout) -> Any:
        from torch.distributed.tensor import DTensor, Shard

        mesh = next(iter(self.model.parameters())).device_mesh
        if layout.get("split") != fs.ROWS:
            raise ResilienceError(f"session.fsdp: {path!r} has layout {layout}, not FSDP2's rows")
        shape = [int(d) for d in layout["shape"]]
        local = fs.local_shape(layout, mesh.size(), mesh.get_local_rank())
        device = next(iter(self.model.parameters())).device
        t = flat.detach().to(device, copy=True).view(local)
        return DTensor.from_local(t, mesh, [Shard(0)], run_check=False, shape=torch.Size(shape),
                                  stride=fs.contiguous_stride(shape))


class FsdpPart:
    """One registered part (model, optimizer or scheduler) of a :class:`RebuiltFSDP`."""

    def __init__(self, owner: RebuiltFSDP, part: str) -> None:
        self._owner, self._part = owner, part

    def state_dict(self) -> dict[str, Any]:
        return self._owner.state_of(self._part)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._owner.adopt(self._part, state)  # the generation's rebuild loads it


def make_fsdp(session, build: Callable[[Any], Any], device_type: str | None,
              park: Callable[[object], None]) -> RebuiltFSDP:
    """``session.fsdp(build)``: the wrapper on the session's 1-D mesh, its parts registered
    as "model", "optimizer" (sharded) and "scheduler" (replicated)."""
    kind = device_type or ("cuda" if torch.cuda.is_available() else "cpu")
    fsdp = RebuiltFSDP(build, mesh=lambda: session.device_mesh(kind, (session.world_size,)),
                       generation=lambda: session.generation, world_size=lambda: session.world_size,
                       hooks=session._hooks, park=park, rank=lambda: session.rank)
    sharded, replicated = fsdp.parts()
    taken = sorted(set(session._state.objects) & (set(sharded) | set(replicated)))
    if taken:
        raise ResilienceError(f"session.fsdp registers {', '.join(map(repr, taken))}: that name is registered "
                              "already; register your other state under other names")
    session._state.register_sharded(**sharded)
    session._state.register(**replicated)
    return fsdp
