"""Memory baselines: write what a later run compares against, and compare a fresh analysis with it.

    save_baseline(analysis, path, *, top=10) -> dict     writes the baseline JSON, returns what it wrote
    baseline_json(analysis, *, top=10) -> dict           the same, without writing
    load_baseline(path) -> dict                          reads and checks the format (UsageError if not one)
    compare_to_baseline(analysis, baseline, tolerance=0.02) -> CheckResult
    parse_tolerance("2%") -> 0.02

A baseline file is the JSON report (schema 1, `tracer.reports.json_report`, with the tracer and torch
versions) plus a `baseline` section:
    baseline: {format_version: 1, options: {<AnalysisOptions field>: value}, policies: {<policy>: {
        numbers: {peak_bytes, phases.<phase>.peak_bytes, saved_bytes, saved_activation_bytes, end_bytes,
                  recompute_flops (only when the policy has one)},
        by_category_at_peak: {<category>: bytes},
        lines:  [{key, label, code, bytes_at_peak, saved_bytes}]      every line live at the peak
        layers: [{layer, bytes_at_peak, saved_bytes}]}}}

Comparison contract:
  * `load_baseline` checks the whole file: schema_version, format_version, every number a count, every row
    shaped as above, at least one policy with numbers; anything else is a UsageError naming what is wrong.
    A comparison that gates no number (no policy of the baseline was analysed) is a UsageError too: a
    check that compares nothing could only pass. `tracer check` analyses with the options the baseline
    records (`baseline.options`: every AnalysisOptions field the step was made with, so a model file's
    own optimizer, loss or config replays as it was; older baselines without it are read from `config`);
    a flag given replaces one, and the comparison reports it instead of refusing it.
  * The config (model, batch, seq, precision, optimizer, step, zero_grad_set_to_none, capture_path) must
    match; otherwise UsageError naming each setting that differs. Capture paths that build the joint
    graph (aot-joint, export-joint, compile-joint) count as one: they give the same graph, and so does the
    eager-only step run op by op where it stands for the graph's (capture/dispatch.py `VOUCHED_PATH`). Different tracer or torch versions are
    allowed and reported in `notes` (torch controls some of the numbers).
  * Gated numbers are the `numbers` above. One regresses when `current > baseline * (1 + tolerance)`
    (from a baseline of 0, any growth regresses); it improves when `current < baseline * (1 - tolerance)`.
  * The diff tables (lines, layers, bill categories at the peak) list every row whose bytes at the peak
    or saved bytes changed, largest growth first. They explain a change; they are not gated.
  * A line is identified by (file, function, code without a trailing comment), not by its number, so
    editing a file above a line does not make it look new; identical statements in one function merge. Files are named
    relative to the model file's directory, else to the directory holding the `tracer` package, else
    to the current directory, else absolutely, so a baseline made in one checkout compares in another.
Not handled: `foreach` is not part of the captured config (`StepConfig`), so a baseline made with the
other setting is not refused; its effect shows as changed numbers.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re

from tracer.errors import UsageError
from tracer.passes.analysis import Analysis, PolicyAnalysis
from tracer.policies import parse_policy_label
from tracer.reports.json_report import SCHEMA_VERSION

FORMAT_VERSION = 1


@dataclasses.dataclass(frozen=True)
class NumberChange:
    policy: str
    metric: str                       # "peak_bytes", "phases.backward.peak_bytes", "recompute_flops", ...
    baseline: int
    current: int

    @property
    def name(self) -> str:
        return f"{self.policy}.{self.metric}"

    @property
    def delta(self) -> int:
        return self.current - self.baseline

    @property
    def growth(self) -> float:
        """Relative change; +inf when growing from 0."""
        if self.baseline == 0:
            return 0.0 if self.current == 0 else math.inf
        return self.delta / self.baseline


@dataclasses.dataclass(frozen=True)
class RowChange:
    key: str                          # line identity, layer name or bill category
    label: str                        # "model.py:19", "blocks.0", "activation"
    code: str | None
    baseline_bytes: int               # bytes at the peak
    current_bytes: int
    baseline_saved: int
    current_saved: int

    @property
    def delta_bytes(self) -> int:
        return self.current_bytes - self.baseline_bytes

    @property
    def delta_saved(self) -> int:
        return self.current_saved - self.baseline_saved


@dataclasses.dataclass(frozen=True)
class PolicyDiff:
    policy: str
    lines: tuple[RowChange, ...]      # changed rows, largest growth at the peak first
    layers: tuple[RowChange, ...]
    categories: tuple[RowChange, ...]


@dataclasses.dataclass(frozen=True)
class CheckResult:
    config: tuple[tuple[str, object], ...]
    tolerance: float
    numbers: tuple[NumberChange, ...]        # every gated number, in baseline order
    regressions: tuple[NumberChange, ...]    # grew beyond the tolerance
    improvements: tuple[NumberChange, ...]   # shrank beyond the tolerance
    diffs: tuple[PolicyDiff, ...]
    notes: tuple[str, ...]                   # version or parameter-count changes, policies added or gone

    @property
    def ok(self) -> bool:
        return not self.regressions


def parse_tolerance(text: str | float) -> float:
    """'2%' -> 0.02, '0.5%' -> 0.005, '0.02' -> 0.02, 0 -> 0.0. Raises ValueError otherwise (a bare number
    of 1 or more is refused as ambiguous)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%?)\s*", str(text))
        if not match:
            raise ValueError(f"cannot read tolerance {text!r}; write a percentage (2%) or a fraction (0.02)")
        value = float(match.group(1)) / (100.0 if match.group(2) else 1.0)
        if not match.group(2) and value >= 1:
            raise ValueError(f"tolerance {text!r} is ambiguous; write {text}% or a fraction below 1")
    if value < 0 or math.isnan(value) or math.isinf(value):
        raise ValueError(f"tolerance must be a non-negative percentage or fraction, not {text!r}")
    return value


