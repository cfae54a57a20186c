"""The README's cluster install, followed as written by a new user account, submits a
job that survives a node kill.

The block between ``<!-- user-install`` and ``<!-- /user-install -->`` in README.md
runs, unchanged but for the checkout's path, in a login shell of a user created here
(``useradd -m``; deleted afterwards with its home, its jobs and its node-local
checkpoints). What the harness gives that user is what a site's login node gives:

- ``SLURM_CONF`` (the lab's slurm.conf, where a site has /etc/slurm);
- the operator's pip configuration as ``PIP_*`` variables (index, find-links,
  constraints: on a CI box part of it is root's own pip.conf, which no one else
  reads), so torch comes from the same place as the operator's;
- the checkout the README calls ``/path/to/slurm_resilience``: a copy of this one
  that the user may read and not write, as someone else's checkout is;
- ``set -euo pipefail`` first, so that a failing line fails the test.

The node kill is the lab operator's (root), with the venv's own ``slurm-resilience
inject kill-node``: an installed package without a checkout, which finds the lab's
``scripts/local-cluster`` through the record ``local-cluster start`` left in the lab.
"""

import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

from slurm_resilience import lab
from slurm_resilience.events import read_events

pytestmark = [pytest.mark.slurm, pytest.mark.timeout(300)]

USER = "srreadme"
PLACEHOLDER = "/path/to/slurm_resilience"
KILL_AT = 20  # of the README's 200 steps


def readme_block() -> str:
    """The shell lines of README.md's marked user-install block."""
    text = (lab.REPO / "README.md").read_text()
    begin = text.index("<!-- user-install")
    end = text.index("<!-- /user-install -->", begin)
    block = re.search(r"```bash\n(.*?)```", text[begin:end], re.S)
    assert block, "README.md: no ```bash block between the user-install markers"
    return block.group(1)


def site_pip_env() -> dict[str, str]:
    """The operator's effective pip settings as ``PIP_*`` variables: the environment's
    own, then each key of ``pip config list`` (files: global, user, site)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("PIP_")}
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True,
                            text=True, timeout=60, check=True).stdout
    for line in listed.splitlines():
        m = re.fullmatch(r"[^.]*\.([a-z0-9-]+)=(['\"])(.*)\2", line.strip())
        if m:
            env.setdefault("PIP_" + m.group(1).upper().replace("-", "_"), m.group(3))
    return env


def _readable_copy(src: Path, parent: Path) -> Path:
    """``src`` copied under ``parent`` (root's), readable by everyone, writable by root only."""
    dst = parent / "slurm_resilience"
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(
        ".git", "__pycache__", "*.egg-info", "build", "dist", "out", ".hypothesis", ".pytest_cache"))
    for d, dirs, files in os.walk(dst):
        os.chmod(d, 0o755)
        for f in files:
            p = os.path.join(d, f)
            os.chmod(p, stat.S_IMODE(os.lstat(p).st_mode) & 0o755 | 0o444)
    return dst


def _lab_readable(lab_dir: str) -> None:
    """What every user of a site has: slurm.conf readable, the spool traversable."""
    conf = Path(os.environ["SLURM_CONF"])
    os.chmod(conf, 0o644)
    for d in (conf.parent, Path(lab_dir), *(Path(lab_dir) / s for s in ("var", "var/spool", "var/tmp"))):
        if d.is_dir():
            os.chmod(d, stat.S_IMODE(d.stat().st_mode) | stat.S_IXOTH)


def _node_local_root() -> Path:
    """The user's node-local checkpoint root of the README's config (its ``{user}`` part)."""
    cfg = yaml.safe_load((lab.REPO / "examples" / "local-cluster.yaml").read_text())
    return Path(cfg["checkpoint"]["local_dir"].split("{job_id}")[0].format(user=USER))


