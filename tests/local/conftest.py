"""Shared by the tier-3 (localhost) tests: a job factory and one fault-free reference."""

import pytest

from .localjob import LocalJob, final_state as _final


@pytest.fixture
def job_factory(tmp_path):
    jobs = []

    def make(**kw) -> LocalJob:
        job = LocalJob(tmp_path, **kw).start()
        jobs.append(job)
        return job

    yield make
    for job in jobs:
        job.kill_leftovers()


@pytest.fixture(scope="session")
def reference(tmp_path_factory):
    """final.pt of a fault-free run."""
    job = LocalJob(tmp_path_factory.mktemp("reference")).start()
    try:
        code = job.wait(150)
        assert code == 0, job.diag()
        assert not any(e["kind"] == "fault_detected" for e in job.events()), job.diag()
        return _final(job)
    finally:
        job.kill_leftovers()