def baseline_json(analysis: Analysis, *, top: int = 10) -> dict:
    import torch

    import tracer
    from tracer.reports.json_report import report_json

    versions = {"tracer_version": tracer.__version__, "torch_version": torch.__version__}
    data = report_json(analysis, top=top, versions=versions)
    model_dir = _model_dir(analysis.graph)
    data["baseline"] = {"format_version": FORMAT_VERSION, "options": analysis.options,
                        "policies": {name: _policy_record(p, model_dir) for name, p in analysis.policies.items()}}
    return data


def save_baseline(analysis: Analysis, path: str, *, top: int = 10) -> dict:
    """Write the baseline JSON to `path`. Raises UsageError if it cannot be written."""
    data = baseline_json(analysis, top=top)
    from tracer.outputs import write_output
    write_output(path, json.dumps(data, indent=2) + "\n", what="baseline")
    return data


MAX_BASELINE_BYTES = 256 << 20
_REWRITE = "write it with --save-baseline PATH or tracer check --update-baseline"


def load_baseline(path: str) -> dict:
    """Read a baseline file and check its whole structure (see the module docstring): UsageError naming
    the first thing wrong if it is missing, not JSON, of another schema or format version, malformed, or
    gates no number (a baseline with no policy compares nothing, so it could only ever pass)."""
    try:
        if os.path.getsize(path) > MAX_BASELINE_BYTES:
            raise UsageError(f"{path} is over {MAX_BASELINE_BYTES >> 20} MiB: not a tracer baseline", hint=_REWRITE)
        with open(path, encoding="utf-8") as f:
            data = json.load(f, parse_constant=_refuse_constant)
    except FileNotFoundError as exc:
        raise UsageError(f"baseline not found: {path}", hint=_REWRITE) from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(f"cannot read baseline {path}: {type(exc).__name__}: {exc}") from exc
    problem = _baseline_problem(data)
    if problem:
        raise UsageError(f"{path} is not a tracer baseline (schema {SCHEMA_VERSION}, format "
                         f"{FORMAT_VERSION}): {problem}", hint=_REWRITE)
    return data


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a number a baseline holds")


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _baseline_problem(data) -> str | None:
    """What is wrong with a parsed baseline, or None."""
    from tracer.reports.json_report import SCHEMA_VERSION as report_schema

    if not isinstance(data, dict):
        return f"the top level is a {type(data).__name__}, not an object"
    if data.get("schema_version") != report_schema:
        return f"schema_version {data.get('schema_version')!r} (this tracer reads {report_schema})"
    if not isinstance(data.get("config"), dict):
        return "no config object"
    section = data.get("baseline")
    if not isinstance(section, dict):
        return "no baseline section"
    if section.get("format_version") != FORMAT_VERSION:
        return f"baseline.format_version {section.get('format_version')!r} (this tracer reads {FORMAT_VERSION})"
    if "options" in section and not isinstance(section["options"], dict):
        return "baseline.options is not an object"
    policies = section.get("policies")
    if not isinstance(policies, dict):
        return "baseline.policies is not an object"
    if not policies:
        return "baseline.policies is empty: it gates nothing"
    for name, record in policies.items():
        where = f"baseline.policies.{name}"
        if not isinstance(record, dict):
            return f"{where} is not an object"
        numbers = record.get("numbers")
        if not isinstance(numbers, dict) or not numbers:
            return f"{where}.numbers is missing or empty: it gates nothing"
        bad = next((k for k, v in numbers.items() if not _is_count(v)), None)
        if bad is not None:
            return f"{where}.numbers.{bad} is {numbers[bad]!r}, not a byte or FLOP count"
        categories = record.get("by_category_at_peak")
        if not isinstance(categories, dict) or not all(_is_count(v) for v in categories.values()):
            return f"{where}.by_category_at_peak is not an object of byte counts"
        for table, key in (("lines", "key"), ("layers", "layer")):
            rows = record.get(table)
            if not isinstance(rows, list):
                return f"{where}.{table} is not a list"
            for i, row in enumerate(rows):
                if not (isinstance(row, dict) and isinstance(row.get(key), str) and _is_count(row.get("bytes_at_peak"))
                        and _is_count(row.get("saved_bytes"))):
                    return f"{where}.{table}[{i}] needs {key} (text), bytes_at_peak and saved_bytes (counts)"
                for text in ("label", "code"):
                    if row.get(text) is not None and not isinstance(row.get(text), str):
                        return f"{where}.{table}[{i}].{text} is not text"
    return None


