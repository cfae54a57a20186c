"""Regression tests for two fixes found the hard way (see the commits named).

a8c7c72 — a fault while ranks finish: every rank reports ``done`` before it drains its
checkpoint writer, so a rank that dies (or exits) while its peers drain the last
checkpoint cannot start a recovery that needs ranks which have already exited.

db94f00 — a 14–20 s writer stall after a kill: the checkpoint transfer group's
rendezvous and the writer's plan checks shared one store client, so a rendezvous
blocked on a dead peer held the abandon check for the whole process-group timeout,
and ``save()`` blocked training behind the busy writer. Here the timeout is 120 s, so
the old stall would outlast the job's whole budget instead of hiding in noise.
"""

import os
import signal
import time

import pytest

from .localjob import INJECT_AFTER, assert_same_training, final_state

pytestmark = pytest.mark.timeout(240)

PG_TIMEOUT_S = 120.0


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


def test_a_rank_killed_after_done_while_peers_drain_does_not_start_a_recovery(job_factory, reference):
    # a checkpoint at the last step (every 10 steps, 40 steps, with partner copies and an
    # L2 drain): the ranks' writers are busy while they finish
    job = job_factory(checkpoint={"local_every": 10, "shared_every_kth": 1})
    last = None
    deadline = time.monotonic() + 120
    while last is None:  # the last rank's own done report, then its process is killed
        assert time.monotonic() < deadline and job._thread.is_alive(), job.diag()
        done = [e for e in _events(job, "rank_done") if e["rank"] == 2] if (job.job_dir / "events.jsonl").exists() else []
        last = done[0] if done else None
        time.sleep(0.01)
    pid = next((r["pid"] for r in (job.status() or {"ranks": []})["ranks"] if r["rank"] == 2), None)
    if pid:
        try:
            os.kill(pid, signal.SIGKILL)  # a worker this job started
        except ProcessLookupError:
            pass  # it had already exited: the same fault, as the supervisor sees it
    assert job.wait() == 0, job.diag()
    assert not _events(job, "recovery_start"), job.diag()
    assert _events(job, "job_done")
    assert_same_training(final_state(job), reference)


def test_no_writer_stall_after_a_node_is_lost(job_factory, reference):
    job = job_factory(checkpoint={"local_every": 2, "shared_every_kth": 1},
                      reconnect={"pg_timeout_s": PG_TIMEOUT_S,
                                     "nccl_heartbeat_timeout_s": PG_TIMEOUT_S + 60})  # the timeout order
    st = job.wait_for_step(INJECT_AFTER)
    job.launcher.fail_node(st["ranks"][-1]["node"])  # the last rank's node, while its writer transfers
    assert job.wait(timeout_s=PG_TIMEOUT_S) == 0, job.diag()
    done = _events(job, "recovery_done")
    assert [d["level"] for d in done] == ["node-replacement"], job.diag()
    after = [e for e in _events(job, "rank_checkpoint_saved") if e["t"] > done[0]["first_step"]]
    assert after, "checkpoints continue after the recovery"
    # the old stall held save() (the training thread) for about the whole pg timeout
    worst = max(e["stall_ms"] for e in after)
    assert worst < PG_TIMEOUT_S * 1000 / 4, f"save() stalled {worst:.0f} ms after the recovery"
    assert_same_training(final_state(job), reference)
