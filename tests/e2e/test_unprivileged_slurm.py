"""End to end as an ordinary Slurm user (no operator rights): node loss, rank kill,
requeue and preemption, each bit-identical to the fault-free reference.

The jobs are submitted with the credentials of ``srtest`` (created here if missing;
``runuser``), who may not change node states. The fault injector stays root. What
the user needs, set up idempotently below: a readable slurm.conf and a traversable
lab (scripts/local-cluster does that for a lab it writes), an interpreter it may run
(the path to ``sys.executable`` gets o+x where it lacks it — on a CI box the
interpreter lives under /root, mode 0700), and job directories it owns.
"""

import json
import os
import pwd
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from slurm_resilience import lab
from slurm_resilience.events import read_events
from slurm_resilience.slurm import commands
from slurm_resilience.slurm.rights import uses_slurmdbd

from .conftest import FAULT_STEP_TIME, STEPS

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

USER = "srtest"
KILL_AT = 12


def _events(job_dir, kind):
    return [e for e in read_events(str(job_dir / "events.jsonl")) if e["kind"] == kind]


def _traversable(path: Path) -> None:
    """o+x on ``path`` and every directory above it (nothing is made listable)."""
    for d in [path, *path.parents]:
        mode = d.stat().st_mode
        if not mode & stat.S_IXOTH:
            os.chmod(d, stat.S_IMODE(mode) | stat.S_IXOTH)


@pytest.fixture(scope="session")
def ordinary_user(slurm_cluster):
    """``(argv prefix to run as the user, jobs root the user owns)``."""
    if os.getuid() != 0:
        pytest.skip("creating the unprivileged test user needs root")
    try:
        pw = pwd.getpwnam(USER)
    except KeyError:
        subprocess.run(["useradd", "-m", USER], check=True, timeout=30)
        pw = pwd.getpwnam(USER)
    conf = Path(os.environ["SLURM_CONF"])
    _traversable(conf.parent)
    os.chmod(conf, 0o644)
    for sub in ("var", "var/spool", "var/tmp"):
        if (Path(slurm_cluster) / sub).is_dir():
            _traversable(Path(slurm_cluster) / sub)
    _traversable(Path(os.path.realpath(sys.executable)).parent)
    _traversable(lab.REPO)
    root = Path(tempfile.mkdtemp(prefix="sr-unpriv-"))
    os.chmod(root, 0o711)
    env = [f"SLURM_CONF={conf}", f"PYTHONPATH={lab.REPO}", f"HOME={pw.pw_dir}",
           f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}"]
    prefix = ["runuser", "-u", USER, "--", "env", "-i", *env]
    ok, why = _as(prefix, [sys.executable, "-c", "import os; from slurm_resilience.slurm import commands; "
                                                   "print(commands.operator_rights())"])
    assert ok and "False" in why, why  # the user runs our code and is no operator
    yield prefix, root, pw
    shutil.rmtree(root, ignore_errors=True)


def _as(prefix, argv):
    proc = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=60)
    return proc.returncode == 0, proc.stdout + proc.stderr


def _job(ordinary_user, name: str, config_extra: str = "") -> tuple[Path, Path]:
    """A job directory under a parent the user owns, and its config (readable)."""
    _, root, pw = ordinary_user
    parent = root / name
    parent.mkdir(mode=0o700)
    os.chown(parent, pw.pw_uid, pw.pw_gid)
    cfg = parent / "config.yaml"
    cfg.write_text(lab.LOCAL_CONFIG.read_text() + config_extra)
    os.chown(cfg, pw.pw_uid, pw.pw_gid)
    return parent / "job", cfg


def _hook(parent: Path) -> str:
    """A site hook that records its arguments (argv list, no shell)."""
    return (f"  isolate_hook: [{sys.executable!r}, '-c', "
            f"\"import sys; open('{parent}/hook.txt', 'a').write(' '.join(sys.argv[1:]) + chr(10))\"]\n")