def compare_to_baseline(analysis: Analysis, baseline: dict, tolerance: float | str = 0.02, *,
                        overridden: tuple[str, ...] = ()) -> CheckResult:
    """Compare `analysis` with a loaded baseline. Raises UsageError if the configs differ in a setting
    not named in `overridden` (config keys the user chose to change: reported as notes)."""
    tol = parse_tolerance(tolerance)
    current = baseline_json(analysis, top=0)
    chosen = _refuse_config_mismatch(baseline.get("config", {}), current["config"], overridden)
    notes = [f"{key} differs: baseline {baseline.get(key)}, now {current[key]}"
             for key in ("tracer_version", "torch_version", "parameter_count") if baseline.get(key) != current[key]]
    notes += [f"{difference}: given on the command line" for difference in chosen]
    old_policies = baseline["baseline"]["policies"]
    new_policies = current["baseline"]["policies"]
    notes += [f"policy {name} is in the baseline but was not analysed"
              for name in old_policies if name not in new_policies]
    notes += [f"policy {name} is new (not in the baseline)" for name in new_policies if name not in old_policies]
    numbers, diffs = [], []
    for name, old in old_policies.items():
        new = new_policies.get(name)
        if new is None:
            continue
        for metric, before in old["numbers"].items():
            if metric in new["numbers"]:
                numbers.append(NumberChange(name, metric, int(before), int(new["numbers"][metric])))
            else:
                notes.append(f"{name}.{metric} is in the baseline but not in this analysis")
        diffs.append(PolicyDiff(
            policy=name,
            lines=_diff_rows(_rows(old["lines"], "key"), _rows(new["lines"], "key")),
            layers=_diff_rows(_rows(old["layers"], "layer"), _rows(new["layers"], "layer")),
            categories=_diff_rows(_category_rows(old), _category_rows(new))))
    if not numbers:
        raise UsageError("the comparison with the baseline gates no number (" + "; ".join(notes or ["no policy"])
                         + "): it could only pass", hint="analyse the baseline's policies, or rewrite it with "
                                                         "--update-baseline")
    regressions = tuple(n for n in numbers if n.current > n.baseline * (1 + tol))
    improvements = tuple(n for n in numbers if n.current < n.baseline * (1 - tol))
    return CheckResult(config=tuple(current["config"].items()), tolerance=tol, numbers=tuple(numbers),
                       regressions=regressions, improvements=improvements, diffs=tuple(diffs), notes=tuple(notes))


