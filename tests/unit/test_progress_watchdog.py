"""The step-progress watchdog (supervisor/observe/watchdog.py) is pure: every row of its table,
the cross-rank culprit rule, derived timeouts, and what decide() makes of a verdict."""

import pytest

from slurm_resilience.model import FaultKind
from slurm_resilience.protocol import EventKind
from slurm_resilience.supervisor.decide import messages as m
from slurm_resilience.supervisor.decide.decide import decide
from slurm_resilience.supervisor.observe.detect import Pulse
from slurm_resilience.supervisor.observe.watchdog import (
    ProgressWatch, Signs, Timeouts, Verdict, assess, derive_timeouts, progress_in,
)

from test_decide import kinds, of, policy, started, suspect

T = Timeouts(stale_s=2.0, soft_s=10.0, hard_s=20.0)


def verdict(**kw):
    return assess({"w": Signs(**kw)}, T)["w"][0]


@pytest.mark.parametrize("signs, expected", [
    (dict(hb_age=0.3, pulse_age=0.2, state="S", stalled_s=1.0), Verdict.OK),
    (dict(hb_age=3.0, pulse_age=0.2, state="T", stalled_s=3.0), Verdict.HUNG),  # SIGSTOPped: state says so
    (dict(hb_age=1.0, pulse_age=0.2, state="T", stalled_s=1.0), Verdict.OK),  # stopped a moment, beat fresh
    (dict(hb_age=0.3, pulse_age=0.2, state="S", stalled_s=25.0), Verdict.HUNG),  # main thread stuck, beats on
    (dict(hb_age=0.3, pulse_age=0.2, state="S", stalled_s=12.0), Verdict.SLOW),
    (dict(hb_age=0.3, pulse_age=0.2, state="S", stalled_s=12.0, waiting=True), Verdict.WAITING),
    (dict(hb_age=3.5, pulse_age=0.2, state="S", stalled_s=3.5), Verdict.SUSPECT),  # GIL held 3.5 s
    (dict(hb_age=3.5, pulse_age=0.2, state="R", stalled_s=3.5), Verdict.SUSPECT),  # starved of CPU
    (dict(hb_age=3.0, pulse_age=3.0, state="S"), Verdict.SILENT),  # nothing at all: a frozen node
    (dict(hb_age=3.0), Verdict.SILENT),  # no pulse process: the old heartbeat rule
    (dict(hb_age=0.3, pulse_age=5.0, state="S"), Verdict.SUSPECT),  # the pulse died, the rank beats
    (dict(hb_age=0.3), Verdict.OK),
])
def test_each_row_of_the_table(signs, expected):
    assert verdict(**signs) is expected


def test_a_stale_heartbeat_alone_is_never_acted_on():
    v, why = assess({"w": Signs(hb_age=8.0, pulse_age=0.1, state="R", stalled_s=8.0)}, T)["w"]
    assert v is Verdict.SUSPECT and "heartbeat stale for 8.0 s" in why and "pulse fresh" in why


def test_the_culprit_is_the_rank_not_waiting_on_its_peers():
    signs = {"a": Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=25, waiting=True),
             "b": Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=25, waiting=False),
             "c": Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=25, waiting=True)}
    got = assess(signs, T)
    assert {w: v for w, (v, _) in got.items()} == {"a": Verdict.WAITING, "b": Verdict.HUNG, "c": Verdict.WAITING}
    assert "while not waiting on its peers" in got["b"][1]


def test_a_collective_stuck_on_every_rank_makes_them_all_hung():
    signs = {w: Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=25, waiting=True) for w in "ab"}
    got = assess(signs, T)
    assert all(v is Verdict.HUNG and "all waiting" in why for v, why in got.values())


def test_timeouts_grow_with_the_measured_step_time():
    assert derive_timeouts([], stale_s=2, soft_s=10, hard_s=20, factor=10) == Timeouts(2, 10, 20)
    assert derive_timeouts([0.1, 0.3], stale_s=2, soft_s=10, hard_s=20, factor=10) == Timeouts(2, 10, 20)
    assert derive_timeouts([0.5, 4.0], stale_s=2, soft_s=10, hard_s=20, factor=10) == Timeouts(2, 20, 40)


