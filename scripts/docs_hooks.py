"""MkDocs hook (mkdocs.yml `hooks:`): pages that are generated from the code.

``<!-- generated: cli -->`` in a page becomes the ``--help`` of ``slurm-resilience``
and of each of its commands, from ``slurm_resilience.cli.build_parser`` (argparse
only: building the parser imports no torch).
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path

MARKER_CLI = "<!-- generated: cli -->"
WIDTH = 92  # the help text's line width, fixed so the page does not follow the terminal


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:  # argparse keeps its subcommands only here
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help(parser: argparse.ArgumentParser) -> str:
    parser.formatter_class = functools.partial(parser.formatter_class, width=WIDTH)
    return parser.format_help().rstrip()


def cli_reference() -> str:
    """Markdown: the top-level help, then one section per command with its help."""
    from slurm_resilience.cli import build_parser

    top = build_parser()
    out = ["```text", _help(top), "```", ""]
    for name, sub in _subparsers(top).items():
        out += [f"## `{name}`", "", "```text", _help(sub), "```", ""]
        for inner_name, inner in _subparsers(sub).items():
            out += [f"### `{name} {inner_name}`", "", "```text", _help(inner), "```", ""]
    return "\n".join(out)


def on_config(config, **kwargs):
    root = str(Path(config["config_file_path"]).resolve().parent)
    if root not in sys.path:  # the checkout's package, installed or not
        sys.path.insert(0, root)
    return config


def on_page_markdown(markdown, page, config, files, **kwargs):
    if MARKER_CLI in markdown:
        markdown = markdown.replace(MARKER_CLI, cli_reference())
    return markdown
