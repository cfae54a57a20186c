"""Relaunch mode (`slurm-resilience run`): a recovery's lines, phases and end, decided
purely (``relaunch_recovery.py`` through ``decide``), then read as ``timeline`` shows them.
The executor against a fake srun: tests/unit/test_relaunch.py; on the lab:
tests/e2e/test_restart_slurm.py."""

import dataclasses
import re

import pytest

from slurm_resilience.config import load_config
from slurm_resilience.events import format_timeline
from slurm_resilience.lifecycle import JobPhase
from slurm_resilience.model import Fault, FaultKind, RankTable
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide import relaunch_recovery
from slurm_resilience.supervisor.decide.decide import EXIT_OK, decide
from slurm_resilience.supervisor.observe.step_output import first_progress, step_in_output
from slurm_resilience.supervisor.decide.state import Mode, Policy, SupervisorState

WORKERS = ("n2", "n3", "n4")
P = Policy.from_config(load_config({"recovery": {"local_standbys": False}}), mode=Mode.RELAUNCH, can_requeue=False)


def started(tasks_per_node=1, spares=("n5",)):
    state = SupervisorState(job_id="7", phase=JobPhase.STARTING, table=RankTable(generation=0, slots=()),
                            target_world=len(WORKERS), worker_nodes=WORKERS, spare_nodes=spares,
                            addresses={n: "127.0.0.1" for n in WORKERS + spares}, tasks_per_node=tasks_per_node)
    state, _ = decide(state, m.Start(), 0.0, P)
    state, acts = decide(state, m.Published(0, 0.5), 0.5, P)  # the job's first step: no recovery
    assert acts == []
    return state


def lost(node, t=10.0):
    return m.StepFaults((Fault(kind=FaultKind.NODE_LOST, rank=None, node=node, time=t, detail="slurmd unreachable"),),
                        t, step="sr-restart-0")


STEP_DIED = m.StepFaults((Fault(kind=FaultKind.PROCESS_DIED, rank=None, node="n[2-4]", time=20.0,
                                detail="exit code 1"),), 20.0, step="sr-restart-1")


def said(acts):
    return [a.text for a in acts if isinstance(a, m.Say)]


def emitted(acts, kind=None):
    return [a for a in acts if isinstance(a, m.Emit) and (kind is None or a.kind == kind)]


def events(acts, now):
    """The ``events.jsonl`` lines the executor would write for ``acts`` at ``now``."""
    return [{"t": now, "kind": str(a.kind), **a.fields} for a in emitted(acts)]


def test_node_lost_to_first_step_says_the_session_lines_and_logs_four_phases():
    state = started()
    state, acts = decide(state, lost("n3"), 10.2, P)
    assert said(acts)[:1] == ["fault: rank 1 on n3: NODE_LOST (slurmd unreachable)"]
    assert "recovery 1: node-replacement, relaunching the step (relaunch 1) on n2,n4,n5" in said(acts)
    start = emitted(acts, "recovery_start")[0].fields
    assert start == {"recovery": 1, "t": 10.0, "level": "node-replacement", "generation": 1}
    fault = emitted(acts, "fault_detected")[0].fields
    assert fault["observed_at"] == 10.0 and fault["fault"]["rank"] == 1  # the timeline's fault of the recovery
    assert state.recovery.marks == {"detected": 10.0, "classified": 10.2, "replaced": 10.2}
    log = events(acts, 10.2)

    state, acts = decide(state, m.Published(1, 10.5), 10.5, P)  # the relaunched step runs
    assert said(acts) == ["recovery 1: relaunch 1 started on n2,n4,n5 500.0 ms after detection"]
    state, again = decide(state, m.Published(1, 10.9), 10.9, P)
    assert again == [] and state.recovery.marks["published"] == 10.5

    state, acts = decide(state, m.StepTrained(1, 14.0, step=11), 14.0, P)
    phases = [(e.fields["phase"], e.fields["start"], e.fields["end"]) for e in emitted(acts, "phase")]
    assert [(str(p), s, e) for p, s, e in phases] == [
        ("classify", 10.0, 10.2), ("replace", 10.2, 10.2), ("ranktable", 10.2, 10.5), ("first_step", 10.5, 14.0)]
    done = emitted(acts, "recovery_done")[0].fields
    assert done["first_step"] == 14.0 and done["detect_to_step_s"] == pytest.approx(4.0) and done["step"] == 11
    assert said(acts) == ["recovery 1 done: relaunch 1 trained a step 4000 ms after detection"]
    assert state.recovery is None and state.phase is JobPhase.RUNNING
    log += [{**e, "t": e.get("t", 14.0)} for e in events(acts, 14.0)]

    text = format_timeline(log)
    assert "recovery 1: 4000.0 ms" in text  # detection to the first step
    assert [line.split()[0] for line in text.split("recovery 1: ")[1].splitlines()[2:]] == [
        "classify", "replace", "ranktable", "first_step"]

    state, acts = decide(state, m.AllDone(), 30.0, P)
    assert said(acts) == ["job finished after 1 recovery"] and acts[-1] == m.Exit(EXIT_OK)