def _pulse(t, progress, step=0, state="S", waiting=False):
    return Pulse(t=t, progress=progress, waiting=waiting, step=step, state=state, cpu=0)


def test_watch_gil_hold_is_a_suspect_that_clears_without_a_fault():
    w = ProgressWatch(stale_s=2, soft_s=10, hard_s=20, factor=10)
    assert w.observe({"r0": 0.0}, {"r0": _pulse(0.0, 1)}, 0.0) == []
    # the main thread holds the GIL from t=0: no beat, no progress; the pulse goes on
    changes = w.observe({"r0": 0.0}, {"r0": _pulse(3.0, 1)}, 3.0)
    assert [(c[1], c[2]) for c in changes] == [(Verdict.OK, Verdict.SUSPECT)]
    changes = w.observe({"r0": 3.3}, {"r0": _pulse(3.3, 2, step=1)}, 3.4)  # released: beat and step
    assert [(c[1], c[2]) for c in changes] == [(Verdict.SUSPECT, Verdict.OK)]


def test_watch_a_blocked_main_thread_is_hung_after_the_hard_timeout():
    w = ProgressWatch(stale_s=2, soft_s=4, hard_s=8, factor=10)
    seen = []
    for i in range(0, 100):  # the heartbeat thread beats on; progress stops at t=1
        t = i * 0.25
        seen += [c[2] for c in w.observe({"r0": t, "r1": t},
                                         {"r0": _pulse(t, min(i, 4), step=min(i, 4)),
                                          "r1": _pulse(t, min(i, 4), step=min(i, 4), waiting=i >= 4)}, t)]
        if w.verdicts["r0"][0] is Verdict.HUNG:
            break
    assert Verdict.SLOW in seen and w.verdicts["r0"][0] is Verdict.HUNG
    assert 1.0 + 8 < t <= 1.0 + 8.5  # hard floor: step times (0.25 s) x 10 stay below it
    assert w.verdicts["r1"][0] is Verdict.WAITING  # its peer, waiting in the collective


def test_watch_a_recovery_in_flight_restarts_the_progress_clocks():
    w = ProgressWatch(stale_s=2, soft_s=4, hard_s=8, factor=10)
    w.observe({"r0": 0.0}, {"r0": _pulse(0.0, 1)}, 0.0)
    for t in (3.0, 6.0, 9.0):
        w.observe({"r0": t}, {"r0": _pulse(t, 1)}, t, paused=True)
    assert w.verdicts["r0"][0] is Verdict.OK
    assert w.timeouts().hard_s == 8  # a recovery's pause is not a step time


def test_decide_reports_a_suspect_and_never_recovers_it():
    p = policy()
    state, _ = started(p)
    wid = state.table.slots[1].worker_id
    new, acts = decide(state, m.LivenessChange(wid, Verdict.OK, Verdict.SUSPECT, "heartbeat stale for 3.0 s", 5.0), 5.0, p)
    assert new == state and kinds(acts) == [EventKind.SUSPECT]
    assert not of(acts, m.Kill) and not of(acts, m.Publish)
    assert of(acts, m.Emit)[0].fields["rank"] == 1 and "heartbeat stale" in of(acts, m.Emit)[0].fields["evidence"]
    assert of(acts, m.Emit)[0].fields["previous"] == "ok" and of(acts, m.Say)[0].text.startswith("rank 1 suspect: ")
    _, acts = decide(state, m.LivenessChange(wid, Verdict.SUSPECT, Verdict.OK, "", 6.0), 6.0, p)
    assert kinds(acts) == [EventKind.SUSPECT_CLEARED]
    assert of(acts, m.Emit)[0].fields["previous"] == "suspect" and "(was suspect)" in of(acts, m.Say)[0].text
    _, acts = decide(state, m.LivenessChange(wid, Verdict.OK, Verdict.SLOW, "no progress for 11 s", 6.0), 6.0, p)
    assert kinds(acts) == [EventKind.PROGRESS_SLOW]


