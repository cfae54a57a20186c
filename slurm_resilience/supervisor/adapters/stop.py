"""Stop: publishing the next generation's plan is the termination signal.

Ranks check for ``plan/{g+1}`` at every safe point and between the slices of every
bounded-wait collective, so survivors stop within one poll interval, keep their
processes, and re-form. The plan is also the fence: a worker not named in it exits.
"""

from __future__ import annotations

from ...protocol import SHUTDOWN_KEY, Plan, plan_key
from ..decide.ranktable import write_table


def publish_plan(store, plan: Plan, table_dir: str) -> str:
    """Write the rank table durably, then publish the plan (in that order)."""
    path = write_table(plan.table, table_dir)
    store.set(plan_key(plan.generation), plan.to_json())
    return path


def shut_down_standbys(store) -> None:
    """Warm standbys exit cleanly once the job is over."""
    store.set(SHUTDOWN_KEY, "1")
