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

When this rank's part in the job ends early (fenced, stopped, persisted, aborted,
a standby at the job's end) the session raises :class:`JobEnded` between steps and
``__exit__`` turns it into the process's exit: the code after the block does not run.

The session is a facade over parts with one job each: ``membership`` (plans,
fencing, joining), ``statesync`` (one state for a new generation), ``safepoint``
(completing a step), ``endings`` (finish, persist, abort), ``event_sink`` (events
to the supervisor) and ``parking`` (broken groups released after their timeout).
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
from typing import Any, Iterator, NoReturn

import torch
import torch.distributed as dist

from ..checkpoint.engine import CheckpointEngine
from ..config import ResilienceConfig, load_config
from ..errors import JobEnded, ResilienceError, StepAborted
from ..exits import FAST_EXIT_ENV, exit_fast_at_exit
from ..program_error import ProgramPhase, from_exception
from ..protocol import Plan, PlanAction, Role, StoreKey, WorkerEnv
from .endings import Endings
from .facade import StateFacade
from .event_sink import EventSink
from .headless import REOPEN_S, GuardedStore, HeadlessEnded, StoreWatch
from .headless_io import end_headless
from .heartbeat import Heartbeat, open_store
from .membership import EXIT_ABORTED, EXIT_FENCED, Membership  # noqa: F401 (exit codes re-exported)
from .parking import ParkingLot
from .reconnect import Generation, set_gloo_interface
from .replay import is_replay
from .safepoint import SafePoint
from .statesync import StateSync
from .step import ComputeTime, Step
from .unsupervised import UnsupervisedSession, supervised
from .userfault import is_distributed_error, plan_wait_s

__all__ = ["Session", "Step", "JobEnded", "EXIT_FENCED", "EXIT_ABORTED"]

log = logging.getLogger(__name__)


def preload(modules) -> list[str]:
    """Import ``run.preload`` (a warm standby, before it waits); returns those that failed
    (a warning each: the rank, once adopted, fails on its own import as a cold one would)."""
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except Exception as exc:
            log.warning("run.preload: cannot import %r: %s: %s", name, type(exc).__name__, exc)
            failed.append(name)
    return failed


@dataclasses.dataclass(frozen=True)
class _Parts:
    """What ``__enter__`` builds: store clients, threads, and the parts using them."""

    store: dist.Store
    heartbeat: Heartbeat
    checkpoints: CheckpointEngine
    members: Membership
    sync: StateSync
    safepoint: SafePoint
    endings: Endings


