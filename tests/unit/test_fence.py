"""A rank that lost the store asks Slurm whether it is still the job's before its
headless ending writes anything (``worker/fence.py``): recorded ``scontrol -o show job``
lines, pure."""

from slurm_resilience.slurm.parse import parse_scontrol_jobs
from slurm_resilience.worker import fence

PLAIN = ("JobId=41 JobName=sr JobState=RUNNING Restarts=0 NodeList=n[1-2,4] BatchHost=n1 NumNodes=3\n")
HET = ("JobId=75 HetJobId=75 HetJobOffset=0 JobState=RUNNING NodeList=n1 BatchHost=n1\n"
       "JobId=76 HetJobId=75 HetJobOffset=1 JobState=RUNNING NodeList=n[2,4-5] BatchHost=n2\n")


def test_a_node_still_in_the_job_and_not_isolated_is_not_fenced():
    assert fence.slurm_fence(parse_scontrol_jobs(PLAIN), "41", "n2", "ALLOCATED") is None
    assert fence.slurm_fence(parse_scontrol_jobs(PLAIN), "41", "n4", "MIXED") is None
    # a het job's worker component is a record of its own
    assert fence.slurm_fence(parse_scontrol_jobs(HET), "75", "n5", "ALLOCATED") is None


def test_a_node_taken_out_of_the_job_is_fenced():
    why = fence.slurm_fence(parse_scontrol_jobs(PLAIN), "41", "n3", "IDLE")
    assert why == "node n3 is no longer one of job 41's nodes"
    assert "no longer" in fence.slurm_fence(parse_scontrol_jobs(HET), "75", "n3", "IDLE")


def test_an_isolated_node_is_fenced_even_while_still_listed():
    for state in ("DOWN*", "ALLOCATED+DRAIN", "MIXED+DRAIN", "DOWN+NOT_RESPONDING", "FAIL"):
        why = fence.slurm_fence(parse_scontrol_jobs(PLAIN), "41", "n2", state)
        assert why == f"node n2 is {state} in Slurm", state


def test_no_record_of_the_job_is_fenced():
    assert "no record of job 99" in fence.slurm_fence(parse_scontrol_jobs(PLAIN), "99", "n2", "IDLE")
    assert "no record" in fence.slurm_fence({}, "41", "n2", None)


def test_outside_slurm_nothing_is_asked(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("no Slurm call expected")

    monkeypatch.setattr(fence.commands, "run", boom)
    assert fence.ask_slurm("41", None) is None
    assert fence.ask_slurm("local-17", "n1") is None


def test_slurmctld_not_answering_counts_as_fenced(monkeypatch):
    from slurm_resilience.errors import SlurmCommandError

    def silent(argv, **k):
        raise SlurmCommandError(argv, None, "timed out after 5s")

    monkeypatch.setattr(fence.commands, "run", silent)
    assert fence.ask_slurm("41", "n2").startswith("slurmctld did not answer")
