"""State sync: after joining a generation every rank adopts the same state.

One path for both kinds of state, ending in one shared tail:

* replicated state: each rank offers the step it can provide (survivors their live
  state, fresh processes their newest checkpoint); the ranks offering the newest
  step keep (or load) it and stream it to the others (``restore.py``);
* sharded state (ZeRO-style): the live state is kept only when every rank survived
  at the same step in an unchanged world; otherwise every rank takes its slice of
  the newest complete checkpoint, resharded (``reshard.py``).

A job with ``checkpoint.init_from`` (a DCP checkpoint) that holds no checkpoint of its
own and no state past step 0 starts from that checkpoint instead (``dcp_io.initial_state``):
replicated state is read by the source rank and broadcast, sharded state by every
rank for its own slice.
"""

from __future__ import annotations

import random
import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.dcp_io import check_init_from, initial_state
from ..checkpoint.state_tree import flatten_state
from ..errors import CheckpointError, ConfigError, ResilienceError, StepAborted
from ..protocol import Plan, WorkerEvent
from . import replay, reshard
from .reconnect import Generation
from .restore import assign_sources, broadcast_state, choose_source, outgoing, stream_state


__all__ = ["TrainingState", "StateSync"]


class TrainingState:
    """What recovery restores: registered objects, extras, RNG, step and data position."""

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.sharded: list[str] = []  # names of objects with sharded state (reshard.py)
        self.shard_totals: dict[str, dict[str, int]] = {}
        # Replicated user extras: one rank's copy restores every rank.
        self.extras: dict[str, Any] = {}
        self.step = 0
        self.position = 0  # global samples consumed by completed steps: the rollback point
        self.high_water = 0  # the most steps the job is known to have completed (replay.py)
        self._rng_mark: dict[str, Any] | None = None  # RNG states when the current step began
        # Every process starts holding a valid state: the (seeded) step-0 state. A
        # relaunch with no checkpoint yet therefore restarts from step 0 instead of
        # failing; survivors and checkpoints always offer a newer step.
        self.live = True

    def register(self, **objects: Any) -> None:
        """Register objects with state_dict/load_state_dict; raises ResilienceError otherwise."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ResilienceError(f"cannot register {name!r}: it has no state_dict()/load_state_dict()")
            self.objects[name] = obj

    def register_sharded(self, **objects: Any) -> None:
        """Register objects whose state is sharded over the ranks (see ``reshard.py``)."""
        self.register(**objects)
        self.sharded += [n for n in objects if n not in self.sharded]

    def mark(self) -> None:
        """A step starts: remember the RNG states, the ones the step will draw from."""
        self._rng_mark = _capture_rng()

    def rewind(self) -> None:
        """The step that started at the last ``mark`` was aborted: give back what it drew
        from the RNGs (dropout in its forward pass), so the redone step draws the same."""
        if self._rng_mark is not None:
            _restore_rng(self._rng_mark)

    def state_dict(self) -> dict[str, Any]:
        rng = _capture_rng()
        objects = {n: o.state_dict() for n, o in self.objects.items()}
        totals, layouts = reshard.shard_meta({n: objects[n] for n in self.sharded}, self.shard_totals)
        return {
            "step": self.step,
            "position": self.position,
            "objects": objects,
            "rng": rng,
            "extras": dict(self.extras),
            "high_water": max(self.high_water, self.step),
            **({"shard_totals": totals} if self.sharded else {}),
            **({"shard_layouts": layouts} if layouts else {}),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for name, obj in self.objects.items():
            obj.load_state_dict(state["objects"][name])
        _restore_rng(state["rng"])
        self.extras = dict(state.get("extras", {}))
        self.step = int(state["step"])
        self.position = int(state.get("position", 0))
        self.high_water = max(self.high_water, int(state.get("high_water", 0)))


def _capture_rng() -> dict[str, Any]:
    rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state_all()
    return rng


def _restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


class StateSync:
    """Brings a new generation's ranks to one state, once per generation joined."""

    def __init__(self, state: TrainingState, checkpoints, store: dist.Store, *,
                 emit: Callable[..., None], heartbeat, job_dir: str = "", init_from: str = "") -> None:
        self._state = state
        self._init_from = init_from
        self._job_dir = job_dir
        self._checkpoints = checkpoints
        self._store = store
        self._emit = emit
        self._hb = heartbeat
        self._synced: int | None = None  # the generation whose state was last adopted
        self._prev_world: int | None = None  # world size of that generation (sharded state)

    def needed(self, generation: int) -> bool:
        """The ranks of ``generation`` have not adopted a common state yet."""
        return self._synced != generation

    def sync(self, group: Generation, plan: Plan) -> None:
        """Collective: adopt the newest state any rank holds; roll data back to its step.

        Raises StepAborted when a peer fails meanwhile (every rank recovers), and
        ResilienceError when sharded state cannot be restored at all.
        """
        t0 = time.time()
        high = None  # the job's high-water step: any one rank, the state or the mark file
        if self._state.sharded:
            source, offers, tier = self._sync_sharded(group, plan)
        else:
            source, offers, tier, high = self._sync_replicated(group)
        self._state.live = True
        st = self._state
        if high is None:
            high = max(group.all_gather_ints(
                replay.high_water(st.high_water, st.step, replay.read_mark(self._job_dir))))
        st.high_water = high
        self._synced = plan.generation
        self._prev_world = group.world_size
        self._hb.update(step=self._state.step)
        self._emit(WorkerEvent.RESTORED, start=t0, step=self._state.step, position=self._state.position,
                   source=source, offers=offers, **tier)
        imported = tier.get("tier") == "init_from"
        if self._state.sharded and (self._state.step == 0 or imported) and not self._checkpoints.candidates():
            disk = [s.name for s in self._checkpoints.specs if s.storage != "memory"]
            self._checkpoints.save(self._state.step, self._state.state_dict(), disk)  # so must step 0 (or imported)

    def _sync_replicated(self, group: Generation) -> tuple[int, list[int], dict[str, Any], int | None]:
        """Collective: ranks at the newest step keep (or load) it; the others receive it,
        streamed from a source among them (``restore.py``). One gather carries each rank's
        offer, what it knows of the high-water step and, from a live state, its side of the
        transfer (``restore.outgoing``), so a survivor-sourced restore is that gather and one
        all-to-all per 16 MiB; the high-water step comes back with it then (else None)."""
        st = self._state
        live = st.step if st.live else -1
        # Checkpoints matter when this process holds nothing newer than its start:
        # a fresh process, or a (re)started job at step 0. Survivors offer live state.
        stored = self._checkpoints.best() if live <= 0 else None
        offer = max(live, stored[0] if stored else -1)
        try:
            ready = outgoing(st.state_dict()) if st.live and offer == live else None
        except Exception:  # noqa: BLE001 the program's own state_dict(): it raises again below, after
            ready = None  # the gather, on every rank alike (so every rank reports it, not the first alone)
        known = replay.high_water(st.high_water, replay.read_mark(self._job_dir))
        rows = group.all_gather_rows([offer, known, *(ready.meta if ready else (-1, -1, -1))])
        offers, metas = [r[0] for r in rows], [r[2:] for r in rows]
        choice = choose_source(offers)
        # Every rank at the newest step offers it live: the restored state's high water is
        # one of theirs (each rank's, the mark's, or the step): no gather after the restore.
        high = max(choice.step, *(r[1] for r in rows)) \
            if all(m[0] >= 0 for o, m in zip(offers, metas) if o == choice.step) else None
        if self._importing(group, choice.step == 0 and stored is None, choice.step == 0):
            state = None  # the lowest rank reads the DCP checkpoint; every rank adopts it
            if group.rank == choice.source_rank:
                state = initial_state(self._init_from, st.state_dict(), (), group.world_size, 0)
            st.load_state_dict(broadcast_state(group, state, choice.source_rank))
            return choice.source_rank, offers, {"tier": "init_from"}, None
        sources = assign_sources(offers)
        from_live = st.live and st.step == choice.step
        state, into, extra = None, None, {}
        if offers[group.rank] == choice.step:
            if from_live:
                state = st.state_dict()
            else:  # read into this rank's own tensors (CPU or GPU): its old state is gone from here on
                st.live = False
                state = self._checkpoints.load(stored, into=flatten_state(st.state_dict())[0])
                extra["tier"] = stored[1]
        else:  # receive into this rank's own tensors: its old state is gone from here on
            st.live = False
            into = flatten_state(st.state_dict())[0]
            extra["peer"] = sources[group.rank]
        state = stream_state(group, sources, state, into=into, ready=ready if from_live else None, metas=metas)
        if not from_live:
            st.load_state_dict(state)
        st.step = choice.step
        return choice.source_rank, offers, extra, high

    def _importing(self, group: Generation, mine: bool, candidate: bool) -> bool:
        """Collective when ``candidate`` (the same on every rank): start from ``init_from``
        when no rank holds a checkpoint or state past step 0 (``mine``: this rank's part).
        Every rank checks the DCP's keys, so a bad path fails every rank alike."""
        if not (self._init_from and candidate):
            return False
        if min(group.all_gather_ints(int(mine))) == 0:
            return False
        try:
            check_init_from(self._init_from, list(self._state.objects))
        except CheckpointError as exc:
            raise ConfigError(str(exc)) from None
        return True

    def _sync_sharded(self, group: Generation, plan: Plan) -> tuple[int, list[int], dict[str, Any]]:
        """Collective: keep the live state only when every rank survived at the same step
        in an unchanged world; else restore the newest complete checkpoint, resharded
        (a lost rank's slice exists nowhere else)."""
        st = self._state
        live = st.live and not plan.joining and self._prev_world in (None, group.world_size)
        offers = group.all_gather_ints(st.step if live else -1)
        source = "live"
        if min(offers) < 0 or len(set(offers)) > 1:
            try:
                state = reshard.restore_sharded(group, self._store, self._checkpoints, st.sharded)
            except dist.DistError as exc:  # a store request failed: a peer or the store is gone
                raise StepAborted(f"resharded restore failed: {exc}") from exc
            top = max(group.all_gather_ints(st.step)) if state is None else -1  # the same on every rank
            if state is not None:
                st.load_state_dict(state)
                source = "checkpoint"
            elif self._importing(group, st.live, top == 0):
                st.load_state_dict(initial_state(self._init_from, st.state_dict(), st.sharded, group.world_size,
                                                 group.rank))
                source = "init_from"
            elif top > 0 or not st.live:
                raise ResilienceError("sharded state: no complete checkpoint holds every shard; "
                                      "keep a shared tier or partner copies so a lost rank's slice survives")
        st.shard_totals = self._agree_totals(group)
        return -1, offers, ({"tier": source, "resharded": True} if source != "live" else {})

    def _agree_totals(self, group: Generation) -> dict[str, dict[str, int]]:
        """Collective: global length of every sharded key; checks this rank's slice
        against its layout (``reshard.slice_range``)."""
        st = self._state
        states = {n: st.objects[n].state_dict() for n in st.sharded}
        local = {n: {k: int(t.numel()) for k, t in sorted(states[n][reshard.SHARDS].items())} for n in st.sharded}
        layouts = {n: dict(states[n].get(reshard.LAYOUTS) or {}) for n in st.sharded}
        flat = torch.tensor([v for n in st.sharded for v in local[n].values()], dtype=torch.int64)
        group.all_reduce_sum(flat)
        totals, i = {}, 0
        for n in st.sharded:
            totals[n] = {}
            for k, mine in local[n].items():
                total = int(flat[i])
                i += 1
                try:
                    a, b = reshard.slice_range(layouts[n].get(k), total, group.world_size, group.rank)
                except ValueError as exc:
                    raise ResilienceError(f"sharded {n}[{k!r}]: bad layout: {exc}") from None
                if mine != b - a:
                    raise ResilienceError(f"sharded {n}[{k!r}]: rank {group.rank} holds {mine} elements, "
                                          f"its layout over {group.world_size} ranks says {b - a} of {total}; "
                                          "partition with slurm_resilience.shard_range")
                totals[n][k] = total
        return totals
