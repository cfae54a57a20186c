"""DCP in and out: a toolkit checkpoint as a torch.distributed.checkpoint (or one
``torch.save`` file), and a DCP checkpoint as a job's starting state.

Export (``slurm-resilience ckpt export DIR [--step S] --format dcp|torch OUT``)::

    read_rank_states(root, step) ──▶ global_state (globalize.py) ──▶ dcp.save(no_dist) into
    .OUT.*.tmp/ ──▶ rename to OUT        (torch: torch.save into a 0600 temporary, link to OUT)

The DCP holds ``{object name: full state, "step", "position", "extras"}``; plain
``torch.distributed.checkpoint.load`` reads it into a fresh model of any world size
(DCP reshards on load). OUT is never half-written and never replaced.

Import (``checkpoint.init_from: PATH``): :func:`read_dcp` reads the named top-level
keys of a DCP checkpoint into full tensors (``statesync`` decides when).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from typing import Any, Iterable

from ..errors import CheckpointError
from ..files import fsync_dir

__all__ = ["FORMATS", "export_checkpoint", "write_dcp", "write_torch", "read_dcp", "dcp_keys", "initial_state",
           "check_init_from"]

FORMATS = ("dcp", "torch")


def export_checkpoint(root: str, step: int | None, fmt: str, out: str) -> tuple[int, str]:
    """Write committed ``step`` (default: the newest complete) of tier root ``root`` to ``out``.

    Returns (step, out).

    Raises:
        CheckpointError: unknown format, ``out`` exists or its directory does not,
            no such step, a rank's shard missing or unreadable.
    """
    from . import manifest as mf
    from .globalize import global_state, read_rank_states

    if fmt not in FORMATS:
        raise CheckpointError(f"unknown format {fmt!r}: use {' or '.join(FORMATS)}")
    _check_out(out)
    if step is None:
        complete = mf.complete_steps(root)
        if not complete:
            raise CheckpointError(f"no complete checkpoint under {root}")
        step = complete[-1]
    state = global_state(read_rank_states(root, step))
    (write_dcp if fmt == "dcp" else write_torch)(state, out)
    return step, out


def _check_out(out: str) -> None:
    if os.path.lexists(out):
        raise CheckpointError(f"{out} exists: the export never replaces anything, name a new path")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CheckpointError(f"no such directory: {parent}")


def write_dcp(state: dict[str, Any], out: str) -> None:
    """Save ``state`` as a DCP checkpoint directory ``out`` (this process alone), atomically.

    Raises:
        CheckpointError: ``out`` exists, or writing fails.
    """
    import torch.distributed.checkpoint as dcp

    _check_out(out)
    parent = os.path.dirname(os.path.abspath(out))
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    try:
        with warnings.catch_warnings():  # "assuming the intent is to save in a single process": it is
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.save(state, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True), no_dist=True)
        os.chmod(tmp, 0o700)
        for name in os.listdir(tmp):
            os.chmod(os.path.join(tmp, name), 0o600)
        _check_out(out)  # a path created meanwhile is not replaced
        os.rename(tmp, out)
        fsync_dir(parent)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, (OSError, ValueError, RuntimeError)):
            raise CheckpointError(f"cannot write the DCP checkpoint {out}: {exc}") from exc
        raise


def write_torch(state: dict[str, Any], out: str) -> None:
    """``torch.save`` ``state`` to the file ``out`` (0600), atomically, never replacing one.

    Raises:
        CheckpointError: ``out`` exists, or writing fails.
    """
    import torch

    _check_out(out)
    parent = os.path.dirname(os.path.abspath(out))
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fchmod(f.fileno(), 0o600)
            os.fsync(f.fileno())
        os.link(tmp, out)  # fails, rather than replaces, when out appeared meanwhile
        fsync_dir(parent)
    except FileExistsError:
        raise CheckpointError(f"{out} exists: the export never replaces anything, name a new path") from None
    except OSError as exc:
        raise CheckpointError(f"cannot write {out}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def dcp_keys(path: str) -> set[str]:
    """The top-level keys of the DCP checkpoint at ``path``.

    Raises:
        CheckpointError: ``path`` is not a DCP checkpoint directory.
    """
    import torch.distributed.checkpoint as dcp

    if not os.path.isfile(os.path.join(path, ".metadata")):
        raise CheckpointError(f"{path} is not a DCP checkpoint (no .metadata file)")
    try:
        meta = dcp.FileSystemReader(path).read_metadata()
    except Exception as exc:  # a corrupt .metadata raises whatever unpickling raises
        raise CheckpointError(f"{path}: unreadable DCP metadata: {exc}") from None
    data = meta.planner_data or {}
    return {str(data[k][0]) if k in data else k for k in meta.state_dict_metadata}


def read_dcp(path: str, keys: Iterable[str]) -> dict[str, Any]:
    """The top-level ``keys`` of the DCP checkpoint at ``path`` as full (unsharded) values,
    read by this process alone (no collective). Keys the checkpoint lacks are absent.

    Raises:
        CheckpointError: not a DCP checkpoint, or a read fails.
    """
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    have = dcp_keys(path)
    wanted = {k for k in keys if k in have}
    out: dict[str, Any] = {}
    if not wanted:
        return out
    try:  # torch's own dcp_to_torch_save reads a whole checkpoint this way
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            _load_state_dict(out, storage_reader=FileSystemReader(path),
                             planner=_EmptyStateDictLoadPlanner(keys=wanted), no_dist=True)
    except Exception as exc:  # DCP wraps read errors in CheckpointException
        raise CheckpointError(f"cannot read the DCP checkpoint {path}: {str(exc).splitlines()[0]}") from None
    return out


def initial_state(path: str, current: dict[str, Any], sharded: Iterable[str], world: int,
                  rank: int) -> dict[str, Any]:
    """This rank's training state from the DCP checkpoint at ``path`` (``checkpoint.init_from``).

    ``current`` is the rank's ``TrainingState.state_dict()``: it names the objects to
    load (each must be a top-level key of the DCP) and keeps the RNG states. Sharded
    objects get this rank's slice (``globalize.local_object_state``); ``step``,
    ``position`` and ``extras`` come from the DCP when it has them (else 0, 0, kept).

    Raises:
        CheckpointError: not a DCP checkpoint, a registered object missing from it,
            or a read fails.
    """
    from .globalize import local_object_state

    names = list(current["objects"])
    check_init_from(path, names)
    full = read_dcp(path, names + ["step", "position", "extras"])
    sharded = set(sharded)
    layouts = current.get("shard_layouts", {})
    objects = {}
    for n in names:
        obj = _int_state_keys(full[n])
        objects[n] = (local_object_state(obj, current["objects"][n], None, layouts.get(n), world, rank)
                      if n in sharded else obj)
    return dict(current, objects=objects, step=int(full.get("step", 0)), position=int(full.get("position", 0)),
                extras=full.get("extras", current.get("extras", {})))


def check_init_from(path: str, names: Iterable[str]) -> None:
    """Raise unless ``path`` is a DCP checkpoint holding every one of ``names`` at its top.

    Raises:
        CheckpointError: not a DCP checkpoint, or a name missing (one line, naming both sides).
    """
    have = dcp_keys(path)
    missing = [n for n in names if n not in have]
    if missing:
        raise CheckpointError(f"checkpoint.init_from {path} lacks {', '.join(missing)} (it has "
                              f"{', '.join(sorted(have)) or 'nothing'}): its top-level keys must be the "
                              "registered object names")


def _int_state_keys(obj: Any) -> Any:
    """An optimizer's ``state`` is keyed by int parameter ids; DCP stores every key as a
    string. Give them back their ints where ``param_groups`` name the ids as ints."""
    if not (isinstance(obj, dict) and isinstance(obj.get("state"), dict) and isinstance(obj.get("param_groups"), list)):
        return obj
    ids = {p for g in obj["param_groups"] if isinstance(g, dict) for p in g.get("params", ())}
    if not ids or not all(isinstance(p, int) for p in ids):
        return obj
    back = lambda k: int(k) if isinstance(k, str) and k.isdigit() and int(k) in ids else k  # noqa: E731
    state = {back(k): v for k, v in obj["state"].items()}
    return dict(obj, state=state)