def _policy_record(result: PolicyAnalysis, model_dir: str | None) -> dict:
    numbers = {"peak_bytes": result.peak_bytes}
    numbers.update({f"phases.{name}.peak_bytes": p.peak_bytes for name, p in result.phases.items()})
    numbers.update(saved_bytes=result.saved.total_bytes, saved_activation_bytes=result.saved.activation_bytes,
                   end_bytes=result.end_bytes)
    recompute_flops = getattr(result, "recompute_flops", None)
    if recompute_flops is not None:
        numbers["recompute_flops"] = int(recompute_flops)
    lines: dict[str, dict] = {}
    for row in result.at_peak.lines:
        key, label, code = _line_identity(row, model_dir)
        entry = lines.setdefault(key, {"key": key, "label": label, "code": code, "bytes_at_peak": 0, "saved_bytes": 0})
        entry["bytes_at_peak"] += row.bytes_at_peak
        entry["saved_bytes"] += row.saved_bytes
    return {
        "numbers": numbers,
        "by_category_at_peak": dict(result.at_peak.by_category),
        "lines": list(lines.values()),
        "layers": [{"layer": r.layer, "bytes_at_peak": r.bytes_at_peak, "saved_bytes": r.saved_bytes}
                   for r in result.at_peak.layers],
    }


def _line_identity(row, model_dir: str | None) -> tuple[str, str, str | None]:
    if row.source is None:
        return row.label, row.label, None
    file = portable_path(row.source.file, model_dir)
    code = re.sub(r"\s*#[^'\"]*$", "", row.source.code)           # a trailing comment is not the line's identity
    return f"{file}::{row.source.function}::{code}", f"{file}:{row.source.line}", code


def portable_path(file: str, model_dir: str | None) -> str:
    """`file` relative to the model file's directory, the directory holding the tracer package, or the
    current directory (the first that contains it), else absolute."""
    import tracer

    path = os.path.abspath(file)
    for root in (model_dir, os.path.dirname(os.path.dirname(os.path.abspath(tracer.__file__))), os.getcwd()):
        if root and os.path.commonpath([path, root]) == root:
            return os.path.relpath(path, root)
    return path


def _model_dir(graph) -> str | None:
    """Directory of the model file, from the captured source lines (so it does not depend on the current
    directory at save time): the file at the model's path, else the only file with its name."""
    model = graph.config.model
    if not (model.endswith(".py") or os.sep in model):
        return None                                   # a zoo name
    files = {op.source.file for op in graph.ops if op.source is not None}
    named = [f for f in files if os.path.basename(f) == os.path.basename(model)]
    if os.path.abspath(model) not in files and len(named) == 1:
        return os.path.dirname(named[0])
    return os.path.dirname(os.path.abspath(model))


def _refuse_config_mismatch(old: dict, new: dict, overridden: tuple[str, ...] = ()) -> list[str]:
    """The differences in `overridden` keys (returned); any other difference raises UsageError."""
    def norm(key, value):
        if key == "capture_path" and isinstance(value, str):
            # every graph front end gives the same joint graph, and so does the eager-only step run op by op
            # where it stands for it (VOUCHED_PATH); only the dispatch fallback models less
            return value if value.startswith("dispatch") else "joint graph"
        return os.path.normpath(value) if key == "model" and isinstance(value, str) and value.endswith(".py") else value

    def same(key, a, b):
        if norm(key, a) == norm(key, b):
            return True
        if key == "model" and isinstance(a, str) and isinstance(b, str) and a.endswith(".py"):
            try:                       # the same file reached by another relative path
                return os.path.samefile(a, b)
            except OSError:
                return False
        return False

    keys = [key for key in dict.fromkeys([*old, *new]) if key in old or not _settings_only(key)]
    differ = {key: f"{key} (baseline {old.get(key)!r}, now {new.get(key)!r})"
              for key in keys if not same(key, old.get(key), new.get(key))}
    refused = [text for key, text in differ.items() if key not in overridden]
    if refused:
        raise UsageError("the baseline was made with other settings: " + "; ".join(refused),
                         hint="run `tracer check` without those flags (it takes the baseline's settings), or "
                              "rewrite the baseline with --update-baseline")
    return [text for key, text in differ.items() if key in overridden]