def test_decide_recovers_a_confirmed_hang_with_the_watchdogs_evidence():
    p = policy()
    state, _ = started(p)
    why = "no progress for 21.0 s (hard timeout 20.0 s) while not waiting on its peers (state S)"
    state, acts = decide(state, suspect(state, 2, heartbeat_stale=True, slurmd_reachable=True, still_running=True,
                                        evidence=why), 30.0, p)
    fault = of(acts, m.Emit)[0].fields["fault"]
    assert fault["kind"] == FaultKind.PROCESS_HUNG.value and fault["detail"].startswith(why)
    assert of(acts, m.Kill) and state.recovery.level == "online"


def test_checkpoint_io_is_never_a_hang_only_slow():
    busy = dict(hb_age=0.3, pulse_age=0.2, state="D", busy=True)
    assert verdict(stalled_s=5.0, **busy) is Verdict.OK
    assert verdict(stalled_s=12.0, **busy) is Verdict.SLOW
    assert verdict(stalled_s=500.0, **busy) is Verdict.SLOW
    signs = {w: Signs(stalled_s=500.0, **busy) for w in "ab"}  # a long final save on every rank
    assert {v for v, _ in assess(signs, T).values()} == {Verdict.SLOW}
    assert verdict(hb_age=3.0, pulse_age=0.2, state="T", busy=True, stalled_s=3.0) is Verdict.HUNG  # stopped


def test_a_frozen_node_is_silent_as_soon_as_its_heartbeat_is_stale():
    t = Timeouts(stale_s=2.0, soft_s=10.0, hard_s=20.0, pulse_s=1.0)
    # both stopped together at the freeze: the last pulse is as old as the last beat
    got = assess({"w": Signs(hb_age=2.05, pulse_age=2.0, state="S", stalled_s=2.0)}, t)["w"]
    assert got[0] is Verdict.SILENT
    # a starved heartbeat thread: the pulse (its own process) is recent
    assert assess({"w": Signs(hb_age=2.05, pulse_age=0.3, state="R", stalled_s=2.0)}, t)["w"][0] is Verdict.SUSPECT
    # a pulse a little late with a fresh heartbeat is nothing
    assert assess({"w": Signs(hb_age=0.2, pulse_age=1.5, state="S")}, t)["w"][0] is Verdict.OK


def test_peers_past_the_timeout_wait_for_a_culprit_that_moved_last():
    """The blocked rank completed its last step after its peers entered the next collective
    (a loaded box): they cross the hard timeout first, and must not be taken for it."""
    signs = {"a": Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=21, waiting=True),
             "b": Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=19.8, waiting=False),
             "c": Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=21, waiting=True)}
    got = {w: v for w, (v, _) in assess(signs, T).items()}
    assert got == {"a": Verdict.WAITING, "b": Verdict.SLOW, "c": Verdict.WAITING}
    signs["b"] = Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=20.1, waiting=False)
    got = {w: v for w, (v, _) in assess(signs, T).items()}
    assert got == {"a": Verdict.WAITING, "b": Verdict.HUNG, "c": Verdict.WAITING}


# -- the job blocked on one rank: a shorter, evidence-based timeout (rule 3) -------------------

TB = Timeouts(stale_s=2.0, soft_s=10.0, hard_s=20.0, pulse_s=1.0, block_s=5.0)


def _rank(stalled, waiting=False, **kw):
    return Signs(**{"hb_age": 0.2, "pulse_age": 0.1, "state": "S", "stalled_s": stalled, "waiting": waiting,
                    "stepped": True, **kw})


def _verdicts(signs, t=TB):
    return {w: v for w, (v, _) in assess(signs, t).items()}


def test_a_rank_every_other_rank_waits_on_is_hung_after_the_blocking_timeout():
    signs = {"a": _rank(5.5, waiting=True), "b": _rank(5.2), "c": _rank(0.3, waiting=True)}
    got = assess(signs, TB)
    assert got["b"][0] is Verdict.HUNG and {got["a"][0], got["c"][0]} == {Verdict.OK}
    assert "blocking timeout 5.0 s" in got["b"][1] and "every other rank waits on its peers (state S)" in got["b"][1]
    signs["b"] = _rank(4.9)  # not yet
    assert _verdicts(signs)["b"] is Verdict.OK
    assert _verdicts(signs | {"b": _rank(5.2)}, T)["b"] is Verdict.OK  # no block_s: the hard timeout only


