"""Command line: `python -m tracer [MODEL] [options]`. A thin layer: parse, call the library, render.

Exit codes (tracer.errors.ExitCode): 0 ok, 1 a memory check failed, 2 usage error (bad flags, missing
or invalid model file, unknown zoo name), 3 analysis error (forward raised, export failed).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from tracer.errors import ExitCode, TracerError
from tracer.models import DEFAULT_MODEL, ZOO

EPILOG = f"""subcommand: python -m tracer snapshot STEP.pickle [--json PATH]  (read a real CUDA memory snapshot)
zoo models: {', '.join(sorted(ZOO))}
exit codes: 0 ok, 1 memory check failed, 2 usage error (flags, model file, zoo name), 3 analysis error"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tracer", description=(
        "Predict the memory of one training step (forward, loss, backward, optimizer step) without a GPU: "
        "the peak, its phase, the bill by category, and the lines and layers holding memory at the peak."),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"zoo name or path to a model file (default: {DEFAULT_MODEL})")
    p.add_argument("--batch", type=int, default=2, help="batch size passed to example_batch (default 2)")
    p.add_argument("--seq", type=int, default=1024, help="sequence length passed to example_batch (default 1024)")
    p.add_argument("--precision", choices=("fp32", "bf16", "bf16-pure"), default="fp32",
                   help="fp32; bf16 = torch.autocast(bfloat16) around forward and loss with fp32 weights; "
                        "bf16-pure = bf16 weights and inputs, no autocast (default fp32)")
    p.add_argument("--optimizer", choices=("adamw", "sgd", "none"), default="adamw",
                   help="optimizer used when the model file defines no make_optimizer (default adamw; "
                        "sgd has momentum 0.9)")
    p.add_argument("--foreach", action=argparse.BooleanOptionalAction, default=True,
                   help="foreach (multi-tensor) implementation of --optimizer (default on, as on CUDA)")
    p.add_argument("--step", choices=("steady", "first"), default="steady",
                   help="steady: optimizer state exists before the step; first: it is created in step() "
                        "(default steady)")
    p.add_argument("--zero-grad", choices=("none", "zeros"), default="none",
                   help="zero_grad(set_to_none=True) (none, default) or set_to_none=False (zeros): gradients "
                        "are kept between steps and accumulated in place")
    p.add_argument("--json", metavar="PATH", help="write the versioned JSON report to PATH")
    p.add_argument("--top", type=int, default=10, help="number of source lines to show (default 10)")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    return p


def build_snapshot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tracer snapshot", description=(
        "Read a real CUDA memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes): peak, phases, "
        "bytes live before the step, reserved memory, top lines. The pickle is loaded as plain data only."))
    p.add_argument("path", help="snapshot pickle")
    p.add_argument("--json", metavar="PATH", help="write the reading as JSON (same conventions as the prediction)")
    p.add_argument("--top", type=int, default=10, help="number of source lines to show (default 10)")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["snapshot"]:
        args = build_snapshot_parser().parse_args(argv[1:])
        runner = _run_snapshot
    else:
        args = build_parser().parse_args(argv)
        runner = _run
    try:
        return runner(args)
    except TracerError as exc:
        _print_error(exc, args.verbose)
        return int(exc.exit_code)


def _run_snapshot(args) -> int:
    import os

    from tracer.errors import UsageError
    from tracer.reports.snapshot_text import render_snapshot, snapshot_json
    from tracer.snapshots.reader import read_snapshot

    if not os.path.isfile(args.path):
        raise UsageError(f"snapshot file not found: {args.path}")
    reading = read_snapshot(args.path)
    sys.stdout.write(render_snapshot(reading, top=args.top))
    if args.json:
        _write_json(args.json, snapshot_json(reading, top=args.top))
    return int(ExitCode.OK)


def _write_json(path: str, data: dict) -> None:
    from tracer.errors import UsageError
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
    except OSError as exc:
        raise UsageError(f"cannot write --json {path}: {exc.strerror}") from exc


def _run(args) -> int:
    import torch

    import tracer
    from tracer.capture import CaptureOptions, capture_step, load_model_source
    from tracer.errors import UsageError
    from tracer.passes.analysis import analyze_graph
    from tracer.reports.json_report import report_json
    from tracer.reports.text import render_text

    if args.batch < 1 or args.seq < 1:
        raise UsageError("--batch and --seq must be positive integers")
    progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
    source = load_model_source(args.model)
    options = CaptureOptions(batch=args.batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer,
                             foreach=args.foreach, step=args.step, zero_grad_set_to_none=args.zero_grad == "none")
    progress(f"capturing {args.model} (batch {args.batch}, seq {args.seq}) under fake tensors ...")
    graph = capture_step(source, options)
    progress(f"captured {len(graph.ops)} ops; analysing ...")
    analysis = analyze_graph(graph)
    sys.stdout.write(render_text(analysis, top=args.top))
    if args.json:
        versions = {"tracer_version": tracer.__version__, "torch_version": torch.__version__}
        _write_json(args.json, report_json(analysis, top=args.top, versions=versions))
    progress.done()
    return int(ExitCode.OK)


def _print_error(exc: TracerError, verbose: bool) -> None:
    if verbose:
        import traceback
        traceback.print_exception(exc)
    print(f"tracer: error: {exc}", file=sys.stderr)


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.monotonic() - self.start:5.1f}s] {message}", file=sys.stderr)

    def done(self) -> None:
        self("done")
