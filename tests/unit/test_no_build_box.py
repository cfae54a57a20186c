"""Nothing of the machine that built the project is in it: no registry host names, no
home or checkout paths of that machine (in code, docs or the results' JSON)."""

import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
# a registry host, or a path only the build box has (its checkout, its tool library, root's home)
FORBIDDEN = ("pypi.org/simple", "files.pythonhosted.org", "docker.io/", "quay.io/", "ghcr.io/", "registry-1.", "nvcr.io",
             "/work/main", "/work/.library", "/root/.pyenv", "/root/.cache")


def _tracked() -> list[pathlib.Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [ROOT / p for p in out.decode().split("\0") if p]


def test_no_registry_host_or_build_box_path_in_tracked_files():
    found = []
    for path in _tracked():
        if path == pathlib.Path(__file__).resolve() or not path.is_file():
            continue
        try:
            text = path.read_text(errors="ignore")
        except OSError:
            continue
        found += [f"{path.relative_to(ROOT)}: {word}" for word in FORBIDDEN if word in text]
    assert not found, found
