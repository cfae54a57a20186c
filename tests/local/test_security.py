"""A foreign process next to a running job: it cannot join, read or disturb it.

The liveness socket checks the per-job token on every connection. torch's TCPStore
has no authentication, so the job keeps every key under a 128-bit secret prefix
(the token, a 0600 file in the job directory): a client without it sees none of
the job's keys. Files and directories the job writes are private.
"""

import json
import os
import socket
import stat
from datetime import timedelta

import pytest
import torch.distributed as dist

from .localjob import INJECT_AFTER, assert_same_training, final_state

pytestmark = pytest.mark.timeout(240)


def test_foreign_connections_are_rejected_and_job_is_unaffected(job_factory, reference):
    job = job_factory()
    st = job.wait_for_step(INJECT_AFTER)
    ep = st["endpoints"]
    # wrong token, garbage, and a well-formed hello with a guessed token
    for payload in (b'{"token": "guess", "worker_id": "x", "node": "n", "pid": 1}\n', b"GET / HTTP/1.0\r\n\r\n"):
        with socket.create_connection((ep["host"], ep["liveness_port"]), timeout=5) as s:
            s.sendall(payload)
            s.settimeout(5)
            assert s.recv(16) == b""  # the supervisor hung up
    # a foreign store client sees none of the job's keys
    foreign = dist.TCPStore(ep["host"], ep["store_port"], None, False, timedelta(seconds=5), wait_for_workers=False)
    assert not foreign.check(["plan/0"]) and not foreign.check(["hb/local1.1"])
    foreign.set("plan/1", "not a plan")  # cannot reach the job's namespace
    assert job.wait() == 0, job.diag()
    assert_same_training(final_state(job), reference)
    assert json.loads((job.job_dir / "status.json").read_text())["endpoints"]["rejected_connections"] >= 2
    for path in (job.job_dir / "token", job.job_dir / "config.yaml", job.job_dir / "events.jsonl",
                 job.job_dir / "final.pt", job.job_dir / "ranktable.json"):
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
    assert stat.S_IMODE(os.stat(job.job_dir).st_mode) == 0o700
