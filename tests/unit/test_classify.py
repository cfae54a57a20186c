import itertools

import pytest

from slurm_resilience.errors import RecoveryError
from slurm_resilience.model import FaultKind
from slurm_resilience.supervisor.decide.classify import classify_fault, is_node_fault

L, U, D, H = FaultKind.NODE_LOST, FaultKind.NODE_UNHEALTHY, FaultKind.PROCESS_DIED, FaultKind.PROCESS_HUNG
BAD_STATES = ["DOWN", "DOWN*", "IDLE+DRAIN", "ALLOCATED+DRAIN", "MIXED*", "FAIL", "IDLE+NOT_RESPONDING", "ALLOCATED+FAILING"]
OK_STATES = [None, "", "IDLE", "ALLOCATED", "MIXED", "COMPLETING"]


def expected(exited, reachable, stale, state):
    if state in BAD_STATES:
        return L if reachable is False else U
    if reachable is False:
        return L
    if exited:
        return D
    if stale:
        return H
    return None


CASES = list(itertools.product([False, True], [None, False, True], [False, True], BAD_STATES + OK_STATES))


@pytest.mark.parametrize("exited,reachable,stale,state", CASES)
def test_classify_table(exited, reachable, stale, state):
    kw = dict(rank=3, node="n4", process_exited=exited, slurmd_reachable=reachable,
              heartbeat_stale=stale, slurm_node_state=state, now=12.5)
    want = expected(exited, reachable, stale, state)
    if want is None:
        with pytest.raises(RecoveryError):
            classify_fault(**kw)
        return
    f = classify_fault(**kw)
    assert f.kind is want
    assert (f.rank, f.node, f.time) == (3, "n4", 12.5)
    assert f.detail and "\n" not in f.detail


def test_details_say_why():
    f = classify_fault(rank=None, node="n1", process_exited=False, slurmd_reachable=True,
                       heartbeat_stale=False, slurm_node_state="IDLE+DRAIN", now=0)
    assert "DRAIN" in f.detail and f.rank is None
    f = classify_fault(rank=0, node="n1", process_exited=True, slurmd_reachable=None,
                       heartbeat_stale=False, slurm_node_state=None, now=0)
    assert "not probed" in f.detail
    f = classify_fault(rank=0, node="n1", process_exited=False, slurmd_reachable=False,
                       heartbeat_stale=True, slurm_node_state=None, now=0)
    assert "unreachable" in f.detail


def test_is_node_fault():
    assert is_node_fault(L) and is_node_fault(U)
    assert not is_node_fault(D) and not is_node_fault(H)
