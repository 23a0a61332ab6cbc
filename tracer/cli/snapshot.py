"""`python -m tracer snapshot STEP.pickle [--json PATH]`: read a real CUDA memory snapshot (the pickle
torch.cuda.memory._dump_snapshot writes) as plain data: peak, phases, bytes live before the step, reserved
memory, top lines. (`--export-snapshot PATH` of the analysis writes the predicted one.)"""
from __future__ import annotations

import argparse
import os
import sys

from tracer.errors import ExitCode, UsageError

PROG = "python -m tracer snapshot"
SUMMARY = "read a real CUDA memory snapshot (.pickle)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=(
        "Read a real CUDA memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes): peak, phases, "
        "bytes live before the step, reserved memory, top lines. The pickle is loaded as plain data only."))
    p.add_argument("path", help="snapshot pickle")
    p.add_argument("--json", metavar="PATH", help="write the reading as JSON (same conventions as the prediction)")
    p.add_argument("--top", type=int, default=10, help="number of source lines to show (default 10)")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args) -> int:
    from tracer.cli.args import check_output_paths
    from tracer.outputs import write_output
    from tracer.reports.snapshot_text import render_snapshot, snapshot_json
    from tracer.snapshots.reader import read_snapshot

    check_output_paths(args)
    if not os.path.isfile(args.path):
        raise UsageError(f"snapshot file not found: {args.path}")
    reading = read_snapshot(args.path)
    sys.stdout.write(render_snapshot(reading, top=args.top))
    if args.json:
        import json
        write_output(args.json, json.dumps(snapshot_json(reading, top=args.top), indent=2), what="--json")
    return int(ExitCode.OK)
