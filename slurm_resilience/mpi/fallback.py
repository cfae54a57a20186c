"""What the in-place (ULFM) supervisor does when ``mpirun`` ends (pure).

A lost rank on a live node is repaired inside the job and never reaches here. What
does reach here is ``mpirun`` ending:

    exit 0 and rank 0 finished the run  DONE (exit 0 alone proves nothing: mpirun of
                                        PRRTE 3.0.11 also ends with 0 after a daemon loss
                                        aborted the job, measured on the local Slurm)
    a node lost (its slurmd silent)     RELAUNCH: PRRTE 3.0.11 aborts the whole job when
                                        it loses a daemon (errmgr_dvm.c, docs/mpi-ulfm.md),
                                        so the job is started again, each lost worker node
                                        replaced by a spare node, and the program resumes
                                        from its own snapshot (the relaunch path)
    no node lost, exit != 0             RELAUNCH on the same nodes while the retry budget
                                        (``recovery.fault_retry_times``) lasts, else FAIL
    too few spare nodes / budget spent  FAIL with the reason

::

    before   workers n2 n3 n4 n5 | spares n6      n3 lost
    after    workers n2 n6 n4 n5 | spares -       (the spare node takes n3's slot)
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import AbstractSet, Sequence

__all__ = ["ExitAction", "ExitPlan", "after_exit"]


class ExitAction(enum.Enum):
    """DONE: the job succeeded. RELAUNCH: start ``mpirun`` again on the plan's nodes.
    FAIL: end the job with ``ExitPlan.code``."""

    DONE = "done"
    RELAUNCH = "relaunch"
    FAIL = "fail"


@dataclass(frozen=True)
class ExitPlan:
    """The decision after ``mpirun`` ended.

    Attributes:
        action: what to do.
        reason: one line for the log.
        workers: worker nodes of the next launch (RELAUNCH), in rank order.
        spares: spare nodes of the next launch (RELAUNCH).
        lost: the nodes taken out (lost).
        retries: process faults answered by a relaunch so far (this one included).
        code: the job's exit code (DONE, FAIL).
    """

    action: ExitAction
    reason: str
    workers: tuple[str, ...] = ()
    spares: tuple[str, ...] = ()
    lost: tuple[str, ...] = ()
    retries: int = 0
    code: int = 0


def after_exit(code: int, *, finished: bool, lost: AbstractSet[str], workers: Sequence[str],
               spares: Sequence[str], retries: int, retry_budget: int) -> ExitPlan:
    """Decide after ``mpirun`` exited with ``code``; ``finished``: rank 0 reported the
    end of the run (its ``done`` event); ``lost``: nodes found dead then.

    ``retries``: relaunches so far for faults on healthy nodes (a node loss does not
    spend the budget, as in the relaunch path: the node is the cause, and it is gone).
    """
    if code == 0 and finished:
        return ExitPlan(ExitAction.DONE, "mpirun ended with 0 and rank 0 finished the run", code=0)
    fail_code = code if code > 0 else 1
    ended = f"mpirun ended with {code}" + ("" if code else " but rank 0 never finished the run")
    gone = tuple(n for n in (*workers, *spares) if n in lost)
    if gone:
        free = [s for s in spares if s not in lost]
        new_workers = []
        for w in workers:
            if w not in lost:
                new_workers.append(w)
            elif free:
                new_workers.append(free.pop(0))
            else:
                return ExitPlan(ExitAction.FAIL, f"node(s) {', '.join(gone)} lost and no spare node left "
                                f"to take {w}'s ranks", lost=gone, retries=retries, code=fail_code)
        return ExitPlan(ExitAction.RELAUNCH,
                        f"{ended}, node(s) {', '.join(gone)} lost: PRRTE ends a job that loses a daemon; "
                        "relaunched with a spare node in each lost worker's place",
                        workers=tuple(new_workers), spares=tuple(free), lost=gone, retries=retries)
    if retries >= retry_budget:
        return ExitPlan(ExitAction.FAIL, f"{ended} on healthy nodes and the retry budget "
                        f"({retry_budget}, recovery.fault_retry_times) is spent", retries=retries, code=fail_code)
    return ExitPlan(ExitAction.RELAUNCH, f"{ended} on healthy nodes: relaunched in place "
                    f"({retries + 1} of {retry_budget})", workers=tuple(workers), spares=tuple(spares),
                    retries=retries + 1)
