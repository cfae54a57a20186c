"""Issue 22: a program's own error is not a node fault — decided in ``decide()``.

The three rules of ``supervisor/decide/blame.py`` driven through ``decide`` with the
observations the executor makes (pure: no Slurm, torch or files), plus the records
the ranks send (``program_error``)."""

import pytest

from slurm_resilience.program_error import ProgramError, ProgramPhase, from_exception, signature_digest
from slurm_resilience.supervisor.decide import blame
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.decide import EXIT_FAILED, decide
from slurm_resilience.lifecycle import JobPhase
from slurm_resilience.protocol import EventKind, PlanAction

from test_decide import finish_recovery, kinds, of, policy, started


def error(msg="Error(s) in loading state_dict for Linear: Missing key(s) 'w'", *, step=None,
          phase=ProgramPhase.STATE_SYNC, generation=0, kind=RuntimeError):
    try:
        raise kind(msg)
    except Exception as e:
        return from_exception(e, e.__traceback__, phase=phase, step=step, generation=generation)


def died(state, rank, err, **flags):
    """Rank ``rank``'s process exited on a reachable node, after reporting ``err``."""
    wid = state.table.slots[rank].worker_id
    return m.Suspect(worker_id=wid, t=1.0, process_exited=True, slurmd_reachable=True, error=err, **flags)


def no_node_taken(acts):
    assert not of(acts, m.Isolate) and m.Requeue() not in acts
    assert not [a for a in of(acts, m.Launch)]


def test_the_same_error_on_every_rank_fails_the_job_once_with_the_programs_traceback():
    p = policy(max_requeues=3)
    state, _ = started(p)
    err = error()
    state, acts = decide(state, m.Suspects(tuple(died(state, r, err) for r in range(3))), 1.1, p)
    no_node_taken(acts)
    assert acts[-1] == m.Exit(EXIT_FAILED, acts[-1].error) and state.phase is JobPhase.FAILED
    assert "the program failed: RuntimeError: Error(s) in loading state_dict" in acts[-1].error
    assert "no node isolated" in acts[-1].error and state.recovery is None and state.excluded == frozenset()
    assert of(acts, m.Publish)[0].plan.action is PlanAction.ABORT
    said = [a.text for a in of(acts, m.Say)]
    assert any(s.startswith("  | Traceback") for s in said) and any("RuntimeError: Error(s)" in s for s in said)
    assert state.failure["traceback"] == list(err.traceback)
    failed = [a for a in of(acts, m.Emit) if a.kind is EventKind.JOB_FAILED][0]
    assert failed.fields["program_error"]["digest"] == err.digest and failed.fields["ranks"] == [0, 1, 2]


def test_the_same_error_arriving_rank_by_rank_is_recognised_on_the_second_node():
    """Ranks die one by one: the first looks like any process death (an online restart);
    the same error from a rank of another node in that generation ends the job."""
    p = policy()
    state, _ = started(p)
    err = error()
    state, acts = decide(state, m.Suspects((died(state, 1, err),)), 1.0, p)
    assert state.recovery.level == "online"
    state, acts = decide(state, m.Suspects((died(state, 0, err),)), 1.2, p)
    no_node_taken(acts)
    assert acts[-1].code == EXIT_FAILED and "on rank(s) 0, 1 of 2 node(s) in generation 0" in acts[-1].error


def test_an_error_at_the_same_point_after_each_recovery_is_the_programs():
    p = policy(fault_retry_times=5, max_requeues=3)
    state, _ = started(p)
    state, acts = decide(state, m.Suspects((died(state, 2, error("boom at 7", step=7, phase=ProgramPhase.STEP)),)),
                         1.0, p)
    assert state.recovery.level == "online" and state.phase is JobPhase.RECOVERING  # one rank: could be anything
    state, _ = decide(state, m.Published(1, 1.1), 1.1, p)
    state, _ = finish_recovery(state, p)
    again = error("boom at 7", step=7, phase=ProgramPhase.STEP, generation=1)
    state, acts = decide(state, m.Suspects((died(state, 2, again),)), 4.0, p)
    no_node_taken(acts)
    assert acts[-1].code == EXIT_FAILED and "at the same point (step 7, step) after recovery 1" in acts[-1].error
    assert state.fault_retries_used == 1  # the budget was not spent down before it stopped


