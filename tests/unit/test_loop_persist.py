"""loop.run persists a changed state before the decision's actions, except a decision that
publishes a plan: its O(N) save follows the plan (a re-attach adopts a newer plan)."""

import dataclasses

from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.executors import loop


@dataclasses.dataclass(frozen=True)
class S:
    n: int


class Recorder:
    HANDLES = frozenset({m.Publish, m.Say, m.Exit})

    def __init__(self):
        self.order = []

    def observe(self, state):
        raise AssertionError("every observation is given up front")

    def changed(self, state):
        self.order.append(("saved", state.n))

    def execute(self, state, action):
        self.order.append((type(action).__name__, state.n))
        return []


def test_a_publishing_decision_saves_after_its_actions_and_others_before(monkeypatch):
    plan, s2 = object(), S(2)
    script = iter([
        (S(1), [m.Say("x")]),  # an ordinary change: saved first
        (s2, [m.Publish(plan, recovery=True), m.Say("y")]),  # the recovery's plan: saved after
        (s2, [m.Say("z")]),  # the same state: nothing saved
        (S(3), [m.Publish(plan), m.Exit(0)]),  # published and exited: still saved, after
    ])
    monkeypatch.setattr(loop, "decide", lambda state, obs, now, policy: next(script))
    rec = Recorder()
    code, final = loop.run(rec, S(0), policy=None, first=[m.Tick()] * 4)
    assert code == 0 and final == S(3)
    assert rec.order == [("saved", 1), ("Say", 1), ("Publish", 2), ("Say", 2), ("saved", 2), ("Say", 2),
                         ("Publish", 3), ("Exit", 3), ("saved", 3)]
