"""`python -m tracer check MODEL --baseline PATH [--tolerance 2%] [--update-baseline] [model options]`.

Re-analyses MODEL and compares it with the baseline (see `tracer.checks.baseline`); prints which numbers
grew beyond the tolerance and the lines and layers that account for it. `--update-baseline` rewrites
the baseline from this analysis instead (any settings; the file need not exist).
Exit codes (tracer.errors.ExitCode): 0 ok, 1 regression, 2 usage (flags, missing or foreign baseline, a
baseline made with other settings, a baseline that gates nothing, model file), 3 analysis error (the
model raised or exited, or any unexpected error: never 0 or 1), 130 interrupted (see tracer.entry).
"""
from __future__ import annotations

import argparse
import sys

from tracer.checks.options import add_model_arguments, analyze_kwargs
from tracer.errors import ExitCode, UsageError


def build_check_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tracer check", description=(
        "Re-analyse MODEL and compare with a baseline written by --save-baseline: exit 1 if a peak, a "
        "phase peak, the saved bytes, the bytes live after the step or the recompute FLOPs grew beyond "
        "the tolerance, with the lines and layers that account for the growth."),
        epilog="exit codes: 0 ok, 1 regression, 2 usage error (flags, baseline, model file), 3 analysis error "
               "(the model raised or exited, or an unexpected error), 130 interrupted")
    p.add_argument("model", help="zoo name or path to a model file (as given when the baseline was saved)")
    p.add_argument("--baseline", metavar="PATH", required=True, help="baseline JSON written by --save-baseline")
    p.add_argument("--tolerance", default="2%",
                   help="allowed growth, as a percentage (2%%) or a fraction (0.02) (default 2%%)")
    p.add_argument("--update-baseline", action="store_true", help="rewrite the baseline from this analysis; exit 0")
    add_model_arguments(p)
    p.add_argument("--top", type=int, default=10, help="rows shown per diff table (default 10)")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    return p


def check_main(argv: list[str] | None = None) -> int:
    """Entry point of the `check` subcommand (argv: the arguments after `check`). Returns the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        args = build_check_parser().parse_args(argv)
    except SystemExit as exc:                      # --help (0) or a bad flag (2, message already printed)
        return int(exc.code or 0)
    from tracer.entry import run_entry_point
    return run_entry_point(lambda: _run_check(args), prog="tracer check", verbose=args.verbose)


def _run_check(args) -> int:
    import dataclasses

    from tracer.checks.baseline import (baseline_settings, compare_to_baseline, load_baseline, parse_tolerance,
                                        save_baseline)
    from tracer.pipeline import options_from_keywords, run_analysis
    from tracer.reports.check_text import render_check
    from tracer.reports.units import format_bytes

    try:
        tolerance = parse_tolerance(args.tolerance)
    except ValueError as exc:
        raise UsageError(f"--tolerance: {exc}") from exc

    options = options_from_keywords(**analyze_kwargs(vars(args)))   # every option checked before the analysis
    baseline = None if args.update_baseline else load_baseline(args.baseline)
    if baseline is not None:                 # the baseline's policies, budgets, blocks, ...: check has no flags for them
        options = dataclasses.replace(options, **baseline_settings(baseline))
    analysis = run_analysis(args.model, options)
    if args.update_baseline:
        save_baseline(analysis, args.baseline)
        peaks = ", ".join(f"{name} peak {format_bytes(p.peak_bytes)}" for name, p in analysis.policies.items())
        print(f"tracer check: wrote baseline {args.baseline} ({peaks})")
        return int(ExitCode.OK)
    result = compare_to_baseline(analysis, baseline, tolerance)
    sys.stdout.write(render_check(result, baseline_path=args.baseline, top=args.top))
    return int(ExitCode.OK if result.ok else ExitCode.BUDGET_EXCEEDED)
