"""Ranks as spawned processes that each leave one pickled result (tests of the worker's
collectives without Slurm)."""

from __future__ import annotations

import os
import pickle
from typing import Callable, Sequence


def run_ranks(ctx, target: Callable, args: Sequence[tuple], outs: Sequence[str], *,
              started: Callable[[], None] | None = None, join_s: float = 90) -> list[dict]:
    """Start ``target(*args[r])`` for every rank, call ``started`` (if any) once all are
    running, wait for them (a rank still alive after ``join_s`` is killed), and return
    what each wrote to ``outs[r]``. Fails when a rank left nothing or reported an error."""
    procs = [ctx.Process(target=target, args=a) for a in args]
    for p in procs:
        p.start()
    try:
        if started is not None:
            started()
        for p in procs:
            p.join(join_s)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
    results = []
    for r, o in enumerate(outs):
        assert os.path.exists(o), f"rank {r} left no result"
        with open(o, "rb") as f:
            results.append(pickle.load(f))
    assert not any("error" in r for r in results), results
    return results
