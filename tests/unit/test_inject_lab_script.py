"""`inject kill-node` from an installed package (no checkout): which local-cluster
script runs, and one line with exit 2 when there is none (``lab.local_cluster_script``)."""

import json
import os
from pathlib import Path

import pytest

from slurm_resilience import cli, lab

FAKE = """\
import sys
open({log!r}, "a").write(" ".join(sys.argv[1:]) + "\\n")
print("killed %s: 0 processes (-) in 0.001s killed_at=123.500000" % sys.argv[-1])
"""


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """As a wheel sees it: no scripts/ beside the package, a job directory, an empty
    environment (no SR_LOCAL_CLUSTER, SR_LAB, SLURM_CONF; a PATH without local-cluster)."""
    monkeypatch.setattr(lab, "LOCAL_CLUSTER", tmp_path / "site-packages" / "scripts" / "local-cluster")
    monkeypatch.setattr(lab, "DEFAULT_LAB", str(tmp_path / "no-lab"))
    for var in ("SR_LOCAL_CLUSTER", "SR_LAB", "SLURM_CONF"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
    job = tmp_path / "job"
    job.mkdir()
    (job / "status.json").write_text(json.dumps({"ranks": [{"node": "n1", "pid": 11}, {"node": "n2", "pid": 12}]}))
    return job


def _script(path: Path, log: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(FAKE.format(log=str(log)))
    path.chmod(0o700)
    return path


def _lab(tmp_path: Path, script: Path, mode: int = 0o600) -> Path:
    root = tmp_path / "lab"
    (root / "etc").mkdir(parents=True)
    record = root / lab.LAB_RECORD
    record.write_text(f"{script}\n")
    record.chmod(mode)
    return root


def test_no_script_anywhere_is_one_line_and_exit_2(installed, capsys):
    assert cli.main(["inject", "kill-node", "--job", str(installed)]) == 2
    out = capsys.readouterr()
    err = out.err.strip()
    assert "\n" not in err and "Traceback" not in err, err
    assert err.startswith("slurm-resilience: error: node faults need the local cluster's scripts/local-cluster")
    assert "SR_LOCAL_CLUSTER=" in err and lab.LAB_RECORD in err
    assert out.out == "" and not (installed / "injected.jsonl").exists()


def test_the_lab_named_by_slurm_conf_gives_its_recorded_script_and_itself(installed, tmp_path, monkeypatch, capsys):
    log = tmp_path / "argv.log"
    root = _lab(tmp_path, _script(tmp_path / "checkout" / "scripts" / "local-cluster", log))
    monkeypatch.setenv("SLURM_CONF", str(root / "etc" / "slurm.conf"))
    assert cli.main(["inject", "kill-node", "--job", str(installed)]) == 0
    done = json.loads(capsys.readouterr().out)
    assert done == {"fault": "kill-node", "rank": 1, "node": "n2", "at": 123.5}
    assert log.read_text() == f"--lab {root} kill-node n2\n"  # the same lab, not the script's default


def test_sr_lab_is_searched_before_slurm_conf(installed, tmp_path, monkeypatch):
    log = tmp_path / "argv.log"
    root = _lab(tmp_path, _script(tmp_path / "bin" / "local-cluster", log))
    monkeypatch.setenv("SR_LAB", str(root))
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "other" / "etc" / "slurm.conf"))
    assert lab.local_cluster_script() == (tmp_path / "bin" / "local-cluster", str(root))


def test_a_record_others_may_write_is_not_trusted(installed, tmp_path, monkeypatch, capsys):
    root = _lab(tmp_path, _script(tmp_path / "evil", tmp_path / "argv.log"), mode=0o666)
    monkeypatch.setenv("SR_LAB", str(root))
    assert cli.main(["inject", "kill-node", "--job", str(installed)]) == 2
    assert "node faults need" in capsys.readouterr().err
    assert not (tmp_path / "argv.log").exists()


def test_sr_local_cluster_names_the_script(installed, tmp_path, monkeypatch, capsys):
    log = tmp_path / "argv.log"
    monkeypatch.setenv("SR_LOCAL_CLUSTER", str(_script(tmp_path / "lc", log)))
    assert cli.main(["inject", "kill-node", "--job", str(installed), "--rank", "0"]) == 0
    assert json.loads(capsys.readouterr().out)["node"] == "n1"
    assert log.read_text() == "kill-node n1\n"


def test_sr_local_cluster_that_is_no_file_is_one_line(installed, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("SR_LOCAL_CLUSTER", str(tmp_path / "nope"))
    assert cli.main(["inject", "kill-node", "--job", str(installed)]) == 2
    assert capsys.readouterr().err.strip() == (
        f"slurm-resilience: error: SR_LOCAL_CLUSTER={tmp_path / 'nope'} is not a file: "
        "name the lab's scripts/local-cluster")


def test_local_cluster_on_path(installed, tmp_path, monkeypatch):
    script = _script(tmp_path / "bin" / "local-cluster", tmp_path / "argv.log")
    monkeypatch.setenv("PATH", f"{tmp_path / 'empty-bin'}{os.pathsep}{script.parent}")
    assert lab.local_cluster_script() == (script, None)


def test_a_failing_script_is_one_line_and_exit_2(installed, tmp_path, monkeypatch, capsys):
    bad = tmp_path / "lc"
    bad.write_text("import sys\nprint('local-cluster: unknown node', file=sys.stderr)\nsys.exit(2)\n")
    monkeypatch.setenv("SR_LOCAL_CLUSTER", str(bad))
    assert cli.main(["inject", "kill-node", "--job", str(installed)]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"slurm-resilience: error: {bad} kill-node n2 failed: local-cluster: unknown node"


def test_the_checkout_script_wins_in_an_editable_install():
    assert lab.LOCAL_CLUSTER.is_file()  # this checkout
    assert lab.local_cluster_script({"SR_LAB": "/nonexistent", "PATH": ""}) == (lab.LOCAL_CLUSTER, None)
