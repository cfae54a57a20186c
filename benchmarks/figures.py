"""What every benchmark reports the same way: median, min and max of repeated runs,
printed and written as JSON (``--json``)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from provenance import stamped  # noqa: E402


def stats(xs: list[float]) -> dict:
    """Median, min, max and the runs themselves (seconds)."""
    return {"median_s": statistics.median(xs), "min_s": min(xs), "max_s": max(xs), "runs": list(xs)}


def emit(out: dict, json_path: str | None) -> None:
    """Print the figures; also write them to ``json_path`` when given."""
    text = json.dumps(stamped(out), indent=2)
    print(text)
    if json_path:
        Path(json_path).write_text(text)


def utc_now() -> str:
    import datetime

    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_run(figures: dict, args, started: str, report: str) -> None:
    """Stamp a run (start, end, machine, arguments), print its report, write its JSON."""
    import os
    import platform

    figures.update({"started": started, "finished": utc_now(), "machine": platform.node(),
                    "cpus": os.cpu_count(), "args": vars(args)})
    print(report)
    Path(args.json).write_text(json.dumps(stamped(figures), indent=2))
    print(f"wrote {args.json}")


def run_and_write(run, report, args) -> int:
    """A benchmark's main after its argument checks: run it, stamp it, print and write it."""
    started = utc_now()
    figures = run(args)
    write_run(figures, args, started, report(figures))
    return 0
