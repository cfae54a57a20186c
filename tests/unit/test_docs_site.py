"""The user documentation site: `mkdocs build --strict` passes, every page under docs/
is in the nav, and the pages read for users (no branch names, issue numbers or commit
references)."""

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"

pytestmark = pytest.mark.timeout(120)

# What a user page must not say: where or when a figure was made in the project's
# history rather than what it is.
FORBIDDEN = {
    "issue number": re.compile(r"\bissues? #?\d+\b", re.I),
    "#NUMBER reference": re.compile(r"(?<![\w&/])#\d+\b"),
    "branch name": re.compile(r"\bbranch (?!(?:for|of|to|that|which|when|is|in|and|or|the|a|an)\b)[\w/-]+", re.I),
    "this branch": re.compile(r"\bthis branch\b", re.I),
    "commit reference": re.compile(r"\bmain @? ?[0-9a-f]{7,40}\b"),
}


def _mkdocs_missing() -> str | None:
    for module, package in (("mkdocs", "mkdocs"), ("material", "mkdocs-material"),
                            ("mkdocstrings", "mkdocstrings"), ("mkdocstrings_handlers.python", "mkdocstrings-python")):
        try:
            found = importlib.util.find_spec(module) is not None
        except ModuleNotFoundError:
            found = False
        if not found:
            return package
    return None


def _nav_pages(node) -> list[str]:
    if isinstance(node, str):
        return [node] if node.endswith(".md") else []
    if isinstance(node, list):
        return [p for item in node for p in _nav_pages(item)]
    if isinstance(node, dict):
        return [p for value in node.values() for p in _nav_pages(value)]
    return []


def _prose(text: str) -> str:
    """The text without fenced code blocks and inline code spans."""
    text = re.sub(r"^(```|~~~).*?^\1", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _user_pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md")) + [ROOT / "README.md"]


def test_mkdocs_build_strict(tmp_path):
    missing = _mkdocs_missing()
    if missing:  # CI installs the toolchain (scripts/install-deps.sh): there a skip would hide a broken site
        (pytest.fail if os.environ.get("CI") else pytest.skip)(
            f"{missing} is not installed (scripts/install-deps.sh installs the docs toolchain)")
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                           "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=100,
                          env={**_env(), "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "api.html").is_file()
    cli = (tmp_path / "site" / "cli.html").read_text()
    assert "--continue-run" in cli, "the generated CLI reference lacks submit's options"


def _env() -> dict[str, str]:
    import os

    return dict(os.environ)


def test_every_doc_is_in_the_nav():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    in_nav = _nav_pages(config["nav"])
    assert len(in_nav) == len(set(in_nav)), "a page is in the nav twice"
    on_disk = {p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")}
    assert on_disk - set(in_nav) == set(), "pages missing from mkdocs.yml's nav"
    assert set(in_nav) - on_disk == set(), "nav entries without a page"


@pytest.mark.parametrize("page", _user_pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_no_branch_issue_or_commit(page):
    prose = _prose(page.read_text())
    found = [f"{what}: {m.group(0)!r}" for what, rx in FORBIDDEN.items() for m in rx.finditer(prose)]
    assert not found, f"{page.relative_to(ROOT)}: {found}"


def test_every_event_kind_is_documented():
    from slurm_resilience.protocol import EventKind, WorkerEvent

    page = (DOCS / "events.md").read_text()
    missing = [k.value for k in EventKind if f"`{k.value}`" not in page]
    missing += [w.logged for w in WorkerEvent if f"`{w.logged}`" not in page]
    assert not missing, f"docs/events.md lacks {missing}"


def test_getting_started_install_block_is_the_readme_s():
    def block(text: str, after: str) -> str:
        start = text.index(after)
        return re.search(r"```bash\n(.*?)```", text[start:], re.S).group(1)

    readme = block((ROOT / "README.md").read_text(), "<!-- user-install")
    guide = block((DOCS / "getting-started.md").read_text(), "the same block as README.md's user-install block")
    assert guide == readme, "docs/getting-started.md's install block differs from README.md's"
