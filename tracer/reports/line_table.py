"""Per-line attribution table: bytes at the peak, bytes saved for backward and FLOPs, per source line.

Contract:
    build_line_table(analysis, policy="eager") -> LineTable
        One row per source line (`file:line`, backward ops counted on the forward line that caused them)
        and per bracketed role of the attribution pass ("(parameters)", "(optimizer state)", ...):
          bytes_at_peak, saved_bytes   from the policy's `at_peak` attribution (not recomputed here);
          flops                        `tracer.passes.flops.op_flops` summed over every op on the line
                                       (forward, backward, optimizer); `unknown_flop_ops` counts the ops
                                       with no formula, which add nothing to `flops`;
          recompute_flops              the policy's `recompute_flops_by_line[label]` when the policy has
                                       that mapping (see `policy_view`), else None and no column;
          layers                       the layers (`attribution.layer_of`) of the modules of the ops on the
                                       line, numbered repeats grouped: "blocks.0-9, x10; norm".
        Rows are sorted by bytes at the peak, then saved bytes, then FLOPs, then label.
    render_line_table(table, top=None) -> str        plain text for the terminal
    line_table_json(table, top=None) -> dict         {policy, peak_bytes, has_recompute_flops, rows: [...]}
    line_table_html(table, top=None) -> str          a `<table class="sortable">` fragment; every numeric
                                                     cell carries its raw value in `data-sort`
Not handled: FLOPs of ops with no source line (they are in no row), per-line FLOPs of recomputation
unless the policy provides them.
"""
from __future__ import annotations

import dataclasses
import html
import os
import re

from tracer.passes.analysis import Analysis
from tracer.passes.attribution import layer_of
from tracer.passes.flops import op_flops
from tracer.reports.policy_view import policy_graph, policy_result, recompute_flops_by_line
from tracer.reports.units import format_bytes, format_flops
from tracer.stepgraph import SourceLoc


@dataclasses.dataclass(frozen=True)
class LineRow:
    label: str                        # "file:line" or a bracketed role like "(parameters)"
    source: SourceLoc | None
    layers: str                       # "blocks.0-9, x10"; "" when no op on the line has a module
    bytes_at_peak: int
    saved_bytes: int
    flops: int                        # over ops with a known count
    unknown_flop_ops: int
    recompute_flops: int | None


@dataclasses.dataclass(frozen=True)
class LineTable:
    policy: str
    peak_bytes: int
    rows: tuple[LineRow, ...]
    has_recompute_flops: bool
    model_dir: str | None = None      # the model file's directory: its lines print relative to it


def build_line_table(analysis: Analysis, policy: str = "eager") -> LineTable:
    result = policy_result(analysis, policy)
    graph = policy_graph(analysis, result)
    recompute = recompute_flops_by_line(result)
    acc: dict[str, dict] = {}
    for row in result.at_peak.lines:
        acc[row.label] = {"source": row.source, "bytes": row.bytes_at_peak, "saved": row.saved_bytes,
                          "flops": 0, "unknown": 0, "layers": set()}
    for op in graph.ops:
        if op.source is None:
            continue
        label = f"{op.source.file}:{op.source.line}"
        entry = acc.setdefault(label, {"source": op.source, "bytes": 0, "saved": 0, "flops": 0, "unknown": 0,
                                       "layers": set()})
        flops = op_flops(op)
        if flops is None:
            entry["unknown"] += 1
        else:
            entry["flops"] += flops
        if op.module:
            entry["layers"].add(layer_of(op.module))
    rows = [LineRow(label=label, source=e["source"], layers=group_layer_names(e["layers"]),
                    bytes_at_peak=e["bytes"], saved_bytes=e["saved"], flops=e["flops"],
                    unknown_flop_ops=e["unknown"],
                    recompute_flops=None if recompute is None else int(recompute.get(label, 0)))
            for label, e in acc.items()]
    rows.sort(key=lambda r: (-r.bytes_at_peak, -r.saved_bytes, -r.flops, r.label))
    return LineTable(policy=policy, peak_bytes=result.peak_bytes, rows=tuple(rows),
                     has_recompute_flops=recompute is not None, model_dir=model_dir(graph.config.model))


def model_dir(model: str) -> str | None:
    """The directory of a model given as a file path (None for zoo and hf: names)."""
    return os.path.dirname(os.path.abspath(model)) if model.endswith(".py") and os.path.isfile(model) else None


def group_layer_names(names) -> str:
    """{"blocks.0", ..., "blocks.9", "norm"} -> "blocks.0-9, x10; norm". Numbered layers with one prefix
    become one group (indices as ranges, then the count); other names follow, sorted."""
    numbered: dict[str, set[int]] = {}
    plain = set()
    for name in names:
        match = re.fullmatch(r"(.*)\.(\d+)", name)
        if match:
            numbered.setdefault(match.group(1), set()).add(int(match.group(2)))
        elif name:
            plain.add(name)
    parts = []
    for prefix in sorted(numbered):
        indices = sorted(numbered[prefix])
        text = f"{prefix}.{_ranges(indices)}"
        parts.append(text if len(indices) == 1 else f"{text}, x{len(indices)}")
    return "; ".join(parts + sorted(plain))