@pytest.mark.parametrize("peer, why", [
    (_rank(0.5), "a peer computes: the job moves"),
    (_rank(6.0, busy=True), "a peer in checkpoint I/O"),
    (Signs(hb_age=0.2), "a peer whose progress is not seen: no evidence"),
    (Signs(hb_age=0.2, pulse_age=1.5, state="S", stalled_s=6.0, waiting=True), "a peer's pulse is not fresh"),
])
def test_no_blocking_verdict_without_evidence_that_every_other_rank_waits(peer, why):
    signs = {"a": _rank(6.0, waiting=True), "b": _rank(6.0), "c": peer}
    assert _verdicts(signs)["b"] is Verdict.OK, why


def test_the_blocking_rule_needs_a_completed_step_and_a_waiting_peer():
    signs = {"a": _rank(6.0, waiting=True), "b": _rank(6.0, stepped=False)}  # its first step: compiling, loading
    assert _verdicts(signs)["b"] is Verdict.OK
    assert _verdicts({"b": _rank(6.0)})["b"] is Verdict.OK  # alone: nobody is blocked on it
    assert _verdicts({"a": _rank(6.0), "b": _rank(6.0)}) == {"a": Verdict.OK, "b": Verdict.OK}  # nobody waits
    # two ranks stuck while the third waits on both: both block the job
    three = {"a": _rank(6.0), "b": _rank(6.0), "c": _rank(6.0, waiting=True)}
    assert _verdicts(three) == {"a": Verdict.HUNG, "b": Verdict.HUNG, "c": Verdict.OK}


def test_a_gil_hold_shorter_than_the_blocking_timeout_is_only_a_suspect():
    # the holder's heartbeat is stale, its pulse fresh; its peers wait in the collective
    signs = {"a": _rank(3.4, waiting=True), "b": _rank(3.4, hb_age=3.3), "c": _rank(3.4, waiting=True)}
    assert _verdicts(signs) == {"a": Verdict.OK, "b": Verdict.SUSPECT, "c": Verdict.OK}


def test_the_blocking_timeout_grows_with_the_step_time_and_stays_below_the_hard_one():
    assert derive_timeouts([], stale_s=2, soft_s=10, hard_s=20, factor=10, block_s=5).blocking_s == 5
    assert derive_timeouts([0.3], stale_s=2, soft_s=10, hard_s=20, factor=10, block_s=5).blocking_s == 5
    assert derive_timeouts([2.0], stale_s=2, soft_s=10, hard_s=20, factor=10, block_s=5).blocking_s == 10
    assert derive_timeouts([2.0], stale_s=2, soft_s=10, hard_s=20, factor=10, block_s=25).blocking_s == 20
    assert derive_timeouts([2.0], stale_s=2, soft_s=10, hard_s=20, factor=10).blocking_s == 20  # off


def test_watch_a_blocked_main_thread_is_hung_after_the_blocking_timeout():
    w = ProgressWatch(stale_s=2, soft_s=10, hard_s=20, factor=10, block_s=5, pulse_s=1)
    for i in range(200):  # r1's main thread blocks at t=2 (step 8); its heartbeat beats on
        t = i * 0.25
        n1 = min(i, 8)
        r0 = _pulse(t, i if i < 9 else 9, step=min(i, 8), waiting=i >= 9)  # r0 then waits in the collective
        w.observe({"r0": t, "r1": t}, {"r0": r0, "r1": _pulse(t, n1, step=n1)}, t)
        if w.verdicts["r1"][0] is Verdict.HUNG:
            break
    assert 2.0 + 5 < t <= 2.0 + 5.5 and "blocking timeout" in w.verdicts["r1"][1]
    assert w.verdicts["r0"][0] is Verdict.OK