def test_a_progress_line_older_than_the_relaunch_is_timed_at_the_relaunch():
    state, _ = decide(started(), lost("n3"), 10.2, P)
    state, _ = decide(state, m.Published(1, 10.5), 10.5, P)
    _, acts = decide(state, m.StepTrained(1, 9.0), 10.6, P)  # a node's clock behind the supervisor's
    assert emitted(acts, "recovery_done")[0].fields["first_step"] == 10.5
    assert "step" not in emitted(acts, "recovery_done")[0].fields  # the line gave no step number


def test_a_step_of_another_generation_or_before_the_relaunch_changes_nothing():
    state = started()
    assert decide(state, m.StepTrained(0, 1.0, 1), 1.0, P) == (state, [])  # the job's first start
    state, _ = decide(state, lost("n3"), 10.2, P)
    assert decide(state, m.StepTrained(1, 10.3), 10.3, P) == (state, [])  # not started yet
    assert decide(state, m.Published(0, 10.3), 10.3, P) == (state, [])


def test_a_relaunched_step_that_fails_before_a_step_closes_its_recovery_without_a_first_step():
    state, _ = decide(started(), lost("n3"), 10.2, P)
    state, _ = decide(state, m.Published(1, 10.5), 10.5, P)
    state, acts = decide(state, STEP_DIED, 20.1, P)
    lines = said(acts)
    assert lines[0] == ("recovery 1: the relaunched step failed before the program reported a step "
                        "(no line in SR_PROGRESS_FILE: no first-step time)")
    assert [str(e.fields["phase"]) for e in emitted(acts, "phase")] == ["classify", "replace", "ranktable"]
    assert [e.fields["recovery"] for e in emitted(acts, "phase")] == [1, 1, 1]
    assert not emitted(acts, "recovery_done")
    assert "fault: the step on n[2-4]: PROCESS_DIED (exit code 1)" in lines
    assert "recovery 2: process-restart, relaunching the step (relaunch 2) on n2,n4,n5" in lines
    assert state.recovery.number == 2 and state.recovery.marks["detected"] == 20.0
    text = format_timeline(events(acts, 20.1))
    assert "recovery 1: unfinished" in text


def test_the_job_ending_before_a_progress_line_closes_the_recovery_then_finishes():
    state, _ = decide(started(), lost("n3"), 10.2, P)
    state, _ = decide(state, m.Published(1, 10.5), 10.5, P)
    state, acts = decide(state, m.AllDone(), 50.0, P)
    assert said(acts)[0].startswith("recovery 1: the relaunched step ended before the program reported a step")
    assert not emitted(acts, "recovery_done") and emitted(acts, "job_done")
    assert acts[-1] == m.Exit(EXIT_OK) and state.phase is JobPhase.SUCCEEDED and state.recovery is None


def test_unfinished_before_the_relaunch_started_logs_only_what_was_seen():
    state, _ = decide(started(), lost("n3"), 10.2, P)
    _, acts = relaunch_recovery.unfinished(state, "x")
    assert [str(e.fields["phase"]) for e in emitted(acts, "phase")] == ["classify", "replace"]
    assert relaunch_recovery.unfinished(started(), "x")[1] == []  # no recovery: nothing to close


def test_fault_lines_name_every_rank_of_a_lost_node_and_the_whole_step():
    state = started(tasks_per_node=2)
    faults = [dataclasses.replace(lost("n3").faults[0], rank=2), STEP_DIED.faults[0]]
    assert said(relaunch_recovery.fault_lines(state, faults)) == [
        "fault: ranks 2,3 on n3: NODE_LOST (slurmd unreachable)",
        "fault: the step on n[2-4]: PROCESS_DIED (exit code 1)"]


@pytest.mark.parametrize("data, want", [
    (b"", None), (b"5 12.5", None),  # nothing complete yet
    (b"5 12.5\n6 13.0\n", (5, 12.5)), (b"7\n", (7, None)), (b"7 soon\n", (7, None)),
    (b"epoch 1 done\n", (None, None)),  # any line is a step trained; timed when seen
])
def test_first_progress_reads_the_first_complete_line(data, want):
    assert first_progress(data) == want


@pytest.mark.parametrize("pattern, data, want", [
    (r"^step (\d+)", b"restart 1\nstep 11 loss 0.2\nstep 12\n", (11, None)),
    (r"it=(?P<step>\d+)", b"x it=7 y\n", (7, None)),
    (r"epoch done", b"epoch done\n", (None, None)),  # no group: a step, number unknown
    (r"^step (\d+)", b"step 11 lo", None),  # an incomplete line is read again later
    (r"^step (\d+)", b"nothing here\n", None),
])
def test_step_in_output_finds_the_first_matching_complete_line(pattern, data, want):
    assert step_in_output(data, re.compile(pattern)) == want


def test_a_step_pattern_that_is_no_regular_expression_is_a_config_error():
    from slurm_resilience.errors import ConfigError

    with pytest.raises(ConfigError, match=r"run.step_pattern '\(' is not a regular expression"):
        load_config({"run": {"step_pattern": "("}})
