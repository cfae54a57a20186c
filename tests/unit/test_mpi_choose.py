"""run --mpi's path (mpi/choose.py), the probe's pure parts (mpi/probe.py) and the
in-place supervisor's decision after mpirun ends (mpi/fallback.py): all pure."""

from __future__ import annotations

import dataclasses
import sys

import pytest

from slurm_resilience.cli import main
from slurm_resilience.mpi.choose import (
    MpiPath, MpiProbe, choose_path, launches_with_ulfm, open_mpi_version, parse_ompi_info,
)
from slurm_resilience.mpi.errors import UlfmUnavailableError
from slurm_resilience.mpi.fallback import ExitAction, after_exit
from slurm_resilience.mpi.launch import mpirun_argv
from slurm_resilience.mpi.probe import split_program, uses_session
from slurm_resilience.mpi.supervise import build_launch, loopback_only

GOOD = MpiProbe(interpreter="/v/bin/python", script="train.py", uses_session=True,
                library="Open MPI v5.0.11, package: Open MPI user@localhost Distribution",
                has_ulfm_calls=True, libmpi="/v/lib/libmpi.so.40", prefix="/v", ft_support=True, mpirun=True)
ULFM_LINE = ["/v/bin/mpirun", "--with-ft", "ulfm", "-n", "5", "python", "train.py"]


def choose(probe=GOOD, requested="auto", argv=ULFM_LINE, container="none"):
    return choose_path(probe, requested=requested, launch_argv=argv, spare_ranks=2, container=container)


def test_every_fact_true_is_in_place_and_the_line_says_why():
    c = choose()
    assert c.path is MpiPath.IN_PLACE
    assert c.line().startswith("MPI recovery path: in-place repair (ULFM): mpi4py loads Open MPI 5.0.11 from /v")
    assert "2 spare rank(s)" in c.line()


@pytest.mark.parametrize("change, why", [
    ({"interpreter": None}, "not started by a Python interpreter"),
    ({"error": "ModuleNotFoundError: No module named 'mpi4py'"}, "cannot report its MPI: ModuleNotFoundError"),
    ({"library": "Open MPI v4.1.4, package: Debian OpenMPI"}, "loads Open MPI v4.1.4, which has no ULFM"),
    ({"library": "MPICH Version: 4.1"}, "loads MPICH Version: 4.1, which has no ULFM"),
    ({"has_ulfm_calls": False}, "no ULFM calls (Comm.Shrink)"),
    ({"ft_support": None}, "no ompi_info beside /v/lib/libmpi.so.40"),
    ({"ft_support": False}, "FT MPI support: no"),
    ({"mpirun": False}, "no /v/bin/mpirun"),
    ({"uses_session": None, "script": None}, "cannot tell whether the program uses"),
    ({"uses_session": False}, "train.py does not use slurm_resilience.mpi.Session"),
])
def test_each_missing_fact_falls_back_to_relaunch_with_its_reason(change, why):
    c = choose(dataclasses.replace(GOOD, **change))
    assert c.path is MpiPath.RELAUNCH and why in c.reason, c.reason
    assert c.line().startswith("MPI recovery path: relaunch of the whole step: ")


def test_a_launch_line_without_with_ft_is_relaunch():
    c = choose(argv=["/v/bin/mpirun", "-n", "5", "python", "train.py"])
    assert c.path is MpiPath.RELAUNCH and "--with-ft ulfm" in c.reason


def test_containers_and_an_explicit_relaunch_are_relaunch():
    assert "podman containers" in choose(container="podman").reason
    assert choose(requested="relaunch").reason == "asked for (--mpi-path relaunch)"


def test_in_place_asked_for_but_ruled_out_is_a_typed_error():
    with pytest.raises(UlfmUnavailableError, match="--mpi-path in-place: .*has no ULFM"):
        choose(dataclasses.replace(GOOD, library="Open MPI v4.1.4"), requested="in-place")
    assert choose(requested="in-place").path is MpiPath.IN_PLACE
    with pytest.raises(ValueError, match="choose one of auto, in-place, relaunch"):
        choose(requested="fast")


def test_the_built_launch_line_is_recognized():
    launch = build_launch(prefix="/v", workers=["n2", "n3"], spares=["n4"], per_node=2,
                          addresses=["127.0.0.1"] * 3)
    argv = mpirun_argv(launch, ["python", "t.py"])
    assert launches_with_ulfm(argv) and launch.spare_ranks == 2
    assert argv[argv.index("--host") + 1] == "n2:2,n3:2,n4:2"
    assert ["--mca", "btl_tcp_if_include", "lo"] == argv[argv.index("btl_tcp_if_include") - 1:][:3]
    assert ["-x", "SR_ULFM_SPARES"] == argv[argv.index("SR_ULFM_SPARES") - 1:][:2]
    assert not launches_with_ulfm(["mpirun", "--with-ft", "no"])
    assert loopback_only(["127.0.0.1", "127.0.0.2"]) and not loopback_only(["127.0.0.1", "10.0.0.2"])
    assert not loopback_only([])