def test_one_ranks_error_on_a_node_that_fails_its_health_check_is_a_node_fault():
    """The health check drained the node: node-level evidence, whatever the rank said."""
    p = policy()
    state, _ = started(p)
    state, acts = decide(state, m.Suspects((died(state, 1, error("CUDA error: an illegal memory access"),
                                                 node_state="MIXED+DRAIN"),)), 1.0, p)
    assert of(acts, m.Isolate)[0].node == "n3" and state.recovery.level == "node-replacement"
    assert of(acts, m.Publish)[0].plan.table.slots[1].node == "n5" and acts[-1:] != [m.Exit(EXIT_FAILED)]


def test_different_errors_on_different_nodes_are_not_a_verdict():
    p = policy()
    state, _ = started(p)
    state, _ = decide(state, m.Suspects((died(state, 0, error("a")),)), 1.0, p)
    state, acts = decide(state, m.Suspects((died(state, 1, error("b", kind=ValueError)),)), 1.1, p)
    assert not [a for a in acts if isinstance(a, m.Exit)] and state.phase is not JobPhase.FAILED


def test_past_the_budget_a_death_on_a_healthy_node_fails_without_taking_the_node():
    p = policy(fault_retry_times=1, max_requeues=0)
    state, _ = started(p)
    state, _ = decide(state, m.Suspects((died(state, 0, None),)), 1.0, p)
    state, _ = decide(state, m.Published(1, 1.0), 1.0, p)
    state, _ = finish_recovery(state, p)
    state, acts = decide(state, m.Suspects((died(state, 1, None),)), 4.0, p)  # another node's rank
    no_node_taken(acts)
    assert acts[-1].code == EXIT_FAILED and "never costs its node" in acts[-1].error


def test_the_failure_and_the_errors_survive_a_state_round_trip():
    from slurm_resilience.supervisor.decide.state import SupervisorState
    p = policy()
    state, _ = started(p)
    state, _ = decide(state, m.Suspects(tuple(died(state, r, error()) for r in range(3))), 1.1, p)
    back = SupervisorState.from_dict(state.to_dict())
    assert back.errors == state.errors and back.failure == state.failure
    assert back.process_failures == {"n2": 1, "n3": 1, "n4": 1}


def test_the_signature_ignores_numbers_and_addresses_but_not_the_words():
    assert signature_digest("RuntimeError", "rank 3 at 0x7f00ab failed") == \
        signature_digest("RuntimeError", "rank 12 at 0x55aa01 failed")
    assert signature_digest("RuntimeError", "rank 3 failed") != signature_digest("ValueError", "rank 3 failed")
    assert signature_digest("RuntimeError", "a failed") != signature_digest("RuntimeError", "b failed")


def test_a_record_round_trips_and_keeps_the_innermost_frames():
    def deep(n):
        if n == 0:
            raise KeyError("missing")
        deep(n - 1)
    try:
        deep(30)
    except KeyError as e:
        rec = from_exception(e, e.__traceback__, phase=ProgramPhase.STEP, step=3, generation=2)
    assert len(rec.traceback) <= 12 and rec.traceback[0].startswith("Traceback") and "KeyError" in rec.traceback[-1]
    assert ProgramError.from_json(rec.to_json()) == rec and rec.signature == (rec.type, rec.digest)


def test_node_suspect_needs_repeated_failures_on_that_node_only():
    assert blame.node_suspect({"n2": 2}, "n2")
    assert not blame.node_suspect({"n2": 1}, "n2")
    assert not blame.node_suspect({"n2": 3, "n3": 1}, "n2")
