"""docs/migration.md shows the real diff between the plain DDP script and its Session version."""

import difflib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_migration_guide_shows_the_current_diff():
    plain = (ROOT / "examples" / "train_ddp_plain.py").read_text().splitlines(keepends=True)
    converted = (ROOT / "examples" / "train_ddp.py").read_text().splitlines(keepends=True)
    diff = "".join(list(difflib.unified_diff(plain, converted))[2:])
    doc = (ROOT / "docs" / "migration.md").read_text()
    block = doc.split("```diff\n", 1)[1].split("```", 1)[0]
    assert block == diff, "regenerate the diff block of docs/migration.md"