def test_watch_a_recovery_makes_every_rank_earn_the_blocking_rule_again():
    w = ProgressWatch(stale_s=2, soft_s=10, hard_s=20, factor=10, block_s=5, pulse_s=1)
    w.observe({"r0": 0.0, "r1": 0.0}, {"r0": _pulse(0.0, 1, step=1), "r1": _pulse(0.0, 1, step=1)}, 0.0)
    w.observe({"r0": 0.5, "r1": 0.5}, {"r0": _pulse(0.5, 2, step=2), "r1": _pulse(0.5, 2, step=2)}, 0.5)
    w.observe({"r0": 1.0, "r1": 1.0}, {"r0": _pulse(1.0, 3, step=2), "r1": _pulse(1.0, 3, step=2)}, 1.0, paused=True)
    for t in (2.0, 4.0, 6.5):  # after the recovery r1's first step takes long (a rebuild) while r0 waits
        w.observe({"r0": t, "r1": t}, {"r0": _pulse(t, 4, step=2, waiting=True), "r1": _pulse(t, 3, step=2)}, t)
    assert w.verdicts["r1"][0] is Verdict.OK  # the hard timeout still judges it


# -- a rank whose pulse died: the heartbeat carries the progress counter too ---------------------

@pytest.mark.parametrize("signs, expected", [
    (dict(hb_age=0.3, pulse_age=30.0, state="S", hb_progress=True, stalled_s=25.0), Verdict.HUNG),
    (dict(hb_age=0.3, hb_progress=True, stalled_s=25.0), Verdict.HUNG),  # pulse off: the heartbeat's copy
    (dict(hb_age=0.3, pulse_age=30.0, state="S", hb_progress=True, stalled_s=12.0), Verdict.SLOW),
    (dict(hb_age=0.3, pulse_age=30.0, state="S", hb_progress=True, stalled_s=1.0), Verdict.SUSPECT),  # moving
    (dict(hb_age=3.0, pulse_age=30.0, state="S", hb_progress=True, stalled_s=25.0), Verdict.SILENT),  # neither
    (dict(hb_age=0.3, pulse_age=30.0, state="S", stalled_s=25.0), Verdict.SUSPECT),  # an old rank: no copy
])
def test_progress_seen_in_the_heartbeat_when_the_pulse_is_gone(signs, expected):
    assert verdict(**signs) is expected


def test_a_dead_pulse_and_a_stuck_main_thread_are_found_by_the_heartbeat_copy():
    v, why = assess({"w": Signs(hb_age=0.3, pulse_age=30.0, state="S", hb_progress=True, stalled_s=25.0)}, T)["w"]
    assert v is Verdict.HUNG and "progress from its heartbeat; pulse silent for 30.0 s" in why
    peers = {"a": Signs(hb_age=0.2, pulse_age=0.1, state="S", stalled_s=6.0, waiting=True, stepped=True),
             "b": Signs(hb_age=0.2, pulse_age=9.0, state="S", stalled_s=6.0, hb_progress=True, stepped=True)}
    got = assess(peers, TB)
    assert got["b"][0] is Verdict.HUNG and "blocking timeout" in got["b"][1] and "heartbeat" in got["b"][1]


def test_watch_the_pulse_dies_then_the_main_thread_blocks():
    w = ProgressWatch(stale_s=2, soft_s=10, hard_s=20, factor=10, block_s=5, pulse_s=1)
    for i in range(400):  # r1's pulse dies at t=1; its main thread blocks at t=2; its heartbeat beats on
        t = i * 0.25
        n1 = min(i, 8)
        pulses = {"r0": _pulse(t, min(i, 9), step=min(i, 8), waiting=i >= 9), "r1": _pulse(min(t, 1.0), min(i, 4))}
        w.observe({"r0": t, "r1": t}, pulses, t, hb_progress={"r0": (min(i, 9), int(i >= 9), min(i, 8)),
                                                              "r1": (n1, 0, n1)})
        if w.verdicts["r1"][0] is Verdict.HUNG:
            break
    assert 2.0 + 5 < t <= 2.0 + 5.5, t  # the blocking timeout, not the peers' pg_timeout_s
    assert "pulse silent" in w.verdicts["r1"][1]