class Session(StateFacade):
    """A rank's side of the job. Not thread-safe; one per process; use as ``with Session():``.

    Outside a supervised job (no ``SR_*`` variables) ``Session()`` returns an
    :class:`~slurm_resilience.worker.unsupervised.UnsupervisedSession` with the same API
    and no recovery: the torchrun environment, or a single process."""

    def __new__(cls, environ: dict[str, str] | None = None):
        if cls is Session and not supervised(os.environ if environ is None else environ):
            return UnsupervisedSession(environ)
        return super().__new__(cls)

    def __init__(self, environ: dict[str, str] | None = None) -> None:
        self._env = WorkerEnv.from_environ(os.environ if environ is None else environ)
        self._fast_exit = (os.environ if environ is None else environ).get(FAST_EXIT_ENV) == "1"
        self.config: ResilienceConfig = load_config(self._env.config_path)
        super().__init__()  # the training state and the per-generation hooks
        self._parking = ParkingLot(hold_s=self.config.reconnect.pg_timeout_s)
        self._compute = ComputeTime()
        self._current: Step | None = None
        self._meshes: dict[tuple, Any] = {}  # device meshes of the current generation
        self._parts: _Parts | None = None  # built by __enter__ (it connects and starts threads)
        self._watch: StoreWatch | None = None  # notes a lost store (worker/headless.py)
        self._phase = ProgramPhase.START  # where an error would leave the program (program_error.py)

    # -- lifecycle -------------------------------------------------------------
    def __enter__(self) -> "Session":
        """Connect, start heartbeats and join the first generation that has a slot for
        this worker (a warm standby blocks here until it is adopted)."""
        env, cfg = self._env, self.config
        set_gloo_interface(cfg.reconnect.gloo_ifname, cfg.reconnect.gloo_lazy_init)
        # A store that stops answering (the batch host is lost) ends the rank headless:
        # guarded clients note it, and a check raises HeadlessEnded after the timeout.
        watch = self._watch = StoreWatch(cfg.detect.headless_timeout_s)
        reopen = lambda: open_store(env, timeout_s=REOPEN_S)  # noqa: E731
        store = GuardedStore(open_store(env), watch, reopen=reopen)
        members: Membership | None = None
        # Events have a client of their own: the checkpoint writer thread emits too.
        events = EventSink(GuardedStore(open_store(env), watch, reopen=reopen, raises=False),
                           worker_id=env.worker_id, node=env.node,
                           where=lambda: members.where() if members else (None, None))
        checkpoints = CheckpointEngine(
            # a resubmitted job (recovery.requeue_by: resubmit) keeps the first job's paths
            cfg.checkpoint.tiers(), job_id=os.environ.get("SR_ORIGIN_JOB_ID") or env.job_id, job_dir=env.job_dir,
            node=env.node, emit=events.emit, mtbf_s=cfg.checkpoint.mtbf_s,
            run_id=env.run_id, adopt_legacy=cfg.checkpoint.adopt_legacy)  # restores this run's only
        hb = Heartbeat(env, cfg.detect.heartbeat_period_s, pulse=cfg.detect.pulse).start()
        members = Membership(env, cfg.reconnect, store, open_client=lambda: open_store(env), emit=events.emit,
                             heartbeat=hb, checkpoints=checkpoints, parking=self._parking,
                             progress=lambda: self._state.step, on_abort=self._abort)
        self._parts = _Parts(
            store=store, heartbeat=hb, checkpoints=checkpoints, members=members,
            sync=StateSync(self._state, checkpoints, store, emit=events.emit, heartbeat=hb, job_dir=env.job_dir,
                           init_from=cfg.checkpoint.init_from),
            safepoint=SafePoint(self._state, checkpoints, store, emit=events.emit, heartbeat=hb,
                                job_dir=env.job_dir),
            endings=Endings(env, self._state, checkpoints, store, emit=events.emit,
                            drain_s=cfg.reconnect.pg_timeout_s))
        self._parts.safepoint.install_preempt_handler(cfg.job.preempt_signum)
        if env.role is Role.STANDBY:  # the script's later imports, paid before adoption
            preload(cfg.run.preload)
        try:
            members.enter(env.generation)
        except JobEnded as ended:  # __exit__ is not called when __enter__ raises
            self.__exit__(JobEnded, ended, ended.__traceback__)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        """Stop the threads; a JobEnded becomes the process's exit with its status; the
        program's own error is reported to the supervisor first (``_report``)."""
        if exc is not None and self._parts is not None and not isinstance(exc, (JobEnded, HeadlessEnded)):
            self._report(exc, tb)
        if self._parts is not None and (isinstance(exc, HeadlessEnded) or (exc is None and self._finished_headless())):
            self._end_headless()  # finished while headless too: the requeued job ends at once
        if self._parts is not None:
            self._parts.checkpoints.close()
            self._parts.heartbeat.stop()
        self._parking.close()
        if isinstance(exc, JobEnded):
            log.info("%s", exc)
            if self._fast_exit:  # the checkpoints are written: skip torch's tear-down
                exit_fast_at_exit(exc.code)
            raise SystemExit(exc.code) from None

    def _report(self, exc: BaseException, tb) -> None:
        """The program raised: its error goes to the store before the process ends (and
        before the liveness connection closes with it), so the supervisor reads it with
        the death. Never masks the error itself."""
        if not isinstance(exc, Exception):  # KeyboardInterrupt, SystemExit: not a program error
            return
        members = self._p.members
        err = from_exception(exc, tb, phase=self._phase, step=self._state.step,
                             generation=members.plan.generation if members.plan is not None else None)
        try:
            store = self._p.store
            store.set(StoreKey.ERROR.of(self._env.worker_id), err.to_json())
            store.check([StoreKey.ERROR.of(self._env.worker_id)])  # a round trip: the set is in
        except Exception as report_exc:  # the store is gone too: the death alone is reported
            log.warning("could not report the program's error to the supervisor: %s", report_exc)

    @property
    def _p(self) -> _Parts:
        if self._parts is None:
            raise ResilienceError("use the session as a context: `with Session() as session:`")
        return self._parts

    @property
    def _group(self) -> Generation:
        return self._p.members.group

    @property
    def rank(self) -> int:
        """This rank in the current generation (a replaced slot keeps its rank; scale-in
        renumbers the survivors in order)."""
        return self._group.rank

    @property
    def world_size(self) -> int:
        """Ranks in the current generation (smaller after a scale-in)."""
        return self._group.world_size

    @property
    def local_rank(self) -> int:
        """This rank's slot on its node (its GPU: ``cuda:local_rank``)."""
        return self._p.members.plan.table.slots[self.rank].local_rank

    @property
    def local_world_size(self) -> int:
        """Ranks per node (G)."""
        return self._p.members.plan.table.tasks_per_node

    @property
    def generation(self) -> int:
        """The current generation's number (0 for the job's first; one more per recovery)."""
        return self._p.members.plan.generation

    @property
    def checkpoints(self) -> CheckpointEngine:
        return self._p.checkpoints

    # -- the loop --------------------------------------------------------------
    def steps(self, total_steps: int) -> Iterator[Step]:
        """Yield steps ``self.step .. total_steps-1``, redoing any step a fault aborts.

        Raises JobEnded (between steps) when this rank's part in the job ends early."""
        p = self._p
        while True:
            try:
                if p.sync.needed(self.generation):
                    self._phase = ProgramPhase.STATE_SYNC
                    with p.heartbeat.progress.busy():  # checkpoint I/O: no step timeout (watchdog)
                        p.sync.sync(self._group, p.members.plan)
                        p.safepoint.restored()  # MTTR ends at the first step after any restore
                        if p.members.plan.action is PlanAction.PERSIST:
                            p.endings.persist()
                    self._meshes.clear()
                    self._phase = ProgramPhase.HOOKS
                    self._run_hooks()
                if self._state.step >= total_steps:
                    self._phase = ProgramPhase.FINISH
                    self._group.barrier()
                    break
            except StepAborted as exc:
                self._recover(exc)
                continue
            st = self._state
            st.mark()  # an aborted step gives back what it drew from the RNGs
            step = self._current = Step(self, st.step, replay=is_replay(st.step, st.high_water),
                                        on_fault=self._user_fault)
            self._phase = ProgramPhase.STEP
            yield step
            if not step.entered:
                raise ResilienceError("wrap the body of each step in `with step:` so a fault can abort it")
            if step.aborted is not None:
                st.rewind()
                self._recover(step.aborted)
                continue
            self._phase = ProgramPhase.SAFE_POINT
            try:
                with p.heartbeat.progress.busy():
                    newer = p.safepoint.complete(step.consumed, self._group, p.members.newer_plan)
            except StepAborted as exc:  # a fault interrupted the checkpoint agreement
                self._recover(exc)
                continue
            if newer:  # safe point: stop here and re-form (fencing included)
                self._recover(StepAborted("stopped at a safe point for a new generation"))
            else:
                p.members.stepped()
        self._phase = ProgramPhase.FINISH
        with p.heartbeat.progress.busy():
            p.endings.finish(self._group)

    # -- bring your own loop: the default group, DDP, wrappers ------------------
    def _park(self, obj: object) -> None:
        self._parking.park(obj)

    def device_mesh(self, device_type: str, mesh_shape: tuple[int, ...], *,
                    mesh_dim_names: tuple[str, ...] | None = None):
        """Collective: a DeviceMesh on this generation's default group (built once per
        generation; call it again after a recovery, e.g. from ``on_generation``)."""
        from torch.distributed.device_mesh import init_device_mesh

        key = (device_type, tuple(mesh_shape), mesh_dim_names)
        if key not in self._meshes:
            self._meshes[key] = init_device_mesh(device_type, tuple(mesh_shape), mesh_dim_names=mesh_dim_names)
        return self._meshes[key]

    def _run_hooks(self) -> None:
        try:
            self._hooks.run(self.generation)
        except Exception as exc:  # a collective of a rebuild failed: a peer is gone
            aborted = self._user_fault(exc)
            if aborted is None:
                raise
            raise aborted from exc

    def _user_fault(self, exc: BaseException) -> StepAborted | None:
        """A collective the toolkit does not own failed: a StepAborted when the supervisor
        publishes the next generation in time, else None (the error propagates)."""
        if not is_distributed_error(exc):
            return None
        cfg = self.config
        wait_s = plan_wait_s(cfg.detect.heartbeat_timeout_s, cfg.recovery.online_timeout_s)
        log.warning("rank %s: a collective failed (%s); waiting up to %.0f s for the next plan",
                    self.rank, str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__, wait_s)
        if not self._p.members.await_newer(wait_s):
            log.error("no new generation within %.0f s: the error is not a fault the supervisor saw", wait_s)
            return None
        return StepAborted(f"a collective failed: {type(exc).__name__}")

    def all_reduce_gradients(self, *modules: torch.nn.Module) -> None:
        """Collective: average gradients over ranks (one flat SUM, deterministic order)."""
        ms = self._compute.note(self._current)
        if ms is not None:
            self._p.heartbeat.update(compute_ms=round(ms, 3))
        grads = [p.grad for m in modules for p in m.parameters() if p.grad is not None]
        if not grads:
            return
        flat = torch.cat([g.reshape(-1) for g in grads])
        self._group.all_reduce_sum(flat)
        flat.div_(self.world_size)
        offset = 0
        for g in grads:
            g.copy_(flat[offset : offset + g.numel()].view_as(g))
            offset += g.numel()

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Collective: in-place SUM over the current generation."""
        return self._group.all_reduce_sum(tensor)

    # -- recovery and endings --------------------------------------------------
    def _recover(self, why: StepAborted) -> None:
        """Leave the broken generation (its group parked) and join the next one."""
        members = self._p.members
        log.warning("rank %s: %s", members.group.rank if members.group else "?", why)
        members.leave()
        members.enter(members.plan.generation + 1)

    def _finished_headless(self) -> bool:
        """Training finished while the store was lost: still lost at the deadline?"""
        watch = self._watch
        if watch is None or not watch.is_lost or watch.timeout_s <= 0:
            return False
        watch.wait_due()
        try:
            self._p.store.check([StoreKey.SHUTDOWN.value])  # a fresh connection, once due
        except HeadlessEnded:
            return True
        return False

    def _own_rank(self) -> int | None:
        """This worker's rank: its group's, else its own slot's in the last plan (by
        worker id: with G ranks per node the node's first slot is another rank's)."""
        members = self._p.members
        if members.group is not None:
            return members.group.rank
        plan = members.plan
        slot = None if plan is None else next((s for s in plan.table.slots if s.worker_id == self._env.worker_id), None)
        return slot.rank if slot is not None else None

    def _end_headless(self) -> None:
        """The batch host is lost: persist this rank's newest state, requeue in turn."""
        plan = self._p.members.plan
        end_headless(state=self._state, checkpoints=self._p.checkpoints, rank=self._own_rank(),
                     world_size=plan.table.world_size if plan is not None else None,
                     job_id=self._env.job_id, job_dir=self._env.job_dir, config=self.config)

    def _abort(self, plan: Plan) -> NoReturn:
        rank = self._own_rank()
        self._p.endings.abort(plan, rank)
