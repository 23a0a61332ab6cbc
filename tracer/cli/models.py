"""`python -m tracer models`: the zoo's model names, one a line with its config (imports torch: the zoo's
models are nn.Modules; the other subcommands' --help does not)."""
from __future__ import annotations

import argparse
import sys

from tracer.errors import ExitCode

PROG = "python -m tracer models"
SUMMARY = "list the zoo's model names"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="List the built-in model zoo: each name and its config. "
                                                       "Every name has a tiny -debug flavour for tests.")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args) -> int:
    from tracer.models import DEFAULT_MODEL, ZOO

    width = max(len(name) for name in ZOO)
    for name in sorted(ZOO):
        default = "  (default)" if name == DEFAULT_MODEL else ""
        sys.stdout.write(f"{name:<{width}}  {ZOO[name].description}{default}\n")
    return int(ExitCode.OK)
