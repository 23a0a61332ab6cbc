"""MkDocs hook: the command-line reference is generated from the code at build time.

A page holding the line `<!-- cli-help -->` gets, in its place, the `--help` of `python -m tracer` and of
each subcommand, rendered by the argparse parsers themselves (tracer.cli: `SUBCOMMANDS`, each module's
`build_parser`), so the page never drifts from the flags. Building a parser does not import torch.
"""
from __future__ import annotations

import importlib
import os
import sys

MARKER = "<!-- cli-help -->"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WIDTH = 110                                   # argparse wraps to $COLUMNS - 2


def _help(parser) -> str:
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(WIDTH)
    try:
        return parser.format_help()
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def cli_help_markdown() -> str:
    """One section per command: its synopsis line and its full --help in a code block."""
    if sys.path[:1] != [ROOT]:                # this checkout's tracer, not another installed one
        sys.path.insert(0, ROOT)
    import tracer.cli as cli

    sections = []
    for name, module_name in cli.SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        parser = cli.build_parser() if name == cli.DEFAULT_SUBCOMMAND else module.build_parser()
        title = f"`{module.PROG}`" + (" (the default command)" if name == cli.DEFAULT_SUBCOMMAND else "")
        sections.append(f"### {title} {{ #{name} }}\n\n{module.SUMMARY[:1].upper()}{module.SUMMARY[1:]}.\n\n"
                        f"```text\n{_help(parser).rstrip()}\n```\n")
    return "\n".join(sections)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, cli_help_markdown())
