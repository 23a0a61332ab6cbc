"""`python -m tracer check MODEL --baseline PATH [--tolerance 2%] [--update-baseline] [model options]`.

Re-analyses MODEL with the settings the baseline was made with (its JSON config: batch, seq, precision,
target, policies, ...) and compares (see `tracer.checks.baseline`); prints which numbers grew beyond the
tolerance and the lines and layers that account for it. A setting given as a flag replaces the
baseline's, and the report says so. `--update-baseline` rewrites the baseline from this analysis instead
(the flags given, else the defaults; the file need not exist).
Exit codes (tracer.errors.ExitCode): 0 ok, 1 regression, 2 usage (flags, missing or foreign baseline, a
baseline made with other settings, a baseline that gates nothing, model file), 3 analysis error (the
model raised or exited, or any unexpected error: never 0 or 1), 130 interrupted (see tracer.cli.entry).
"""
from __future__ import annotations

import argparse
import os
import sys

from tracer.checks.options import MODEL_OPTIONS, analyze_kwargs, options_fields
from tracer.errors import ExitCode, UsageError

PROG = "python -m tracer check"
SUMMARY = "fail on memory regressions against a --save-baseline file"


def build_parser() -> argparse.ArgumentParser:
    from tracer.cli import args as groups

    p = argparse.ArgumentParser(prog=PROG, description=(
        "Re-analyse MODEL and compare with a baseline written by --save-baseline: exit 1 if a peak, a "
        "phase peak, the saved bytes, the bytes live after the step or the recompute FLOPs grew beyond "
        "the tolerance, with the lines and layers that account for the growth. A model option not given "
        "takes the baseline's value."),
        epilog="exit codes: 0 ok, 1 regression, 2 usage error (flags, baseline, model file), 3 analysis error "
               "(the model raised or exited, or an unexpected error), 130 interrupted")
    baseline = p.add_argument_group("baseline")
    baseline.add_argument("--baseline", metavar="PATH", required=True, help="baseline JSON written by --save-baseline")
    baseline.add_argument("--tolerance", default="2%",
                          help="allowed growth, as a percentage (2%%) or a fraction (0.02) (default 2%%)")
    baseline.add_argument("--update-baseline", action="store_true",
                          help="rewrite the baseline from this analysis; exit 0")
    groups.add_model_group(p, only_given=True,
                           model_help="zoo name or path to a model file (as given when the baseline was saved)")
    groups.add_policy_group(p, only_given=True)
    groups.add_sharding_group(p, only_given=True)
    p.add_argument("--top", type=int, default=10, help="rows shown per diff table (default 10)")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    p.add_argument("--no-cache", action="store_true", help="capture again instead of reusing a cached capture")
    return p


def parse_args(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def run(args) -> int:
    if args.no_cache:
        os.environ["TRACER_NO_CACHE"] = "1"
    return _run_check(args)


def check_main(argv: list[str] | None = None) -> int:
    """The `check` subcommand (argv: the arguments after `check`). Returns the exit code."""
    from tracer.cli import main
    return main(["check", *(sys.argv[1:] if argv is None else argv)])


def _run_check(args) -> int:
    from tracer.checks.baseline import (compare_to_baseline, load_baseline, options_from_baseline, parse_tolerance,
                                        save_baseline)
    from tracer.pipeline import default_workers, run_analysis
    from tracer.reports.check_text import render_check
    from tracer.reports.units import format_bytes

    try:
        tolerance = parse_tolerance(args.tolerance)
    except ValueError as exc:
        raise UsageError(f"--tolerance: {exc}") from exc
    given = given_options(args)
    if args.update_baseline:
        from tracer.pipeline import AnalysisOptions
        options, overridden, baseline = AnalysisOptions(**given), (), None
    else:
        baseline = load_baseline(args.baseline)
        options, overridden = options_from_baseline(baseline, given)
    analysis = run_analysis(args.model, options, workers=default_workers())
    if args.update_baseline:
        save_baseline(analysis, args.baseline)
        peaks = ", ".join(f"{name} peak {format_bytes(p.peak_bytes)}" for name, p in analysis.policies.items())
        print(f"tracer check: wrote baseline {args.baseline} ({peaks})")
        return int(ExitCode.OK)
    result = compare_to_baseline(analysis, baseline, tolerance, overridden=overridden)
    sys.stdout.write(render_check(result, baseline_path=args.baseline, top=args.top))
    return int(ExitCode.OK if result.ok else ExitCode.BUDGET_EXCEEDED)


def given_options(args) -> dict:
    """The AnalysisOptions fields the command line set (flags left out take the baseline's values)."""
    values = vars(args)
    given = {name: values[name] for name in (o.name for o in MODEL_OPTIONS) if name in values}
    if given:
        checked = analyze_kwargs({**{o.name: o.default for o in MODEL_OPTIONS}, **given})
        given = options_fields({name: checked[name] for name in given})
    if "policy" in values:
        from tracer.policies import ALL_POLICIES
        given["policies"] = ALL_POLICIES if values["policy"] == "all" else (values["policy"],)
    for name in ("hf_config", "model_args", "config_json", "hf_task", "shard", "world_size"):
        if name in values:
            given[name] = tuple(values[name]) if name in ("hf_config", "model_args") else values[name]
    return given