def _ranges(indices: list[int]) -> str:
    runs: list[list[int]] = []
    for i in indices:
        if runs and i == runs[-1][1] + 1:
            runs[-1][1] = i
        else:
            runs.append([i, i])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


# ---------------------------------------------------------------------------------------------- renderers

def render_line_table(table: LineTable, *, top: int | None = None) -> str:
    rows = table.rows if top is None else table.rows[:top]
    layer_width = max([len("layers")] + [len(r.layers) for r in rows])
    head = f"  {'at peak':>12} {'saved':>12} {'FLOPs':>14}"
    if table.has_recompute_flops:
        head += f" {'recompute':>14}"
    lines = [f"per-line attribution (policy {table.policy}, peak {format_bytes(table.peak_bytes)}; "
             f"{len(rows)} of {len(table.rows)} lines; * = some ops have no FLOP formula):",
             f"{head}  {'layers':<{layer_width}}  line"]
    for r in rows:
        flops = format_flops(r.flops) + ("*" if r.unknown_flop_ops else " ")
        text = f"  {format_bytes(r.bytes_at_peak):>12} {format_bytes(r.saved_bytes):>12} {flops:>14}"
        if table.has_recompute_flops:
            text += f" {format_flops(r.recompute_flops or 0):>14}"
        code = f"  {r.source.code}" if r.source and r.source.code else ""
        lines.append(f"{text}  {r.layers:<{layer_width}}  {short_label(r.label, table.model_dir)}{code}".rstrip())
    return "\n".join(lines) + "\n"


def line_table_json(table: LineTable, *, top: int | None = None) -> dict:
    rows = table.rows if top is None else table.rows[:top]
    out = []
    for r in rows:
        src = r.source
        row = {"label": r.label, "file": src.file if src else None, "line": src.line if src else None,
               "function": src.function if src else None, "code": src.code if src else None,
               "layers": r.layers, "bytes_at_peak": r.bytes_at_peak, "saved_bytes": r.saved_bytes,
               "flops": r.flops, "unknown_flop_ops": r.unknown_flop_ops}
        if table.has_recompute_flops:
            row["recompute_flops"] = r.recompute_flops
        out.append(row)
    return {"policy": table.policy, "peak_bytes": table.peak_bytes, "has_recompute_flops": table.has_recompute_flops,
            "rows": out}


def line_table_html(table: LineTable, *, top: int | None = None, table_id: str = "line-table") -> str:
    rows = table.rows if top is None else table.rows[:top]
    heads = [("line", "text"), ("code", "text"), ("layers", "text"), ("at peak", "num"), ("saved", "num"),
             ("FLOPs", "num")] + ([("recompute FLOPs", "num")] if table.has_recompute_flops else [])
    out = [f'<table class="sortable" id="{html.escape(table_id)}">',
           "<thead><tr>" + "".join(f'<th data-type="{kind}">{name}</th>' for name, kind in heads) + "</tr></thead>",
           "<tbody>"]
    for r in rows:
        code = r.source.code if r.source else ""
        cells = [f'<td class="loc" title="{html.escape(r.label)}">{html.escape(short_label(r.label, table.model_dir))}</td>',
                 f"<td><code>{html.escape(code)}</code></td>",
                 f"<td>{html.escape(r.layers)}</td>",
                 _num_cell(r.bytes_at_peak, format_bytes(r.bytes_at_peak)),
                 _num_cell(r.saved_bytes, format_bytes(r.saved_bytes)),
                 _num_cell(r.flops, format_flops(r.flops) + ("*" if r.unknown_flop_ops else ""))]
        if table.has_recompute_flops:
            cells.append(_num_cell(r.recompute_flops or 0, format_flops(r.recompute_flops or 0)))
        out.append("<tr>" + "".join(cells) + "</tr>")
    out += ["</tbody>", "</table>"]
    return "\n".join(out)


def _num_cell(value: int, text: str) -> str:
    return f'<td class="num" data-sort="{value}">{html.escape(text)}</td>'


def short_label(label: str, model_dir: str | None = None) -> str:
    """"path:line" with the path as `short_path` prints it; a "(...)" label as it is."""
    if label.startswith("("):
        return label
    path, _, line = label.rpartition(":")
    return f"{short_path(path, model_dir)}:{line}"


# the directory that holds the tracer package (its built-in models print as `tracer/models/llama.py`)
_TRACER_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def short_path(path: str, model_dir: str | None = None) -> str:
    """A file path as the reports print it: from the package root for installed packages and tracer's own
    built-in models (`torch/optim/adam.py`), relative to the working directory when under it, else relative to the model
    file's directory when under that (`model_dir`), else as given."""
    for marker in ("/site-packages/", "/dist-packages/"):
        if marker in path:
            return path.rsplit(marker, 1)[1]
    if path.startswith(_TRACER_ROOT + os.sep):       # a built-in model's file: from the package root too
        return os.path.relpath(path, _TRACER_ROOT)
    for start in (None, model_dir) if model_dir else (None,):
        try:
            rel = os.path.relpath(path, start)
        except ValueError:
            continue
        if not rel.startswith(".."):
            return rel
    return path
