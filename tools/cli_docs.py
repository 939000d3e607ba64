"""Render every `opentinker` command's help, from the CLI's own argparse parser, as markdown.

The docs' CLI reference (`reference/cli.md`) ends with this, appended at build time by
`tools/docs_hooks.py`, so the page lists exactly the commands and options the parser has.
Run by hand to see it: `.venv/bin/python tools/cli_docs.py`.
"""

from __future__ import annotations

import argparse
import os
import sys


def _commands(
    parser: argparse.ArgumentParser, path: str
) -> list[tuple[str, argparse.ArgumentParser]]:
    """(command path, parser) for the parser and every sub-command under it, depth first."""
    found = [(path, parser)]
    for action in parser._actions:  # argparse keeps sub-parsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found += _commands(child, f"{path} {name}")
    return found


def render() -> str:
    """A section a command: its help as `opentinker ... --help` prints it, 100 columns wide."""
    os.environ["COLUMNS"] = "100"  # argparse wraps to the terminal's width; the page's is fixed
    from opentinker.cli import build_parser

    out = ["## Every command", "", "Generated from the CLI's parser (`tools/cli_docs.py`).", ""]
    for path, parser in _commands(build_parser(), "opentinker"):
        out += [f"### `{path}`", "", "```text", parser.format_help().rstrip(), "```", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.stdout.write(render())
