"""Remove the tier directories that ended runs left behind, by the ownership rule.

A tier path with ``{run_id}`` (the default ``checkpoint.local_dir`` is
``/tmp/slurm_resilience-{user}/{job_id}/{run_id}/{node}/ckpt``) gives every run a
directory of its own: its **run directory**, the path up to and including the
component that holds ``{run_id}``::

    /tmp/slurm_resilience-ann/1/            the job id's directory (PARENT)
      3f0c…9a/                              run 3f0c…9a: this run          kept
      77be…01/                              run 77be…01: another run of    removed
        n3/ckpt/step-…                        job id 1, hence ended

The rule is the ownership rule (``ownership.py``) applied to directories: under one
job id, a run id other than this run's is an ended run's. A job id names one job of
one Slurm controller at a time and a run keeps its job id (the first job's, across
requeues and resubmissions), so two live runs never share one; an earlier run with
this job id is one a restarted Slurm numbered again. So a path is cleaned only when
``{job_id}`` is in the run directory's path (else other run ids there may be other
live jobs'), and only what is this user's own directory (not a link) is removed.
Other job ids' directories are never touched, whether their jobs ended or not: the
toolkit cannot tell an ended run from a resubmitted one there (a resubmitted run
keeps its first job id, which no longer shows in the queue).

:func:`run_dir_pattern` and :func:`stale` are pure; :func:`clean` acts, once per
tier root's owner at the run's first generation (the engine, in a thread), and says
what it removed in one ``checkpoint_cleaned`` event.
"""

from __future__ import annotations

import os
import re
import shutil
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence


__all__ = ["RUN_ID_GROUP", "RunDirPattern", "run_dir_pattern", "stale", "clean", "clean_in_background"]


_SENTINEL = "\x00RUN\x00"
RUN_ID_GROUP = "([0-9a-f]{32})"


@dataclass(frozen=True)
class RunDirPattern:
    """Where the run directories of one tier path live: ``parent`` (expanded), and the
    regular expression a run directory's name matches (group 1: its run id)."""

    parent: str
    name: re.Pattern


def run_dir_pattern(template: str, values: Mapping[str, Any]) -> RunDirPattern | None:
    """Pure: the run directories of tier path ``template`` with this run's ``values``
    (job_id, node, rank, job_dir, user; run_id ignored), or None when the rule does not
    apply: no ``{run_id}`` in the path, no ``{job_id}`` up to the run directory, or a
    value that does not fill the template as a plain name (a format spec, a ``/``)."""
    parts = template.split("/")
    i = next((k for k, p in enumerate(parts) if "{run_id}" in p), None)
    if i is None or i == 0 or not any("{job_id}" in p for p in parts[: i + 1]):
        return None
    try:
        parent = "/".join(parts[:i]).format_map(dict(values, run_id=_SENTINEL))
        name = parts[i].format_map(dict(values, run_id=_SENTINEL))
    except (KeyError, ValueError, IndexError, AttributeError):
        return None
    if _SENTINEL in parent or "/" in name or name.count(_SENTINEL) != 1 or not parent:
        return None
    before, after = name.split(_SENTINEL)
    return RunDirPattern(parent, re.compile(re.escape(before) + RUN_ID_GROUP + re.escape(after)))


def stale(pattern: RunDirPattern, names: Iterable[str], run_id: str) -> list[str]:
    """Pure: the paths of the run directories among ``names`` (entries of
    ``pattern.parent``) that are not this run's, sorted."""
    out = []
    for name in names:
        m = pattern.name.fullmatch(name)
        if m and m.group(1) != run_id:
            out.append(os.path.join(pattern.parent, name))
    return sorted(out)


def clean(templates: Sequence[tuple[str, str]], values: Mapping[str, Any], run_id: str,
          emit: Callable[..., None]) -> list[str]:
    """Remove the other runs' directories of every ``(tier, path template)``; one
    ``checkpoint_cleaned`` event lists them (and what could not be removed). Returns
    the removed paths. Never raises for a directory: an error is in the event."""
    removed, failed = [], []
    for tier, template in templates:
        pattern = run_dir_pattern(template, values)
        if pattern is None:
            continue
        try:
            names = os.listdir(pattern.parent)
        except OSError:  # no such directory yet: nothing left by anyone
            continue
        for path in stale(pattern, names, run_id):
            try:
                st = os.lstat(path)
                if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                    continue  # a link, a file, another user's: not ours to judge
                shutil.rmtree(path, onerror=_gone_is_fine)
                removed.append(path)
            except FileNotFoundError:  # another rank of a node sharing the directory took it
                continue
            except OSError as exc:
                failed.append({"path": path, "error": str(exc)[:200]})
    if removed or failed:
        emit("checkpoint_cleaned", run_id=run_id, removed=removed, failed=failed,
             note="directories of ended runs with this job id (docs/checkpoints.md, 'A checkpoint belongs to one run')")
    return removed


def _gone_is_fine(func, path, exc_info) -> None:
    """``rmtree`` hook: what vanished meanwhile (another node of a shared /tmp) is gone."""
    if not isinstance(exc_info[1], FileNotFoundError):
        raise exc_info[1]


def clean_in_background(templates: Sequence[tuple[str, str]], values: Mapping[str, Any], run_id: str,
                        emit: Callable[..., None]) -> threading.Thread | None:
    """:func:`clean` in a daemon thread (removing a large tree is off the restore's
    path); None when no template can hold other runs' directories."""
    if not any(run_dir_pattern(t, values) for _, t in templates):
        return None
    th = threading.Thread(target=clean, args=(templates, dict(values), run_id, emit), name="sr-ckpt-clean",
                          daemon=True)
    th.start()
    return th
