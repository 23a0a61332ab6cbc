"""Memory checks for CI, without a GPU: baselines, `tracer check`, and the `memory_budget` pytest marker.

    save_baseline(analysis, path, *, top=10) -> dict
    load_baseline(path) -> dict
    compare_to_baseline(analysis, baseline, tolerance=0.02) -> CheckResult
    parse_tolerance(text) -> float
    check_main(argv) -> int                       the `check` subcommand (tracer.cli.check)
    add_model_arguments(parser); analyze_kwargs(values) -> dict   the model options, defined once
The pytest plugin is `tracer.checks.plugin` (entry point `pytest11`). Importing this package does not
import torch.
"""
from tracer.checks.baseline import (CheckResult, NumberChange, PolicyDiff, RowChange, compare_to_baseline,
                                    load_baseline, parse_tolerance, save_baseline)
from tracer.checks.options import MODEL_OPTIONS, add_model_arguments, analyze_kwargs

__all__ = ["CheckResult", "NumberChange", "PolicyDiff", "RowChange", "compare_to_baseline", "load_baseline",
           "parse_tolerance", "save_baseline", "check_main", "MODEL_OPTIONS", "add_model_arguments",
           "analyze_kwargs"]


def check_main(argv: list[str] | None = None) -> int:
    from tracer.cli.check import check_main as main     # tracer.cli imports this package: not at import time
    return main(argv)
