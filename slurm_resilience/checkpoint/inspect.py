"""`slurm-resilience ckpt list | show | verify | prune | export DIR` — what a tier holds.

``ckpt export DIR [--step S] --format dcp|torch OUT`` writes step S (default: the
newest complete) as a DCP checkpoint or one ``torch.save`` file (``dcp_io``).

DIR is a tier root (``…/checkpoints`` on the shared filesystem, or a node-local
``…/ckpt`` directory) or a job directory (its ``checkpoints`` folder is used).
"""

from __future__ import annotations

import json
import os

from ..errors import CheckpointError, ResilienceError
from . import layout


__all__ = ["tier_root", "cmd_list", "cmd_show", "cmd_verify", "cmd_prune", "cmd_export", "add_parser"]


class _LazyManifest:
    """Import the manifest module (and with it h5py/torch) only when a ckpt command runs."""

    def __getattr__(self, name):
        from . import manifest

        return getattr(manifest, name)


mf = _LazyManifest()


def tier_root(path: str) -> str:
    """The tier root DIR names: DIR itself, or a job directory's ``checkpoints``."""
    if not os.path.isdir(path):
        raise ResilienceError(f"no such directory: {path}")
    return layout.resolve_root(path)


def _steps(root: str) -> tuple[list[int], list[int]]:
    return mf.complete_steps(root), mf.incomplete_steps(root)


def cmd_list(args) -> int:
    """``ckpt list DIR``: the tier's steps, complete or not, with sizes and ``latest``."""
    root = tier_root(args.dir)
    complete, incomplete = _steps(root)
    latest = mf.read_latest(root)
    print(f"{root}: {len(complete)} complete, {len(incomplete)} incomplete; latest {latest}")
    for step in sorted(complete + incomplete):
        if step in complete:
            man = mf.read_manifest(root, step)
            size = sum(r.nbytes for r in man.shards.values())
            mark = " <- latest" if step == latest else ""
            run = f"  run {man.run_id[:8]}" if man.run_id else "  run -"  # which run wrote it (ownership.py)
            print(f"  step {step:>8}  {man.tier:<4} complete    {len(man.shards)} shard(s) {size / 1e6:9.2f} MB"
                  f"{run}{mark}")
        else:
            print(f"  step {step:>8}       incomplete  (no manifest: never restored from)")
    return 0


def cmd_show(args) -> int:
    """``ckpt show DIR STEP``: print the step's manifest."""
    root = tier_root(args.dir)
    man = mf.read_manifest(root, args.step)
    print(man.to_json() if hasattr(man, "to_json") else json.dumps(man.__dict__, default=str))
    return 0


def cmd_verify(args) -> int:
    """``ckpt verify DIR [STEP]``: manifest, shards and every checksum; exit 1 if a step is invalid."""
    root = tier_root(args.dir)
    complete, _ = _steps(root)
    steps = [args.step] if args.step is not None else complete
    bad = 0
    for step in steps:
        problems = mf.validate_step(root, step, deep=True)
        print(f"  step {step:>8}  {'valid' if not problems else 'INVALID: ' + '; '.join(problems)}")
        bad += bool(problems)
    print(f"{len(steps) - bad} valid, {bad} invalid")
    return 1 if bad else 0


def cmd_prune(args) -> int:
    """``ckpt prune DIR``: delete old complete steps (``latest`` and the newest ``--keep`` stay)."""
    root = tier_root(args.dir)
    deleted = mf.prune(root, keep_last=args.keep, keep_every=args.keep_every)
    print(f"deleted steps: {', '.join(map(str, deleted)) or 'none'} (latest and the newest {args.keep} kept)")
    return 0


def cmd_export(args) -> int:
    """``ckpt export DIR OUT``: write one step as a DCP checkpoint or one torch.save file."""
    from .dcp_io import export_checkpoint

    root = tier_root(args.dir)
    step, out = export_checkpoint(root, args.step, args.format, args.out)
    print(f"exported step {step} of {root} as {args.format}: {out}")
    return 0


def add_parser(sub) -> None:
    """Add the ``ckpt`` subcommands to the CLI's subparsers ``sub``."""
    p = sub.add_parser("ckpt", help="inspect, verify and prune checkpoints")
    ck = p.add_subparsers(dest="ckpt_cmd", required=True)
    for name, fn in (("list", cmd_list), ("show", cmd_show), ("verify", cmd_verify), ("prune", cmd_prune)):
        q = ck.add_parser(name)
        q.add_argument("dir")
        if name == "show":
            q.add_argument("step", type=int)
        if name == "verify":
            q.add_argument("step", type=int, nargs="?")
        if name == "prune":
            q.add_argument("--keep", type=int, default=2, help="newest complete steps to keep")
            q.add_argument("--keep-every", type=int, default=None, help="also keep steps divisible by this")
        q.set_defaults(func=_wrap(fn))
    q = ck.add_parser("export", help="write a step as a DCP checkpoint or one torch.save file")
    q.add_argument("dir")
    q.add_argument("out", help="a new path: the DCP directory or the torch.save file")
    q.add_argument("--step", type=int, default=None, help="default: the newest complete step")
    q.add_argument("--format", choices=("dcp", "torch"), default="dcp")
    q.set_defaults(func=_wrap(cmd_export))


def _wrap(fn):
    def run(args) -> int:
        try:
            return fn(args)
        except CheckpointError as exc:
            raise ResilienceError(str(exc)) from None
    return run
