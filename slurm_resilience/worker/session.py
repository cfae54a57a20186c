"""What a training loop calls: register state, iterate steps, all-reduce gradients.

    with Session() as session:                      # a warm standby blocks here
        session.register(model=model, optimizer=opt)
        for step in session.steps(total_steps):
            with step:                              # a fault aborts the step; it is redone
                x, y = data[step.samples(sampler)]
                opt.zero_grad(); loss_fn(model(x), y).backward()
                session.all_reduce_gradients(model)  # collectives first …
                opt.step()                           # … the update last

A step whose collective is interrupted raises StepAborted inside ``with step:``;
the context swallows it, the session waits for the supervisor's next plan, joins
the new generation, takes the newest state from a surviving peer, rolls the data
position back to that step and yields it again.
"""

from __future__ import annotations

import io
import json
import logging
import os
import random
import sys
import threading
import time
from typing import Any, Iterator

import numpy as np
import torch

from ..checkpoint.engine import CheckpointEngine
from ..config import ResilienceConfig, load_config
from ..errors import ResilienceError, StepAborted
from ..files import write_private
from ..protocol import (
    EVENT_COUNTER, SHUTDOWN_KEY, Plan, PlanAction, Role, WorkerEnv,
    PERSIST_REQUEST_KEY, done_key, event_key, plan_key,
)
from .heartbeat import Heartbeat, open_store
from .reconnect import Generation, set_gloo_interface
from . import reshard
from .restore import broadcast_state, choose_source
from .rollback import ResumableSampler

log = logging.getLogger(__name__)

EXIT_FENCED = 0  # left out of a newer generation: not an error of this job
EXIT_ABORTED = 3  # recovery impossible; state persisted in the job directory


class Step:
    """One training step; use as ``with step:`` so an interrupted step is redone."""

    def __init__(self, session: "Session", index: int) -> None:
        self.index = index
        self.rank = session.rank
        self.world_size = session.world_size
        self.position = session.position
        self.consumed = 0
        self.aborted: StepAborted | None = None
        self.entered = False

    def samples(self, sampler: ResumableSampler) -> list[int]:
        """This rank's sample indices for this step (from the exact global sample position)."""
        self.consumed = sampler.batch_size(self.world_size)
        return sampler.indices_at(self.position, self.rank)

    def __enter__(self) -> "Step":
        self.entered = True
        self.started = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and issubclass(exc_type, StepAborted):
            self.aborted = exc
            return True
        return False