def _delete_user() -> None:
    """The user's jobs cancelled, then the account, its home and its checkpoints removed."""
    try:
        pwd.getpwnam(USER)
    except KeyError:
        return
    subprocess.run(["scancel", "--user", USER], capture_output=True, timeout=30)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        queued = subprocess.run(["squeue", "--noheader", "--user", USER], capture_output=True, text=True,
                                timeout=30).stdout
        if not queued.strip():
            break
        time.sleep(1)
    subprocess.run(["userdel", "--remove", USER], capture_output=True, timeout=60)
    shutil.rmtree(_node_local_root(), ignore_errors=True)


@pytest.fixture
def new_user(slurm_cluster):
    if os.getuid() != 0:
        pytest.skip("creating a user account needs root")
    _delete_user()  # left by an interrupted run
    subprocess.run(["useradd", "--create-home", "--shell", "/bin/bash", USER], check=True, timeout=30)
    _lab_readable(slurm_cluster)
    try:
        yield pwd.getpwnam(USER)
    finally:
        _delete_user()


def test_readme_install_as_a_new_user_survives_a_node_kill(cluster, new_user, tmp_path):
    block = readme_block()
    assert block.count(PLACEHOLDER) == 1, block
    src_parent = Path(tempfile.mkdtemp(prefix="sr-readme-"))
    try:
        os.chmod(src_parent, 0o755)
        checkout = _readable_copy(lab.REPO, src_parent)
        home = Path(new_user.pw_dir)
        job_dir = home / "sr-jobs" / "first"
        assert str(job_dir).replace(str(home), "~") in block  # the README's job directory
        env = {**os.environ, **site_pip_env(), "SLURM_CONF": os.environ["SLURM_CONF"]}
        keep = sorted(k for k in env if k.startswith("PIP_") or k == "SLURM_CONF")
        log_path = tmp_path / "user-install.log"
        with open(log_path, "w") as log:
            shell = subprocess.Popen(["runuser", "--login", USER, "--whitelist-environment", ",".join(keep)],
                                     stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True,
                                     env=env, cwd="/")
        try:
            shell.stdin.write("set -euo pipefail\n" + block.replace(PLACEHOLDER, str(checkout)))
            shell.stdin.close()
            victim = _kill_a_node_once_training(shell, home, job_dir, log_path, tmp_path)
            try:
                assert shell.wait(timeout=180) == 0, log_path.read_text()[-4000:]
            finally:
                lab.cluster("revive-node", victim)
        finally:
            if shell.poll() is None:
                shell.kill()
                shell.wait(timeout=30)
    finally:
        shutil.rmtree(src_parent, ignore_errors=True)
    events = read_events(str(job_dir / "events.jsonl"))
    kinds = [e["kind"] for e in events]
    assert "job_done" in kinds, events[-3:]
    assert [e["level"] for e in events if e["kind"] == "recovery_done"] == ["node-replacement"]
    assert [e["node"] for e in events if e["kind"] == "isolated"] == [victim]
    assert str(home / "sr-env" / "bin" / "python") in (job_dir / "job.sbatch").read_text()
    assert os.stat(job_dir / "final.pt").st_uid == new_user.pw_uid


def _kill_a_node_once_training(shell, home: Path, job_dir: Path, log_path: Path, cwd: Path) -> str:
    """Wait for step KILL_AT, then kill rank 1's node as the lab's operator does, with the
    user's installed ``slurm-resilience`` (no checkout, no PYTHONPATH); returns the node."""
    try:
        lab.JobRun(job_dir=job_dir, process=shell).wait_for_step(KILL_AT, timeout=240)
    except (RuntimeError, TimeoutError) as exc:
        pytest.fail(f"{exc}\n{log_path.read_text()[-4000:]}")
    inject = subprocess.run(
        [str(home / "sr-env" / "bin" / "slurm-resilience"), "inject", "kill-node", "--job", str(job_dir)],
        capture_output=True, text=True, timeout=60, cwd=cwd,
        env={"PATH": os.environ["PATH"], "SLURM_CONF": os.environ["SLURM_CONF"], "HOME": str(cwd)})
    assert inject.returncode == 0, inject.stderr
    return json.loads(inject.stdout)["node"]