def _settings_only(key: str) -> bool:
    """Settings an older baseline did not record (tracer.pipeline.AnalysisOptions.settings): absent there,
    they are not compared."""
    return key not in STEP_CONFIG_KEYS


STEP_CONFIG_KEYS = ("model", "batch", "seq", "precision", "optimizer", "step", "zero_grad_set_to_none",
                    "capture_path", "target")


def options_from_baseline(baseline: dict, given: dict):
    """The AnalysisOptions a baseline was made with (its JSON config), with the `given` AnalysisOptions
    fields replacing its values. Returns (options, the config keys `given` changed)."""
    from tracer.pipeline import AnalysisOptions

    fields = {f.name for f in dataclasses.fields(AnalysisOptions)}
    options = baseline.get("baseline", {}).get("options")
    if isinstance(options, dict) and options:
        recorded = {key: value for key, value in options.items() if key in fields}
    else:                                                # a baseline from before the options were recorded
        recorded = {key: value for key, value in baseline.get("config", {}).items()
                    if key in fields and value is not None}
        if recorded.get("optimizer") == CUSTOM_OPTIMIZER:
            del recorded["optimizer"]                    # the model file's make_optimizer: the option is unused
    for key, value in list(recorded.items()):
        if isinstance(value, list):
            recorded[key] = tuple(value)
    if "policies" not in recorded:                       # a baseline from before settings were recorded
        labels = list(baseline.get("baseline", {}).get("policies", {}))
        parsed = [parse_policy_label(label) for label in labels]
        recorded["policies"] = tuple(dict.fromkeys(name for name, _ in parsed)) or ("eager",)
        budgets = tuple(budget for _, budget in parsed if budget is not None)
        if budgets:
            recorded["memory_budgets"] = budgets
    if "gpu" in given and "target" not in given and isinstance(recorded.get("target"), str):
        recorded["target"] = recorded["target"].partition(":")[0]      # the given GPU replaces the recorded one
    options = AnalysisOptions(**{**recorded, **given})
    changed = [key for name, value in given.items() if recorded.get(name, _MISSING) != value
               for key in _CONFIG_KEYS.get(name, (name,))]
    return options, tuple(changed)


_MISSING = object()
CUSTOM_OPTIMIZER = "custom"       # the captured config's optimizer when the model file defines make_optimizer
_CONFIG_KEYS = {"gpu": ("target",), "capture": ("capture", "capture_path"),   # option -> the config keys it changes
                "policies": ("policies", "memory_budgets"), "memory_budgets": ("memory_budgets",)}


def _rows(records: list[dict], key_field: str) -> dict[str, tuple[str, str | None, int, int]]:
    return {r[key_field]: (r.get("label", r[key_field]), r.get("code"), r["bytes_at_peak"], r["saved_bytes"])
            for r in records}


def _category_rows(record: dict) -> dict[str, tuple[str, None, int, int]]:
    return {cat: (cat, None, nbytes, 0) for cat, nbytes in record["by_category_at_peak"].items()}


def _diff_rows(old: dict, new: dict) -> tuple[RowChange, ...]:
    rows = []
    for key in dict.fromkeys([*old, *new]):
        label, code, before, before_saved = old.get(key, (None, None, 0, 0))
        new_label, new_code, after, after_saved = new.get(key, (None, None, 0, 0))
        if (before, before_saved) != (after, after_saved):
            rows.append(RowChange(key, new_label or label, new_code or code, before, after, before_saved, after_saved))
    return tuple(sorted(rows, key=lambda r: (-r.delta_bytes, -r.delta_saved, r.key)))