def test_node_loss_as_ordinary_user_isolates_without_marking_and_finishes_bit_identical(
        cluster, ordinary_user, reference):
    prefix = ordinary_user[0]
    job_dir, _ = _job(ordinary_user, "node-loss")
    cfg = job_dir.parent / "config.yaml"
    cfg.write_text(cfg.read_text() + "recovery:\n" + _hook(job_dir.parent))
    run = lab.submit(job_dir, steps=STEPS, config=cfg, as_user=prefix, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][1]["node"]
    lab.kill_node(victim)
    assert run.wait() == 0, run.output()
    assert lab.compare_runs(reference, job_dir / "final.pt") == []
    assert [d["level"] for d in _events(job_dir, "recovery_done")] == ["node-replacement"]
    iso, = _events(job_dir, "isolated")
    assert iso["node"] == victim and iso["state"] == "none", iso
    # released from the job only where slurmdbd lets a shrunk job be updated later
    assert iso["released"] == uses_slurmdbd(commands.slurm_config()), iso
    assert not _events(job_dir, "isolate_failed")
    assert (job_dir.parent / "hook.txt").read_text().split()[0] == victim
    assert _events(job_dir, "isolate_hook")[0]["ok"]
    assert f"isolated node {victim}" in run.output()
    node = commands.show_nodes([victim])[victim]
    assert "slurm_resilience" not in node.get("Reason", "")  # the user never marked it
    assert os.stat(job_dir / "final.pt").st_uid == ordinary_user[2].pw_uid


def test_rank_kill_as_ordinary_user_restarts_in_place_bit_identical(cluster, ordinary_user, reference):
    job_dir, cfg = _job(ordinary_user, "rank-kill")
    run = lab.submit(job_dir, steps=STEPS, config=cfg, as_user=ordinary_user[0], step_time=FAULT_STEP_TIME)
    victim = run.wait_for_step(KILL_AT)["ranks"][2]
    os.kill(victim["pid"], signal.SIGKILL)  # a process this test's job started
    assert run.wait() == 0, run.output()
    assert lab.compare_runs(reference, job_dir / "final.pt") == []
    assert [d["level"] for d in _events(job_dir, "recovery_done")] == ["online"]


def test_requeue_as_ordinary_user_resumes_bit_identical_and_excludes_or_reports_the_node(
        cluster, ordinary_user, reference):
    job_dir, cfg = _job(ordinary_user, "requeue", "recovery:\n  scale_in: false\n  max_requeues: 1\n")
    run = lab.submit(job_dir, spares=0, steps=STEPS, config=cfg, as_user=ordinary_user[0], step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    victim = status["ranks"][1]["node"]
    lab.kill_node(victim)
    assert run.wait() == 0, run.output()
    assert _events(job_dir, "requeue")
    job = commands.show_job(status["job_id"])
    assert int(job.get("Restarts", 0)) == 1
    # The exclusion lands where Slurm accepts the update; where it refuses it (no
    # slurmdbd, the dead node's step still in the job: "the DB index is being set")
    # the refusal is reported in the first run's log.
    excluded = job["ExcNodeList"] not in ("", "(null)") and victim in commands.hostnames(job["ExcNodeList"])
    assert excluded or f"excluding {victim} failed" in run.output(), run.output()
    restored = [e for e in _events(job_dir, "rank_restored") if e.get("tier")]
    assert restored and restored[-1]["step"] >= 10  # resumed from a committed checkpoint
    assert lab.compare_runs(reference, job_dir / "final.pt") == []
    final = json.loads((job_dir / "status.json").read_text())
    assert final["requeue_count"] == 1, final  # counted against max_requeues


def test_preemption_as_ordinary_user_checkpoints_requeues_and_resumes_exactly(
        cluster, ordinary_user, reference):
    prefix = ordinary_user[0]
    job_dir, cfg = _job(ordinary_user, "preempt")
    run = lab.submit(job_dir, steps=STEPS, config=cfg, as_user=prefix, step_time=FAULT_STEP_TIME)
    status = run.wait_for_step(KILL_AT)
    ok, out = _as(prefix, ["scancel", "--signal=USR2", "--batch", status["job_id"]])  # the owner's own signal
    assert ok, out
    assert run.wait() == 0, run.output()
    persisted = _events(job_dir, "rank_persisted")
    assert len(persisted) == 4 and len({e["step"] for e in persisted}) == 1  # every rank, one step
    assert all(e["committed"] for e in persisted), persisted
    restored = [e for e in _events(job_dir, "rank_restored") if e.get("tier")]
    assert restored[-1]["step"] == persisted[0]["step"]  # exact resume: nothing lost
    assert lab.compare_runs(reference, job_dir / "final.pt") == []
