"""Stop: publishing the next generation's plan (its rank table file first) is the termination signal.

Ranks check for ``plan/{g+1}`` at every safe point and between the slices of every
bounded-wait collective, so survivors stop within one poll interval, keep their
processes, and re-form. The plan is also the fence: a worker not named in it exits.
Once it is in the store, the pulse of every node in its table is sent it (``tell``),
writes it into the node's pulse directory and its generation into its ranks' pages,
where they look first (``worker/plan_watch.py``): N/G lines out of the supervisor
instead of N store checks every poll interval and N reads of the whole table.
"""

from __future__ import annotations

import os
import time
from typing import Any, Callable, NamedTuple

from ...files import makedirs_private, write_private
from ...model import RankTable
from ...protocol import Plan, StoreKey


__all__ = ["LATEST_NAME", "Out", "publish_plan", "shut_down_standbys", "write_table"]


LATEST_NAME = "ranktable.json"


class Out(NamedTuple):
    """A published plan: its versioned table file, and when the plan was out (after the
    store ``set`` and the pulses' notice, before the files: the ranktable phase ends there)."""

    path: str
    t: float


def publish_plan(store, plan: Plan, table_dir: str, tell: Callable[..., Any] | None = None) -> Out:
    """Publish the plan, tell the nodes' pulses, then write the rank table files (in that order).

    The files are for people and tools; no rank and no re-attach reads them, so their
    JSON and writes (80 ms at 16,384 ranks on ``/dev/shm`` before the text was made
    cheap, plus two fsyncs on a parallel file system) follow the plan instead of delaying it. A supervisor that dies in between
    leaves the plan in the store, which a re-attach adopts (``reattach.adopt_plans``)."""
    text = plan.to_json()
    store.set(StoreKey.PLAN.of(plan.generation), text)
    if tell is not None:  # the plan itself too, to the nodes of its table: their ranks read it there
        tell({"plan": plan.generation, "body": text}, nodes=plan.table.node_list)  # each node once
    out = time.time()
    return Out(write_table(plan.table, table_dir), out)


def shut_down_standbys(store, tell: Callable[[dict], Any] | None = None) -> None:
    """Warm standbys exit cleanly once the job is over (the store first, then the pulses)."""
    store.set(StoreKey.SHUTDOWN.value, "1")
    if tell is not None:
        tell({"shutdown": 1})


def write_table(table: RankTable, directory: str) -> str:
    """Write ``ranktable-gen{g:04d}.json`` and ``ranktable.json`` atomically.

    Each file is written to a 0600 temp file in ``directory``, fsynced, renamed
    into place, and the directory is fsynced. The versioned file lands first so
    ``ranktable.json`` never names a generation that is not on disk.

    Returns:
        the path of the versioned file.
    Raises:
        OSError: the directory is not writable.
    """
    makedirs_private(directory)
    text = table.to_json()
    path = os.path.join(directory, f"ranktable-gen{table.generation:04d}.json")
    write_private(path, text)
    write_private(os.path.join(directory, LATEST_NAME), text)
    return path