def test_versions_ompi_info_and_program_parsing(tmp_path):
    assert open_mpi_version("Open MPI v5.0.11, package") == (5, 0, 11)
    assert open_mpi_version("MPICH Version: 4.1") is None
    info = parse_ompi_info("ompi:version:full:5.0.11\noptions:ft_mpi_support:yes\nnoise\n")
    assert info["options:ft_mpi_support"] == "yes" and info["ompi:version:full"] == "5.0.11"
    assert split_program(["/v/bin/python3.11", "-u", "t.py", "--x"]) == ("/v/bin/python3.11", "t.py")
    assert split_program(["python", "-m", "pkg.train"]) == ("python", None)
    assert split_program(["./a.out", "t.py"]) == (None, None)
    uses, plain = tmp_path / "a.py", tmp_path / "b.py"
    uses.write_text("import numpy\nfrom slurm_resilience.mpi import Session\n")
    plain.write_text("from mpi4py import MPI\n# slurm_resilience.mpi is not imported here\n")
    assert uses_session(str(uses)) is True and uses_session(str(plain)) is False
    assert uses_session(str(tmp_path / "none.py")) is None and uses_session(None) is None


WORKERS, SPARES = ("n2", "n3", "n4", "n5"), ("n6",)


def test_after_exit_done_and_node_loss_relaunches_with_the_spare_in_place():
    assert after_exit(0, finished=True, lost=set(), workers=WORKERS, spares=SPARES, retries=0, retry_budget=3).action \
        is ExitAction.DONE
    plan = after_exit(1, finished=False, lost={"n3"}, workers=WORKERS, spares=SPARES, retries=2, retry_budget=3)
    assert plan.action is ExitAction.RELAUNCH and plan.workers == ("n2", "n6", "n4", "n5")
    assert plan.spares == () and plan.lost == ("n3",) and plan.retries == 2  # a node loss spends no retry
    assert "PRRTE ends a job that loses a daemon" in plan.reason
    spare_lost = after_exit(1, finished=False, lost={"n6"}, workers=WORKERS, spares=SPARES, retries=0, retry_budget=3)
    assert spare_lost.action is ExitAction.RELAUNCH and spare_lost.workers == WORKERS and spare_lost.spares == ()


def test_after_exit_fails_without_spare_and_past_the_budget():
    plan = after_exit(137, finished=False, lost={"n3", "n4"}, workers=WORKERS, spares=SPARES, retries=0, retry_budget=3)
    assert plan.action is ExitAction.FAIL and plan.code == 137 and "no spare node left to take n4's" in plan.reason
    again = after_exit(1, finished=False, lost=set(), workers=WORKERS, spares=SPARES, retries=1, retry_budget=3)
    assert again.action is ExitAction.RELAUNCH and again.workers == WORKERS and again.retries == 2
    spent = after_exit(-9, finished=False, lost=set(), workers=WORKERS, spares=SPARES, retries=3, retry_budget=3)
    assert spent.action is ExitAction.FAIL and spent.code == 1 and "retry budget (3" in spent.reason


def test_cli_mpi_path_without_mpi_is_one_line(capsys):
    assert main(["run", "--mpi-path", "in-place", "--", "python3", "t.py"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["slurm-resilience: error: --mpi-path in-place applies to MPI programs: add --mpi"]


def test_cli_in_place_on_debian_open_mpi_is_one_line(capsys):
    """The probe runs for real: this interpreter's mpi4py loads Debian's Open MPI 4.1 (no ULFM)."""
    example = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "examples" / "mpi_ulfm_train.py")
    assert main(["run", "--mpi", "--mpi-path", "in-place", "--", sys.executable, example, "--out", "x"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("slurm-resilience: error: --mpi-path in-place: ")
    assert "Open MPI v4.1" in err[0] and "has no ULFM" in err[0]


def test_exit_0_without_rank_0_finishing_is_a_failure_not_done():
    """mpirun of PRRTE 3.0.11 ends with 0 after a daemon loss aborted the job (measured)."""
    plan = after_exit(0, finished=False, lost={"n3"}, workers=WORKERS, spares=SPARES, retries=0, retry_budget=3)
    assert plan.action is ExitAction.RELAUNCH and plan.workers == ("n2", "n6", "n4", "n5")
    assert plan.reason.startswith("mpirun ended with 0 but rank 0 never finished the run, node(s) n3 lost")
    healthy = after_exit(0, finished=False, lost=set(), workers=WORKERS, spares=SPARES, retries=3, retry_budget=3)
    assert healthy.action is ExitAction.FAIL and healthy.code == 1


def test_the_batch_script_hands_a_forced_path_to_the_supervisor():
    from slurm_resilience.config import load_config
    from slurm_resilience.launch.restart import render_restart

    def line(**kw):
        text = render_restart(load_config(), command=["python", "t.py"], config_path="c", job_dir="d", **kw)
        return [ln for ln in text.splitlines() if "restart-supervise" in ln][0]
    assert " --mpi -- " in line(mpi=True) and "--mpi-path" not in line(mpi=True)
    assert " --mpi --mpi-path in-place -- " in line(mpi=True, mpi_path="in-place")
    assert "--mpi" not in line(mpi=False, mpi_path="in-place")
