"""Every published figure names the script that wrote it: each ``docs/results/*.json``
carries ``generator`` (a script in the repository) and ``command`` (the command line
that reproduces it, naming that script), as benchmarks/provenance.py stamps them, or
at least a ``command`` that runs a script of the repository."""

import json
import shlex
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))

import provenance  # noqa: E402

RESULTS = sorted((REPO / "docs" / "results").glob("*.json"))


def test_there_are_published_results():
    assert RESULTS


def scripts_in(command: str) -> list[str]:
    """The words of ``command`` that name a file of the repository (its scripts)."""
    return [w for w in shlex.split(command) if not w.startswith("-") and (REPO / w).is_file()]


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_result_names_an_existing_generator_and_its_command(path):
    doc = json.loads(path.read_text())
    assert isinstance(doc, dict), f"{path.name}: not a JSON object"
    cmd, gen = doc.get("command"), doc.get("generator")
    assert isinstance(cmd, str) or isinstance(gen, str), f"{path.name}: neither 'command' nor 'generator'"
    if gen is not None:  # benchmarks/provenance.py writes both
        assert (REPO / gen).is_file(), f"{path.name}: generator {gen!r} is not a file in the repository"
        assert isinstance(cmd, str) and gen in cmd, f"{path.name}: 'command' {cmd!r} does not run {gen}"
    else:
        assert scripts_in(cmd), f"{path.name}: 'command' {cmd!r} names no script of the repository"


def test_a_command_must_name_a_script_that_exists():
    assert scripts_in("python3 benchmarks/mttr.py --json x.json") == ["benchmarks/mttr.py"]
    assert scripts_in("python3 benchmarks/no_such_bench.py --repeats 3") == []
    assert scripts_in("merged by hand from three runs") == []


def test_stamped_names_the_script_relative_to_the_repo_and_keeps_the_figures():
    doc = provenance.stamped({"median_s": 1.5, "machine": "kept"}, REPO / "benchmarks" / "mttr.py")
    assert doc["generator"] == "benchmarks/mttr.py"
    assert doc["command"].startswith("python3 benchmarks/mttr.py")
    assert doc["median_s"] == 1.5 and doc["machine"] == "kept"
    assert {"cpus", "load", "written"} <= set(doc)


def test_stamp_quotes_the_arguments():
    s = provenance.stamp(REPO / "benchmarks" / "goodput.py", ["--json", "a b.json"])
    assert s["command"] == "python3 benchmarks/goodput.py --json 'a b.json'"