class Session:
    """A rank's side of the job. Not thread-safe; one per process."""

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._env = WorkerEnv.from_environ(os.environ if environ is None else environ)
        self.config: ResilienceConfig = load_config(self._env.config_path)
        self._objects: dict[str, Any] = {}
        # User extras saved and restored with the state (picklable values and tensors),
        # e.g. an epoch counter or a gradient-accumulation micro-step. Replicated, like
        # the model: one rank's copy restores every rank, so per-rank values do not belong here.
        self.extras: dict[str, Any] = {}
        self._sharded: list[str] = []  # names of objects with sharded state (reshard.py)
        self._shard_totals: dict[str, dict[str, int]] = {}
        self._prev_world: int | None = None
        self._writer_checks = None  # the checkpoint writer's own store client for plan checks
        self.step = 0
        self.position = 0  # global samples consumed by completed steps: the rollback point
        # Every process starts holding a valid state: the (seeded) step-0 state. A
        # relaunch with no checkpoint yet therefore restarts from step 0 instead of
        # failing; survivors and checkpoints always offer a newer step.
        self._live_state = True
        self._plan: Plan | None = None
        self._gen: Generation | None = None
        self._parked: list[object] = []
        self._first_step_pending = False
        self._ev_lock = threading.Lock()
        self._current: Step | None = None
        self._compute_ms: float | None = None

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self) -> "Session":
        set_gloo_interface(self.config.reconnect.gloo_ifname)
        self._preempted = False
        self._install_preempt_handler()
        self._store = open_store(self._env)
        self._ev_store = open_store(self._env)  # events come from the writer thread too
        self.checkpoints = CheckpointEngine(
            self.config.checkpoint.tiers(), job_id=self._env.job_id, job_dir=self._env.job_dir,
            node=self._env.node, emit=self._emit, mtbf_s=self.config.checkpoint.mtbf_s)
        self._hb = Heartbeat(self._env, self.config.detect.heartbeat_period_s).start()
        self._enter_generation(self._env.generation)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.checkpoints.close()
        self._hb.stop()

    def _install_preempt_handler(self) -> None:
        """A preemption signal sent to the job steps (submitit's --signal without B:)
        is turned into a checkpoint-and-requeue request at the next safe point."""
        import signal as _signal

        spec = self.config.job.preempt_signal
        if spec and threading.current_thread() is threading.main_thread():
            name = spec.split("@")[0]
            sig = getattr(_signal, name if name.startswith("SIG") else "SIG" + name)
            _signal.signal(sig, lambda *_: setattr(self, "_preempted", True))

    @property
    def rank(self) -> int:
        return self._gen.rank

    @property
    def world_size(self) -> int:
        return self._gen.world_size

    @property
    def generation(self) -> int:
        return self._plan.generation

    def register(self, **objects: Any) -> None:
        """Register state to restore on recovery: anything with state_dict/load_state_dict."""
        for name, obj in objects.items():
            if not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise ResilienceError(f"cannot register {name!r}: it has no state_dict()/load_state_dict()")
            self._objects[name] = obj

    def register_sharded(self, **objects: Any) -> None:
        """Register objects whose state is sharded over the ranks (ZeRO-style): their
        state_dict is ``{"shards": {key: 1-D slice}, ...replicated...}`` with rank r's
        slice being ``shard_range(total, world_size, r)`` of one global flat tensor.
        Recoveries restore them from the newest complete checkpoint, resharded to the
        new world size (see ``worker/reshard.py``)."""
        self.register(**objects)
        self._sharded += [n for n in objects if n not in self._sharded]

    # -- the loop --------------------------------------------------------------
    def steps(self, total_steps: int) -> Iterator[Step]:
        """Yield steps ``self.step .. total_steps-1``, redoing any step a fault aborts."""
        while True:
            try:
                if self._gen is None or self._needs_sync:
                    self._sync_state()
                    if self._plan.action is PlanAction.PERSIST:
                        self._persist_and_exit()
                if self.step >= total_steps:
                    self._gen.barrier()
                    break
            except StepAborted as exc:
                self._recover(exc)
                continue
            step = self._current = Step(self, self.step)
            yield step
            if not step.entered:
                raise ResilienceError("wrap the body of each step in `with step:` so a fault can abort it")
            if step.aborted is not None:
                self._recover(step.aborted)
                continue
            self._complete_step(step.consumed)
        self._finish()

    def all_reduce_gradients(self, *modules: torch.nn.Module) -> None:
        """Collective: average gradients over ranks (one flat SUM, deterministic order)."""
        self._note_compute_time()
        grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._gen.all_reduce_sum(flat)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def _note_compute_time(self) -> None:
        """Time from the step's start to its first collective: this rank's own compute,
        which is what tells a straggler apart (the step time is the same on every rank)."""
        if self._current is None or getattr(self._current, "started", None) is None:
            return
        ms = (time.perf_counter() - self._current.started) * 1000
        self._current.started = None  # once per step: later collectives include the first
        self._compute_ms = ms if self._compute_ms is None else 0.7 * self._compute_ms + 0.3 * ms
        self._hb.update(compute_ms=round(self._compute_ms, 3))

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: in-place SUM over the current generation."""
        return self._gen.all_reduce_sum(tensor)

    # -- steps and safe points -------------------------------------------------
    def _complete_step(self, consumed: int) -> None:
        self.step += 1
        self.position += consumed
        self._hb.update(step=self.step)
        if self._first_step_pending:
            self._first_step_pending = False
            self._emit("first_step", step=self.step)
        self._checkpoint()
        if self._preempted:  # ask the supervisor for a PERSIST generation (then requeue)
            self._preempted = False
            self._store.set(PERSIST_REQUEST_KEY, str(self.step))
        # Safe point: a newer plan means stop here and re-form (fencing included).
        if self._store.check([plan_key(self.generation + 1)]):
            self._recover(StepAborted("stopped at a safe point for a new generation"))

    def _checkpoint(self) -> None:
        """At a safe point: save to the tiers due at this step (blocking only for L0)."""
        tiers = self.checkpoints.due(self.step)
        if self.checkpoints.needs_agreement:  # time/auto intervals: every rank must agree
            names = [s.name for s in self.checkpoints.specs]
            flags = torch.tensor([1 if n in tiers else 0 for n in names], dtype=torch.int64)
            self._gen.all_reduce_sum(flags)
            tiers = [n for n, f in zip(names, flags.tolist()) if f]
        if tiers:
            self.checkpoints.save(self.step, self._state_dict(), tiers)

    def _recover(self, why: StepAborted) -> None:
        log.warning("rank %s: %s", self._gen.rank if self._gen else "?", why)
        if self._gen is not None:
            self._parked.append(self._gen.close())
            self._gen = None
        self._enter_generation(self._plan.generation + 1)

    def _enter_generation(self, first: int) -> None:
        """Wait for the first plan at or after ``first`` that concerns this worker, join it."""
        g = first
        while True:
            plan = self._await_plan(g)
            if plan.action is PlanAction.ABORT:
                self._abort(plan)
            if plan.action is PlanAction.STOP:
                self._emit("stopped", step=self.step, reason=plan.reason)
                raise SystemExit(0)
            if self._my_slot(plan) is None:
                if self._env.role is Role.RANK or self._plan is not None:
                    self._emit("fenced", generation=plan.generation)
                    print(f"slurm_resilience: worker {self._env.worker_id} left out of generation "
                          f"{plan.generation}; exiting", file=sys.stderr)
                    raise SystemExit(EXIT_FENCED)
                g += 1  # a standby not chosen this time keeps waiting
                continue
            try:
                self._join(plan)
                return
            except (RuntimeError, StepAborted) as exc:  # another fault while joining
                log.warning("joining generation %d failed: %s", plan.generation, exc)
                g = plan.generation + 1

    def _await_plan(self, g: int) -> Plan:
        key = plan_key(g)
        poll = self.config.reconnect.poll_interval_ms / 1000.0
        while not self._store.check([key]):
            if self._store.check([SHUTDOWN_KEY]):
                raise SystemExit(0)
            time.sleep(poll)
        return Plan.from_json(self._store.get(key))

    def _my_slot(self, plan: Plan):
        return next((s for s in plan.table.slots if s.worker_id == self._env.worker_id), None)

    def _join(self, plan: Plan) -> None:
        slot = self._my_slot(plan)
        t0 = time.time()
        cfg = self.config.reconnect
        nxt = plan_key(plan.generation + 1)
        self._plan = plan
        # Each generation rendezvous through its own store client: an abandoned join
        # may still be blocked in a store wait, and a shared client would hold every
        # later request (plan checks included) behind it until its timeout.
        self._gen = Generation(
            open_store(self._env), plan.table, slot.rank, backend=cfg.backend,
            timeout_s=cfg.pg_timeout_s, poll_ms=cfg.poll_interval_ms,
            interrupted=lambda: self._store.check([nxt]),
        )
        self._needs_sync = True
        self.checkpoints.bind(rank=slot.rank, world_size=plan.table.world_size,
                              nodes=plan.table.nodes, transfer=self._transfer_factory(plan, slot.rank))
        self._hb.update(generation=plan.generation, rank=slot.rank)
        self._emit("reconnected", start=t0, joining=slot.rank in plan.joining)

    def _transfer_factory(self, plan: Plan, rank: int):
        """The checkpoint writer's own gloo group for this generation (built lazily, in its thread)."""
        cfg = self.config.reconnect

        def build() -> Generation:
            # Two clients: the group's rendezvous can block its client in a store wait for
            # the whole timeout (a peer died), and a check queued behind it on the same
            # client would hold the abandonment — and the writer, and training — as long.
            nxt = plan_key(plan.generation + 1)
            if self._writer_checks is None:
                self._writer_checks = open_store(self._env)  # used by the writer thread only
            checks = self._writer_checks
            return Generation(open_store(self._env), plan.table, rank, backend="gloo",
                              timeout_s=cfg.pg_timeout_s, poll_ms=cfg.poll_interval_ms,
                              interrupted=lambda: checks.check([nxt]), channel="ckpt/")

        return build

    # -- restore and rollback --------------------------------------------------
    def _sync_state(self) -> None:
        """Collective: adopt the newest state any rank holds; roll data back to its step."""
        if self._sharded:
            return self._sync_sharded()
        t0 = time.time()
        live = self.step if self._live_state else -1
        # Checkpoints matter when this process holds nothing newer than its start:
        # a fresh process, or a (re)started job at step 0. Survivors offer live state.
        stored = self.checkpoints.best() if live <= 0 else None
        offer = max(live, stored[0] if stored else -1)
        offers = self._gen.all_gather_ints(offer)
        choice = choose_source(offers)
        from_live = self._live_state and self.step == choice.step
        state, source = None, "peer"
        if self._gen.rank == choice.source_rank:
            state = self._state_dict() if from_live else self.checkpoints.load(stored)
            source = "live" if from_live else stored[1]
        state = broadcast_state(self._gen, state, choice.source_rank)
        if not (from_live and self._gen.rank == choice.source_rank):
            self._load_state_dict(state)
        self.step = choice.step
        self._live_state = True
        self._needs_sync = False
        self._first_step_pending = True  # MTTR ends at the first step after any restore
        self._hb.update(step=self.step)
        self._emit("restored", start=t0, step=self.step, position=self.position, source=choice.source_rank,
                   offers=offers, **({"tier": source} if source != "peer" else {}))

    def _sync_sharded(self) -> None:
        """Collective, with sharded state: keep the live state only when every rank
        survived at the same step in an unchanged world; else restore the newest complete
        checkpoint, resharded (a lost rank's slice exists nowhere else)."""
        t0 = time.time()
        live = (self._live_state and not self._plan.joining and self._prev_world in (None, self.world_size))
        offers = self._gen.all_gather_ints(self.step if live else -1)
        source = "live"
        if min(offers) < 0 or len(set(offers)) > 1:
            try:
                state = reshard.restore_sharded(self._gen, self._store, self.checkpoints, self._sharded)
            except RuntimeError as exc:  # a store wait timed out: a peer is gone
                raise StepAborted(f"resharded restore failed: {exc}") from exc
            if state is not None:
                self._load_state_dict(state)
                source = "checkpoint"
            elif max(self._gen.all_gather_ints(self.step)) > 0 or not self._live_state:
                raise ResilienceError("sharded state: no complete checkpoint holds every shard; "
                                      "keep a shared tier or partner copies so a lost rank's slice survives")
        self._shard_totals = self._agree_totals()
        self._prev_world = self.world_size
        self._live_state = True
        self._needs_sync = False
        self._first_step_pending = True
        self._hb.update(step=self.step)
        self._emit("restored", start=t0, step=self.step, position=self.position, offers=offers,
                   source=-1, **({"tier": source, "resharded": True} if source != "live" else {}))
        if self.step == 0 and not self.checkpoints.candidates():
            disk = [s.name for s in self.checkpoints.specs if s.storage != "memory"]
            self.checkpoints.save(0, self._state_dict(), disk)  # step 0 must be restorable too

    def _agree_totals(self) -> dict[str, dict[str, int]]:
        """Collective: global length of every sharded key; checks this rank's slice."""
        local = {n: {k: int(t.numel()) for k, t in sorted(self._objects[n].state_dict()[reshard.SHARDS].items())}
                 for n in self._sharded}
        flat = torch.tensor([v for n in self._sharded for v in local[n].values()], dtype=torch.int64)
        self._gen.all_reduce_sum(flat)
        totals, i = {}, 0
        for n in self._sharded:
            totals[n] = {}
            for k, mine in local[n].items():
                total = int(flat[i])
                i += 1
                a, b = reshard.shard_range(total, self.world_size, self.rank)
                if mine != b - a:
                    raise ResilienceError(f"sharded {n}[{k!r}]: rank {self.rank} holds {mine} elements, "
                                          f"shard_range({total}, {self.world_size}, {self.rank}) says {b - a}; "
                                          "partition with slurm_resilience.shard_range")
                totals[n][k] = total
        return totals

    def _state_dict(self) -> dict[str, Any]:
        rng = {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            rng["cuda"] = torch.cuda.get_rng_state_all()
        return {
            "step": self.step,
            "position": self.position,
            "objects": {n: o.state_dict() for n, o in self._objects.items()},
            "rng": rng,
            "extras": dict(self.extras),
            **({"shard_totals": self._shard_totals} if self._sharded else {}),
        }

    def _load_state_dict(self, state: dict[str, Any]) -> None:
        for name, obj in self._objects.items():
            obj.load_state_dict(state["objects"][name])
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        np.random.set_state(state["rng"]["numpy"])
        if "cuda" in state["rng"] and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        self.extras = dict(state.get("extras", {}))
        self.step = int(state["step"])
        self.position = int(state.get("position", 0))

    # -- endings -----------------------------------------------------------------
    def _finish(self) -> None:
        """Every rank passed the final barrier: report done first, then drain the writer.
        (Done first, because a peer that has already exited cannot take part in a
        checkpoint still in flight, and a fault seen while we drain must not start a
        recovery that needs that peer.)"""
        if self.rank == 0:
            _save_private(self._state_dict(), os.path.join(self._env.job_dir, "final.pt"))
        self._store.set(done_key(self.rank), str(self.step))
        self._emit("done", step=self.step)
        if not self.checkpoints.wait(timeout=self.config.reconnect.pg_timeout_s):
            log.warning("rank %d: checkpoints still in flight at exit were abandoned", self.rank)

    def _persist_and_exit(self) -> None:
        """PERSIST generation: every rank now holds the same (newest) step; write every
        disk tier (collective, through the writer's transfer group) and exit 0."""
        disk = [s.name for s in self.checkpoints.specs if s.storage != "memory"]
        self.checkpoints.wait()  # earlier writes finish or are abandoned (a newer plan exists)
        committed = False
        if disk:
            before = len(self.checkpoints.failures)
            self.checkpoints.save(self.step, self._state_dict(), disk)
            self.checkpoints.wait()
            committed = len(self.checkpoints.failures) == before
        self._emit("persisted", step=self.step, position=self.position, tiers=disk, committed=committed)
        raise SystemExit(0)

    def _abort(self, plan: Plan) -> None:
        """Persist this rank's state durably in the job directory, then exit non-zero."""
        where = None
        if self._live_state and self._objects:
            rank = self._gen.rank if self._gen else (self._plan.table.slot_for_node(self._env.node).rank)
            where = os.path.join(self._env.job_dir, "snapshots", f"rank{rank}-step{self.step:08d}.pt")
            _save_private(self._state_dict(), where)
        self._emit("aborted", step=self.step, path=where)
        print(f"slurm_resilience: job aborted: {plan.reason}; state at step {self.step} kept in {where}",
              file=sys.stderr)
        raise SystemExit(EXIT_ABORTED)

    def _emit(self, kind: str, **fields: Any) -> None:
        """Send an event to the supervisor, which is the event log's only writer."""
        rec = dict(fields, kind=kind, t=time.time(), worker_id=self._env.worker_id,
                   node=self._env.node, generation=self._plan.generation if self._plan else None,
                   rank=self._gen.rank if self._gen else None)
        with self._ev_lock:
            n = self._ev_store.add(EVENT_COUNTER, 1)
            self._ev_store.set(event_key(n), json.dumps(rec))


def _save_private(state: dict[str, Any], path: str) -> None:
    buf = io.BytesIO()
    torch.save(state, buf)
    write_private(path, buf.getvalue())

