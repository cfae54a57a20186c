"""Tier 3: healthy spares only. Two spares; one fails its health check (a user command
that fails on that node, or a node-local directory without enough free space): the job
drains it with the check's reason, adopts the other spare when a node is lost, and
ends bit-identical to a fault-free run."""

import sys

import pytest

from .localjob import INJECT_AFTER, assert_same_training, final_state

pytestmark = pytest.mark.timeout(300)

# fails on pseudo-node local5 only (the argv list is the user's own, run without a shell)
FAILS_ON_LOCAL5 = [sys.executable, "-c",
                   "import os, sys; n = os.environ['SLURMD_NODENAME']; print('probe says', n, 'is sick') "
                   "if n == 'local5' else None; sys.exit(n == 'local5')"]


def _events(job, kind):
    return [e for e in job.events() if e["kind"] == kind]


def test_a_spare_failing_the_user_check_is_drained_and_the_other_adopted(job_factory, reference):
    job = job_factory(nodes=3, spares=2, recovery={"health_check": FAILS_ON_LOCAL5})
    st = job.wait_for_step(INJECT_AFTER)
    failed = _events(job, "spare_check_failed")
    assert [e["node"] for e in failed] == ["local5"] and "probe says local5 is sick" in failed[0]["reason"]
    assert {e["node"] for e in _events(job, "spare_checked")} == {"local4"}
    job.launcher.fail_node(st["ranks"][1]["node"])
    assert job.wait() == 0, job.diag()
    assert_same_training(final_state(job), reference)
    assert [p["nodes"][1] for p in _events(job, "plan")][-1] == "local4"
    assert "health check" in job.launcher.isolated["local5"] and "sick" in job.launcher.isolated["local5"]


def test_a_spare_without_enough_free_disk_is_skipped(job_factory, tmp_path):
    """local_min_free_gb above what the (shared) filesystem of every node-local directory
    has: no spare passes, so a lost node is answered by scale-in, not by a spare."""
    import shutil

    free_gb = shutil.disk_usage(tmp_path).free / (1 << 30)
    job = job_factory(nodes=3, spares=1, checkpoint={"local_min_free_gb": free_gb * 2 + 1})
    st = job.wait_for_step(INJECT_AFTER)
    failed = _events(job, "spare_check_failed")
    assert [e["node"] for e in failed] == ["local4"] and "GiB free" in failed[0]["reason"], failed
    job.launcher.fail_node(st["ranks"][1]["node"])
    assert job.wait() == 0, job.diag()
    assert [e["level"] for e in _events(job, "recovery_done")] == ["scale-in"]
