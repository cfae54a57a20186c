"""Isolation without operator rights: the state table, the Isolator's reports and
hook, operator detection from recorded ``scontrol show config`` text, and the
requeue that excludes isolated nodes (argv sequences through a fake ``run``)."""

import subprocess
import sys

import pytest

from slurm_resilience.config import RecoveryConfig
from slurm_resilience.errors import SlurmCommandError
from slurm_resilience.protocol import EventKind
from slurm_resilience.slurm import commands
from slurm_resilience.slurm.rights import operator_verdict, parse_show_config, slurm_user_id
from slurm_resilience.slurm.steps import SrunLauncher
from slurm_resilience.supervisor.adapters.isolate import Isolator, node_state_for

CONFIG = """Configuration data as of 2026-11-26T07:47:37
AccountingStorageType   = accounting_storage/none
SlurmUser               = slurm(64030)
SlurmctldPort           = 6817
"""


@pytest.mark.parametrize("configured,requested,operator,want", [
    ("none", "none", True, "none"), ("none", "DRAIN", True, "none"),
    ("auto", "auto", True, "DOWN"), ("auto", "DRAIN", True, "DRAIN"), ("auto", "auto", False, "none"),
    ("auto", "DRAIN", False, "none"), ("DOWN", "DOWN", False, "DOWN"), ("DRAIN", "DRAIN", True, "DRAIN"),
    ("DOWN", "DRAIN", True, "DRAIN"),  # a straggler is drained, not downed
])
def test_node_state_for(configured, requested, operator, want):
    assert node_state_for(configured, requested, operator) == want


def test_operator_verdict_from_recorded_config():
    cfg = parse_show_config(CONFIG)
    assert slurm_user_id(cfg) == ("slurm", 64030)
    assert operator_verdict(uid=0, user="root", config=cfg, admin_level=None)[0]
    assert operator_verdict(uid=64030, user="slurm", config=cfg, admin_level=None)[0]
    assert operator_verdict(uid=1000, user="ann", config=cfg, admin_level="Operator")[0]
    ok, why = operator_verdict(uid=1000, user="ann", config=cfg, admin_level="None")
    assert not ok and "ann" in why and "SlurmUser slurm" in why
    assert not operator_verdict(uid=1000, user="ann", config={}, admin_level=None)[0]


class FakeLauncher:
    def __init__(self, operator=False, fail=None):
        self.operator, self.fail, self.calls, self.remembered = operator, fail, [], []

    def exclude_at_requeue(self, node):
        self.remembered.append(node)

    def may_set_node_state(self):
        if isinstance(self.operator, Exception):
            raise self.operator
        return self.operator, "test"

    def isolate(self, node, state, reason):
        self.calls.append((node, state, reason))
        if self.fail:
            raise self.fail
        return {"released": state == "none"}


def _run(launcher, **cfg):
    events, said = [], []
    iso = Isolator(launcher, lambda kind, **f: events.append((kind, f)), RecoveryConfig(**cfg),
                   job_id="42", say=said.append)
    iso.start("n3", "auto", "node_lost")
    iso.join()
    return events, said


def test_auto_without_rights_releases_and_reports():
    launcher = FakeLauncher(operator=False)
    events, said = _run(launcher)
    assert launcher.remembered == ["n3"] and launcher.calls == [("n3", "none", "node_lost")]
    (kind, f), = events
    assert kind is EventKind.ISOLATED and f["state"] == "none" and f["released"]
    assert "n3" in said[0] and "released" in said[0]


def test_auto_with_rights_marks_down_and_unknown_rights_do_not():
    launcher = FakeLauncher(operator=True)
    _run(launcher)
    assert launcher.calls == [("n3", "DOWN", "node_lost")]
    launcher = FakeLauncher(operator=SlurmCommandError(["scontrol"], 1, "down"))
    events, _ = _run(launcher)
    assert launcher.calls == [("n3", "none", "node_lost")] and "unknown" in events[0][1]["rights"]


def test_refused_isolation_is_an_event_and_the_hook_still_runs(tmp_path):
    out = tmp_path / "hook.txt"
    hook = [sys.executable, "-c", f"import sys; open({str(out)!r}, 'w').write(' '.join(sys.argv[1:]))"]
    launcher = FakeLauncher(fail=SlurmCommandError(["scontrol"], 1, "Invalid user id"))
    events, said = _run(launcher, isolate_state="DOWN", isolate_hook=tuple(hook))
    assert [k for k, _ in events] == [EventKind.ISOLATE_FAILED, EventKind.ISOLATE_HOOK]
    assert "Invalid user id" in events[0][1]["error"] and events[1][1]["ok"]
    assert out.read_text() == "n3 node_lost 42"


