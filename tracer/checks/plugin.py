"""pytest plugin (entry point `pytest11`, name `tracer`): the `memory_budget` marker.

    @pytest.mark.memory_budget(model="model.py", peak="7.5GiB", seq=1024, batch=16)
    def test_fits():
        ...

    @pytest.mark.memory_budget(model="llama-88m-debug", activation="1MiB", optimizer_state="2MiB",
                               policy="eager", precision="bf16", seq=64)
    def test_activations(): ...

After the test body passes, the plugin analyses one training step of `model` (tracer.analyze, on CPU,
no GPU) and fails the test if a budget is exceeded; the message names every exceeded budget, the peak's
phase and op, and the top lines live at the peak.

Marker keywords:
  model       zoo name, or path to a model file. A relative path is looked up next to the test file
              first, then in the current directory.
  peak        budget for the peak bytes of the step.
  parameter, gradient, optimizer_state, activation, temporary, input
              budgets for that category of the bill at the peak.
  policy      which policy's analysis to check (default "eager").
  batch, seq, precision, optimizer, foreach, step, zero_grad
              the model options of `python -m tracer` (defaults 2, 1024, "fp32", "adamw", None (torch's default for the target), "steady",
              "none").
Every `memory_budget` marker on a test is checked (stacked markers, class- and module-level
`pytestmark`); the test fails if any one fails. At least one budget is required per marker. A budget is bytes (int) or a size string read by
`tracer.reports.units.parse_bytes` ("7.5GiB", "512 MB", "1024"). A bad keyword or value, an unknown
policy, a missing model file or an analysis error fails the test with one line saying what to fix.
Analyses are cached for the session by (model, options): several budgets on one model cost one analysis.
Nothing here imports torch until a marked test runs.
"""
from __future__ import annotations

import os

import pytest

from tracer.checks.options import MODEL_DEFAULTS
from tracer.passes.attribution import CATEGORIES

# the bill's categories a marker can budget: all but what the training loop holds (caller_held)
BUDGET_CATEGORIES = tuple(c for c in CATEGORIES if c != "caller_held")
MARKER_HELP = ("memory_budget(model, peak=None, <category>=None, policy='eager', "
               + ", ".join(f"{name}={MODEL_DEFAULTS[name]!r}"
                           for name in ("batch", "seq", "precision", "optimizer", "foreach", "step", "zero_grad"))
               + "): fail the test if one training step of `model` exceeds a memory budget (tracer, no GPU)")
_CACHE = pytest.StashKey[dict]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", MARKER_HELP)
    config.stash[_CACHE] = {}


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    result = yield
    messages = []
    for marker in item.iter_markers("memory_budget"):      # every marker: stacked, class- and module-level
        message = check_budget_marker(marker.args, marker.kwargs, test_dir=os.path.dirname(str(item.path)),
                                      cache=item.config.stash[_CACHE])
        if message:
            messages.append(message)
    if messages:
        pytest.fail("\n".join(messages), pytrace=False)
    return result


def check_budget_marker(args: tuple, kwargs: dict, *, test_dir: str, cache: dict | None = None) -> str | None:
    """The failure message for one `memory_budget` marker, or None when every budget holds."""
    from tracer.errors import TracerError

    try:
        model, policy, options, budgets = _read_marker(args, kwargs, test_dir)
        from tracer.policies import POLICIES
        if policy not in POLICIES:
            return f"memory_budget: unknown policy {policy!r}; valid policies: {', '.join(POLICIES)}"
        key = (model, policy, tuple(sorted(options.items())))
        analysis = cache.get(key) if cache is not None else None
        if analysis is None:
            import tracer
            analysis = tracer.analyze(model, policies=(policy,), **options)
            if cache is not None:
                cache[key] = analysis
    except TracerError as exc:
        return f"memory_budget: {exc}"
    except Exception as exc:  # noqa: BLE001 - an unexpected error fails the test with one line, never passes it
        return f"memory_budget: internal error: {type(exc).__name__}: {exc} (run tracer on the model with --verbose)"
    return _budget_message(model, policy, options, analysis.policies[policy], budgets)


def _read_marker(args: tuple, kwargs: dict, test_dir: str):
    from tracer.checks.options import OPTION_NAMES, analyze_kwargs
    from tracer.errors import UsageError
    from tracer.models import ZOO
    from tracer.reports.units import parse_bytes

    kwargs = dict(kwargs)
    if args:
        raise UsageError("memory_budget takes keyword arguments only",
                         hint='e.g. memory_budget(model="model.py", peak="2GiB")')
    model = kwargs.pop("model", None)
    if not isinstance(model, str):
        raise UsageError("memory_budget needs model=<zoo name or model file path>")
    if model not in ZOO and not os.path.isabs(model) and os.path.exists(os.path.join(test_dir, model)):
        model = os.path.join(test_dir, model)
    policy = kwargs.pop("policy", "eager")
    options = analyze_kwargs({k: kwargs.pop(k) for k in OPTION_NAMES if k in kwargs})
    budgets: dict[str, int] = {}
    for name in ("peak",) + BUDGET_CATEGORIES:
        if name in kwargs:
            value = kwargs.pop(name)
            try:
                budgets[name] = value if isinstance(value, int) and not isinstance(value, bool) else parse_bytes(value)
            except (TypeError, ValueError) as exc:
                raise UsageError(f"memory_budget {name}={value!r}: {exc}") from exc
    if kwargs:
        raise UsageError(f"memory_budget got unknown keyword(s) {', '.join(sorted(kwargs))}",
                         hint="valid: model, policy, peak, " + ", ".join(BUDGET_CATEGORIES + OPTION_NAMES))
    if not budgets:
        raise UsageError("memory_budget needs a budget: peak= or one of " + ", ".join(BUDGET_CATEGORIES))
    return model, policy, options, budgets


def _budget_message(model: str, policy: str, options: dict, result, budgets: dict[str, int]) -> str | None:
    from tracer.reports.units import format_bytes

    actual = {"peak": result.peak_bytes, **result.at_peak.by_category}
    over = [f"  {name} {format_bytes(actual[name])} ({actual[name]:,} B) > budget {format_bytes(limit)} ({limit:,} B)"
            for name, limit in budgets.items() if actual[name] > limit]
    if not over:
        return None
    op = result.peak_op
    from tracer.reports.line_table import model_dir, short_label, short_path
    here = model_dir(model)
    where = f" {short_path(op.source.file, here)}:{op.source.line}" if op.source else ""
    out = [f"memory budget exceeded: {model} (policy {policy}, batch {options['batch']}, seq {options['seq']}, "
           f"{options['precision']}); peak in {result.peak_phase} at {op.target}{where}", *over,
           "top lines at the peak:"]
    for row in result.at_peak.lines[:5]:
        code = f"  {row.source.code}" if row.source and row.source.code else ""
        saved = f"(saved {format_bytes(row.saved_bytes)})"
        out.append(f"  {format_bytes(row.bytes_at_peak):>12} {saved:>20}  {short_label(row.label, here)}{code}")
    return "\n".join(out)
