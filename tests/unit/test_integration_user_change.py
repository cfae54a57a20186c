"""The lines a user changes to adopt an integration, as docs/lightning.md states them:
the diff of each plain example against its integrated twin, code only (the module
docstrings, which name the twin, and blank lines not counted)."""

import ast
import difflib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PAIRS = {"Lightning": "lightning_train", "Accelerate": "accelerate_train"}


def code_lines(path: Path) -> list[str]:
    """The file's non-blank lines after its module docstring."""
    text = path.read_text()
    doc = ast.parse(text).body[0]
    return [line for line in text.splitlines()[doc.end_lineno:] if line.strip()]


def user_change(plain: Path, integrated: Path) -> tuple[int, int]:
    """``(added, removed)`` lines going from ``plain`` to ``integrated``."""
    diff = list(difflib.unified_diff(code_lines(plain), code_lines(integrated), lineterm="", n=0))[2:]
    return (sum(d.startswith("+") for d in diff), sum(d.startswith("-") for d in diff))


def test_the_documented_user_change_is_the_examples_diff():
    doc = (ROOT / "docs" / "lightning.md").read_text()
    for name, stem in PAIRS.items():
        added, removed = user_change(ROOT / "examples" / f"{stem}_plain.py", ROOT / "examples" / f"{stem}.py")
        stated = re.search(rf"\| {name} \| `examples/{stem}_plain.py` → `examples/{stem}.py` \| (\d+) \| (\d+) \|", doc)
        assert stated, f"docs/lightning.md: no row for {name} in the user-change table"
        assert (int(stated[1]), int(stated[2])) == (added, removed), f"{name}: the diff is +{added} -{removed}"


def test_a_changed_line_counts_once_each_way(tmp_path):
    a, b = tmp_path / "a.py", tmp_path / "b.py"
    a.write_text('"""A."""\n\nimport os\nx = 1\n\ny = 2\n')
    b.write_text('"""B, longer\nand wrapped."""\n\nimport os\nimport sys\nx = 3\ny = 2\n')
    assert user_change(a, b) == (2, 1)