@pytest.mark.parametrize("hook,timeout,want", [  # a time-out long enough for an interpreter on a loaded box
    ((sys.executable, "-c", "import sys; sys.exit('no ticket system')"), 60.0, "exit code 1: no ticket system"),
    (("/nonexistent/ticket",), 60.0, "cannot run /nonexistent/ticket"),
    ((sys.executable, "-c", "import time; time.sleep(30)"), 0.2, "timed out after 0.2s"),
])
def test_hook_failure_is_an_event_not_fatal(hook, timeout, want):
    events, said = _run(FakeLauncher(), isolate_state="none", isolate_hook=hook, isolate_hook_timeout_s=timeout)
    kind, f = events[-1]
    assert kind is EventKind.ISOLATE_HOOK and not f["ok"] and want in f["error"]
    assert want in said[-1]


class FakeScontrol:
    def __init__(self, monkeypatch, job, accounting="accounting_storage/slurmdbd"):
        self.job, self.calls, self.accounting = job, [], accounting
        monkeypatch.setattr(commands, "run", self.run)
        monkeypatch.setattr(commands, "show_nodes", lambda names: {n: {"NodeName": n} for n in names})

    def run(self, argv, **kw):
        self.calls.append(list(argv))
        if argv[:4] == ["scontrol", "-o", "show", "job"]:
            fields = " ".join(f"{k}={v}" for k, v in self.job.items())
            return subprocess.CompletedProcess(argv, 0, fields + "\n", "")
        if argv == ["scontrol", "show", "config"]:
            return subprocess.CompletedProcess(argv, 0, CONFIG.replace("accounting_storage/none", self.accounting), "")
        if argv[:2] == ["scontrol", "update"] and any(a.startswith("NodeList=") for a in argv):
            self.job["NodeList"] = argv[-1].split("=", 1)[1]
        return subprocess.CompletedProcess(argv, 0, "", "")


def test_isolate_none_releases_and_requeue_excludes(monkeypatch):
    fake = FakeScontrol(monkeypatch, {"JobId": "42", "NodeList": "n[1-5]", "BatchHost": "n1",
                                      "ExcNodeList": "n9"})
    launcher = SrunLauncher("42", ["n2", "n3", "n4", "n5"])
    done = launcher.isolate("n3", "none", "node_lost")
    assert done["released"] and done["state"] == "none"
    assert ["scontrol", "update", "JobId=42", "NodeList=n[1-2,4-5]"] in fake.calls
    assert not any("nodename=" in " ".join(c) for c in fake.calls)
    fake.calls.clear()
    launcher.requeue()
    assert fake.calls[1:] == [["scontrol", "requeue", "42"],
                              ["scontrol", "update", "JobId=42", "ExcNodeList=n[3,9]"]]


def test_requeue_without_isolated_nodes_is_plain(monkeypatch):
    fake = FakeScontrol(monkeypatch, {"JobId": "42", "NodeList": "n[1-5]"})
    SrunLauncher("42", ["n2"]).requeue()
    assert fake.calls == [["scontrol", "requeue", "42"]]


def test_a_failed_exclusion_is_reported_not_raised(monkeypatch):
    fake = FakeScontrol(monkeypatch, {"JobId": "42", "NodeList": "n[1-5]"})
    real = fake.run

    def run(argv, **kw):
        if argv[:2] == ["scontrol", "update"]:
            fake.calls.append(list(argv))
            raise SlurmCommandError(argv, 1, "Job is no longer pending execution")
        return real(argv, **kw)

    monkeypatch.setattr(commands, "run", run)
    problem = commands.requeue_excluding("42", ["n3"])
    assert "excluding n3 failed" in problem and "no longer pending" in problem
    assert ["scontrol", "requeue", "42"] in fake.calls


def test_without_slurmdbd_the_node_stays_in_the_job_but_is_excluded_at_requeue(monkeypatch):
    fake = FakeScontrol(monkeypatch, {"JobId": "42", "NodeList": "n[1-5]", "BatchHost": "n1"},
                        accounting="accounting_storage/none")
    launcher = SrunLauncher("42", ["n2", "n3", "n4", "n5"])
    done = launcher.isolate("n3", "none", "node_lost")
    assert not done["released"] and "no slurmdbd" in done["note"]
    assert not any(a.startswith("NodeList=") for c in fake.calls for a in c)
    launcher.requeue()
    assert fake.calls[-1] == ["scontrol", "update", "JobId=42", "ExcNodeList=n3"]