def test_watch_a_late_pulse_line_never_lengthens_the_evidence():
    w = ProgressWatch(stale_s=2, soft_s=4, hard_s=8, factor=10, pulse_s=1)
    w.observe({"r0": 0.0}, {"r0": _pulse(0.0, 1)}, 0.0)
    w.observe({"r0": 7.0}, {"r0": _pulse(7.0, 1)}, 7.0)
    w.observe({"r0": 8.9}, {"r0": _pulse(7.9, 1)}, 8.9)  # now - first sight is 8.9 s, the reports span 7.9 s
    assert w.verdicts["r0"][0] is Verdict.SLOW


def test_a_heartbeat_carries_progress_or_says_nothing():
    assert progress_in({"t": 1.0, "step": 3, "progress": 41, "phase": 1}) == (41, 1, 3)
    assert progress_in({"t": 1.0, "step": 3}) is None  # an older rank
    assert progress_in(None) is None
    assert progress_in({"t": 1.0, "step": "x", "progress": 41, "phase": 1}) is None


def test_leaving_the_plainly_ok_ranks_out_of_the_assessment_changes_no_verdict():
    """The watch leaves ranks with fresh signs and a stall within every timeout's floor out
    of assess() and counts them (Quiet): every verdict is what assessing all of them gives."""
    import random

    for seed in range(300):
        _same_verdicts_with_the_quiet_left_out(random.Random(seed))


def _same_verdicts_with_the_quiet_left_out(rnd):
    from slurm_resilience.supervisor.observe.watchdog import Quiet

    t = Timeouts(stale_s=2.0, soft_s=rnd.choice([3.0, 10.0]), hard_s=20.0, pulse_s=rnd.choice([None, 1.0]),
                 block_s=rnd.choice([None, 2.5, 5.0]))
    calm = min(t.soft_s, t.hard_s, t.blocking_s)  # the floors: these timeouts derived from no step time
    signs = {}
    for i in range(rnd.randint(1, 7)):
        pulse = rnd.random() < 0.8
        signs[f"r{i}"] = Signs(hb_age=rnd.choice([0.2, 1.5, 3.0]),
                               pulse_age=rnd.choice([0.1, 1.5, 3.0]) if pulse else None,
                               state=rnd.choice("SRT") if pulse else None, waiting=rnd.random() < 0.5,
                               busy=rnd.random() < 0.1, stalled_s=rnd.choice([0.3, 2.0, 4.0, 6.0, 12.0, 25.0]),
                               hb_progress=rnd.random() < 0.5, stepped=rnd.random() < 0.8)
    everything = assess(signs, t)
    rest, seen, free, waiting = {}, 0, 0, 0
    for w, s in signs.items():  # the test of ProgressWatch.observe
        if (s.hb_age <= t.stale_s and not s.busy and s.stalled_s <= calm
                and (s.pulse_age is None or s.pulse_age <= t.stale_s)):
            if s.hb_progress or (s.pulse_age is not None and s.pulse_age <= t.vouch_s):
                seen, waiting, free = seen + 1, waiting + s.waiting, free + (not s.waiting)
            else:
                free += 1
            assert everything[w][0] is Verdict.OK
        else:
            rest[w] = s
    assert assess(rest, t, Quiet(seen, free, waiting)) == {w: everything[w] for w in rest}


def test_the_watch_reports_a_flagged_rank_that_turned_plainly_ok_and_flags_only_the_others():
    w = ProgressWatch(stale_s=2, soft_s=10, hard_s=20, factor=10)
    w.observe({"r0": 0.0, "r1": 0.0}, {"r0": _pulse(0.0, 1), "r1": _pulse(0.0, 1)}, 0.0)
    changes = w.observe({"r0": 0.0, "r1": 3.0}, {"r0": _pulse(3.0, 1), "r1": _pulse(3.0, 2, step=1)}, 3.0)
    assert [(c[0], c[2]) for c in changes] == [("r0", Verdict.SUSPECT)] and set(w.flagged()) == {"r0"}
    changes = w.observe({"r0": 3.3, "r1": 3.3}, {"r0": _pulse(3.3, 2, step=1), "r1": _pulse(3.3, 3, step=2)}, 3.4)
    assert [(c[0], c[1], c[2]) for c in changes] == [("r0", Verdict.SUSPECT, Verdict.OK)]
    assert w.flagged() == {} and w.verdicts == {"r0": (Verdict.OK, ""), "r1": (Verdict.OK, "")}
