"""The in-place MPI path's silent-node watch: beat files, quiet nodes, the probe's verdict."""

import io
import json
import os
import time

import pytest

from slurm_resilience.config import ResilienceConfig
from slurm_resilience.events import EventLog
from slurm_resilience.mpi.beat import Beat, beat_path, quiet_nodes, read_beats
from slurm_resilience.mpi.supervise import UlfmSupervisor


def test_a_node_is_quiet_only_when_every_process_on_it_is():
    node_of = {0: "n1", 1: "n1", 2: "n2", 3: "n2", 4: "n3"}
    beats = {0: 10.0, 1: 7.0, 2: 6.0, 3: 6.5, 4: 9.9, 9: 0.0}  # 9: no start event yet
    assert quiet_nodes(beats, node_of, now=10.0, silence_s=1.0) == ["n2"]
    assert quiet_nodes(beats, node_of, now=12.0, silence_s=1.0) == ["n1", "n2", "n3"]
    assert quiet_nodes({}, node_of, now=100.0, silence_s=1.0) == []  # nothing started: nothing quiet


def test_the_beat_thread_touches_its_file_and_the_reader_finds_it(tmp_path):
    path = beat_path(str(tmp_path), 3)
    (tmp_path / "beat-wx").write_text("")  # not a beat file: ignored
    beat = Beat(path, 0.01)
    try:
        first = os.stat(path).st_mtime
        assert oct(os.stat(path).st_mode & 0o777) == "0o600"
        deadline = time.monotonic() + 10
        while os.stat(path).st_mtime == first and time.monotonic() < deadline:
            time.sleep(0.005)
        assert os.stat(path).st_mtime > first
    finally:
        beat.stop()
    assert set(read_beats(str(tmp_path))) == {3}


class _Launcher:
    def __init__(self, answers):
        self.answers, self.asked = answers, []

    def probe_slurmd(self, node, steps, deadline_s):
        self.asked.append((node, tuple(steps)))
        return self.answers[node], "test answer"

    def node_reachable(self, node, timeout_s):
        return True  # a stopped slurmd's port still takes connections


def _supervisor(tmp_path, answers, now):
    clock = [now]
    sup = UlfmSupervisor(config=ResilienceConfig(), command=["prog"], job_dir=str(tmp_path), prefix="",
                         workers=["n1", "n2"], spares=["n3"], launcher=_Launcher(answers),
                         events=EventLog(str(tmp_path / "events.jsonl")), out=io.StringIO(),
                         settle_s=0.0, clock=lambda: clock[0])
    ev = tmp_path / "ulfm-000"
    ev.mkdir()
    for wid, node in enumerate(["n1", "n2", "n3"]):
        (ev / f"events-w{wid}.jsonl").write_text(json.dumps({"kind": "start", "wid": wid, "node": node}) + "\n")
        Beat(beat_path(str(ev), wid), 0).stop()  # the file, no thread
    sup._forward(0)
    return sup, clock, ev


@pytest.mark.parametrize("answer", [True, None])
def test_a_quiet_node_that_answers_is_left_alone_and_not_asked_again_at_once(tmp_path, answer):
    sup, clock, ev = _supervisor(tmp_path, {"n2": answer}, now=time.time())
    os.utime(ev / "beat-w1", (clock[0] - 5, clock[0] - 5))  # n2 quiet for 5 s
    assert sup._watch(0) is False
    assert sup.launcher.asked == [("n2", ("prted",))]
    assert sup._watch(0) is False and len(sup.launcher.asked) == 1  # asked again only after another silence
    clock[0] += 10
    os.utime(ev / "beat-w0", (clock[0], clock[0]))
    os.utime(ev / "beat-w2", (clock[0], clock[0]))
    assert sup._watch(0) is False and len(sup.launcher.asked) == 2
    assert sup._lost(False) == frozenset()


def test_a_quiet_node_whose_slurmd_is_silent_is_lost_and_logged(tmp_path):
    sup, clock, ev = _supervisor(tmp_path, {"n2": False}, now=time.time())
    os.utime(ev / "beat-w1", (clock[0] - 5, clock[0] - 5))
    assert sup._watch(0) is True
    assert sup._lost(False) == frozenset({"n2"})  # though its port still takes connections
    events = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()]
    silent = [e for e in events if e["kind"] == "ulfm_node_silent"]
    assert len(silent) == 1 and silent[0]["node"] == "n2" and silent[0]["quiet_s"] >= 5
