"""A checkpoint belongs to one run: restore only its own, say once what was skipped.

Every manifest a run commits (L1 and its partner copies and XOR rebuilds, L2, the
headless ending's L2 shards) records the run's identity (``run_identity.RunIdentity``,
:meth:`Ownership.stamp`). A restore reads a tier root through :meth:`Ownership.own`:
a committed step of another run — a node-local directory left by an earlier program
whose job id a restarted Slurm repeated, a shared directory two programs were given —
is *not here* for this run, exactly like a missing step, so the restore falls to the
next tier or to step 0. Each restore ends with :meth:`Ownership.report`: one
``checkpoint_foreign`` event listing every root and step skipped, not one per file,
from the rank that speaks for the root (a node-local root's owner, rank 0 for a
shared one), so a node's G ranks do not say it G times.

A manifest written before run ids (no ``run_id``) cannot be told apart from another
program's, so it is foreign too unless ``checkpoint.adopt_legacy`` is set: restoring
an unrelated model's tensors kills every rank at its first state sync, while ignoring
an own legacy checkpoint costs the steps since step 0. Retention leaves other runs'
steps alone and does not count them (:meth:`Ownership.foreign_steps`).
``checkpoint.init_from`` (a checkpoint the user names) is exempt: it is read as given.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Collection

from ..errors import CheckpointError
from ..run_identity import RunIdentity
from . import manifest as mf


__all__ = ["MAX_LISTED", "Ownership", "found_entry"]


MAX_LISTED = 8  # steps and run ids listed per root in the event
log = logging.getLogger(__name__)


class Ownership:
    """One rank's view of which committed steps are its run's (used by the engine,
    the XOR rebuild and the resharding restore). Not thread-safe: the restore's caller."""

    def __init__(self, run: RunIdentity, *, adopt_legacy: bool = False,
                 emit: Callable[..., None] = lambda kind, **f: None) -> None:
        self.run, self.adopt_legacy, self._emit = run, adopt_legacy, emit
        self._skipped: dict[tuple[str, str], dict[int, str | None]] = {}  # (tier, root) -> step -> run id
        self._reported: list | None = None

    def stamp(self) -> dict[str, str]:
        """The ``Manifest`` fields that name this run."""
        return {"run_id": self.run.run_id, "job_id": self.run.job_id}

    def accepts(self, manifest: mf.Manifest) -> bool:
        """Pure: ``manifest`` is this run's (legacy ones per ``adopt_legacy``)."""
        return self.run.owns(manifest.run_id, adopt_legacy=self.adopt_legacy)

    def own(self, root: str, tier: str) -> list[tuple[int, mf.Manifest]]:
        """This run's committed steps under ``root``, ascending, with their manifests;
        other runs' are noted for :meth:`report`.

        Raises:
            CheckpointError: a manifest is unreadable or corrupt.
        """
        out = []
        for step in mf.complete_steps(root):
            man = mf.read_manifest(root, step)
            if self.accepts(man):
                out.append((step, man))
            else:
                self._skipped.setdefault((tier, root), {})[step] = man.run_id
        return out

    def committed(self, root: str, step: int) -> bool:
        """Whether ``step`` under ``root`` is committed by this run: a manifest of another
        run (or an unreadable one) does not count, and a commit of this run replaces it."""
        if not os.path.isfile(mf.manifest_path(root, step)):
            return False
        try:
            return self.accepts(mf.read_manifest(root, step))
        except CheckpointError:
            return False

    def foreign_steps(self, root: str) -> list[int]:
        """Committed steps under ``root`` of other runs (an unreadable manifest is not
        counted: retention deals with it as with any broken step of its own)."""
        out = []
        for step in mf.complete_steps(root):
            try:
                if not self.accepts(mf.read_manifest(root, step)):
                    out.append(step)
            except CheckpointError:
                continue
        return out

    def report(self, speaks_for: Collection[str] | None = None) -> None:
        """One ``checkpoint_foreign`` event (and one log line) for the other runs' steps
        :meth:`own` skipped since the last report, under the roots in ``speaks_for`` (None:
        all); none when nothing was skipped, or the same as last time."""
        found = [found_entry(tier, root, steps) for (tier, root), steps in sorted(self._skipped.items())
                 if speaks_for is None or root in speaks_for]
        self._skipped = {}
        if not found or found == self._reported:
            return
        self._reported = found
        legacy = any(None in e["run_ids"] for e in found)
        log.warning("ignored %d checkpoint step(s) of another run: %s", sum(e["count"] for e in found),
                    "; ".join(f"{e['tier']} {e['root']} steps {e['steps']}" for e in found))
        self._emit("checkpoint_foreign", run_id=self.run.run_id, found=found,
                   note="another run's checkpoints were ignored (not restored)"
                        + ("; manifests without a run id are foreign unless checkpoint.adopt_legacy is set"
                           if legacy else ""))


def found_entry(tier: str, root: str, steps: dict[int, str | None]) -> dict[str, Any]:
    """Pure: one root's skipped steps, as the event lists them (newest steps first)."""
    newest = sorted(steps, reverse=True)
    return {"tier": tier, "root": root, "steps": newest[:MAX_LISTED], "count": len(newest),
            "run_ids": sorted({steps[s] for s in newest}, key=lambda r: (r is not None, r or ""))[:MAX_LISTED]}
