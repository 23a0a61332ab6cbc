"""The HTML report: one self-contained file (inline CSS, inline SVG, a few lines of inline JS; no network).

Contract:
    render_html(analysis, *, policy="eager", layer=None, device_memory_bytes=None, top=None,
                graph_svg=None) -> str
        Sections, each a `<section id=...>`: `summary` (configuration, peak with its op and source line,
        per-phase peaks, bill at the peak), `timeline` (the matplotlib timeline as inline SVG, every
        policy), `policies` (one row per policy: peak, phase, peak op, saved bytes, per-phase peaks),
        `lines` (the per-line table of `policy`, sortable by clicking a header), `layer-graph` (the layer
        graph of `layer` as inline SVG; when graphviz `dot` is missing, the DOT text and how to install
        it). `graph_svg` lets a caller that already ran `dot` pass its SVG.
Every string from the model (file names, code, module paths) is HTML-escaped. Nothing is fetched: the
only URLs in the file are XML namespace names inside the SVGs.
"""
from __future__ import annotations

import html

import tracer
from tracer.passes.analysis import Analysis
from tracer.passes.attribution import CATEGORIES
from tracer.reports.layer_graph import DOT_INSTALL_HINT, build_layer_graph, dot_to_svg, layer_graph_dot
from tracer.reports.line_table import build_line_table, line_table_html, model_dir, short_path
from tracer.reports.units import format_flops
from tracer.reports.policy_view import policy_result, recompute_flops_by_line
from tracer.reports.timeline import timeline_svg
from tracer.reports.units import format_bytes
from tracer.stepgraph import Phase

STYLE = """
body { font: 14px/1.45 -apple-system, "Segoe UI", Helvetica, Arial, sans-serif; margin: 24px auto; max-width: 1400px;
       padding: 0 16px; color: #222; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 28px; border-bottom: 1px solid #ddd; }
.meta { color: #666; } .big { font-size: 18px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; }
th, td { border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } td.num { text-align: right; white-space: nowrap; font-variant-numeric: tabular-nums; }
table.sortable th { cursor: pointer; user-select: none; } table.sortable th:after { content: " \\2195"; color: #aaa; }
td code { white-space: pre-wrap; font-size: 12px; } td.loc { white-space: nowrap; }
.figure svg { max-width: 100%; height: auto; }
.graph { overflow: auto; max-height: 1100px; border: 1px solid #ddd; cursor: zoom-in; }
.graph.zoom { cursor: zoom-out; } .graph.zoom svg { max-width: none; }
pre { background: #f7f7f7; padding: 8px; overflow: auto; max-height: 400px; }
"""

SORT_JS = """
for (const th of document.querySelectorAll("table.sortable th")) {
  th.addEventListener("click", () => {
    const body = th.closest("table").tBodies[0], col = th.cellIndex, num = th.dataset.type === "num";
    const dir = th.dataset.dir === "desc" ? 1 : -1;
    th.dataset.dir = dir === 1 ? "asc" : "desc";
    const key = (row) => {
      const cell = row.cells[col], v = cell.dataset.sort ?? cell.textContent;
      return num ? Number(v) : v;
    };
    const rows = Array.from(body.rows).sort((a, b) => (key(a) > key(b) ? 1 : key(a) < key(b) ? -1 : 0) * dir);
    for (const row of rows) body.appendChild(row);
  });
}
for (const g of document.querySelectorAll(".graph")) g.addEventListener("click", () => g.classList.toggle("zoom"));
document.body.dataset.ready = "1";
"""


def render_html(analysis: Analysis, *, policy: str = "eager", layer: str | None = None,
                device_memory_bytes: int | None = None, top: int | None = None, graph_svg: str | None = None) -> str:
    cfg = analysis.graph.config
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>tracer: {_e(cfg.model)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>tracer report: {_e(cfg.model)}</h1>",
        f'<p class="meta">tracer {_e(tracer.__version__)}; one training step predicted from a fake-tensor capture '
        f"(no GPU used).</p>",
        _summary(analysis, policy),
        '<section id="timeline"><h2>Peak timeline</h2>',
        '<p class="meta">Live bytes while each op runs, stacked by category; shaded bands are the phases; the '
        "marker is the peak.</p>",
        f'<div class="figure">{timeline_svg(analysis, device_memory_bytes=device_memory_bytes)}</div></section>',
        _policy_table(analysis),
        _lines(analysis, policy, top),
        _layer_graph(analysis, policy, layer, graph_svg),
        f"<script>{SORT_JS}</script>",
        "</body></html>",
    ]
    return "\n".join(parts) + "\n"


def notebook_html(analysis: Analysis, *, policy: str = "eager", top: int = 10) -> str:
    """The analysis as a Jupyter cell shows it: the summary, the timeline plot, the policy table and the top
    `top` lines, in one `<div>` with the report's styles (no script: notebooks do not run it)."""
    policy = policy if policy in analysis.policies else next(iter(analysis.policies))
    cfg = analysis.graph.config
    return "\n".join([
        '<div class="tracer-report">',
        f"<style>{STYLE}</style>",
        f"<h3>tracer: {_e(cfg.model)}</h3>",
        _summary(analysis, policy),
        f'<div class="figure">{timeline_svg(analysis)}</div>',
        _policy_table(analysis),
        _lines(analysis, policy, top),
        "</div>",
    ])


def _summary(analysis: Analysis, policy: str) -> str:
    graph = analysis.graph
    cfg = graph.config
    result = policy_result(analysis, policy)
    op = result.peak_op
    where = (f" at <code>{_e(op.target)}</code>, {_e(short_path(op.source.file, model_dir(cfg.model)))}:{op.source.line} "
             f"<code>{_e(op.source.code.strip())}</code>") if op.source else f" at <code>{_e(op.target)}</code>"
    rows = "".join(f"<tr><td>{_e(cat.replace('_', ' '))}</td>{_num(result.at_peak.by_category[cat])}"
                   f'<td class="num">{_share(result.at_peak.by_category[cat], result.peak_bytes)}</td></tr>'
                   for cat in CATEGORIES)
    phases = ", ".join(f"{_e(name)} {format_bytes(p.peak_bytes)}" for name, p in result.phases.items())
    return (
        '<section id="summary"><h2>Summary</h2>'
        f"<p>batch {cfg.batch}, {_e(cfg.size_words)}, {_e(cfg.precision)}, optimizer {_e(cfg.optimizer)}, "
        f"{_e(cfg.step)} step, "
        f"zero_grad(set_to_none={cfg.zero_grad_set_to_none}); {graph.parameter_count:,} parameters; "
        f"{len(graph.ops):,} ops captured ({_e(cfg.capture_path)}).</p>"
        f'<p class="big">peak <b>{format_bytes(result.peak_bytes)}</b> ({result.peak_bytes:,} B) in '
        f"<b>{_e(result.peak_phase)}</b> (policy {_e(policy)}){where}</p>"
        f"<p>per phase: {phases}. Live before the step {format_bytes(result.start_bytes)}, after "
        f"{format_bytes(result.end_bytes)}; saved for backward {format_bytes(result.saved.activation_bytes)} of "
        f"activations (+ {format_bytes(result.saved.input_bytes)} of inputs).</p>"
        f'<table id="bill"><thead><tr><th>at the peak</th><th>bytes</th><th>share</th></tr></thead>'
        f"<tbody>{rows}</tbody></table></section>")


def _policy_table(analysis: Analysis) -> str:
    phases = [p.value for p in Phase]
    recompute = {name: recompute_flops_by_line(r) for name, r in analysis.policies.items()}
    with_recompute = any(v is not None for v in recompute.values())
    heads = (["policy", "peak", "peak phase", "peak op", "saved bytes", "saved activations"]
             + [f"{p} peak" for p in phases] + (["recompute FLOPs"] if with_recompute else []))
    body = []
    for name, r in analysis.policies.items():
        op = r.peak_op
        loc = f"{short_path(op.source.file, model_dir(analysis.graph.config.model))}:{op.source.line}" if op.source else ""
        cells = [f"<td>{_e(name)}</td>", _num(r.peak_bytes), f"<td>{_e(r.peak_phase)}</td>",
                 f"<td><code>{_e(op.target)}</code> {_e(loc)}</td>", _num(r.saved.total_bytes),
                 _num(r.saved.activation_bytes)]
        cells += [_num(r.phases[p].peak_bytes) if p in r.phases else "<td></td>" for p in phases]
        if with_recompute:
            total = getattr(r, "recompute_flops", None)
            total = sum((recompute[name] or {}).values()) if total is None else total
            cells.append(f'<td class="num" data-sort="{total}">{format_flops(total)}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return ('<section id="policies"><h2>Policies</h2><table id="policy-table" class="sortable"><thead><tr>'
            + "".join(f'<th data-type="{"text" if h in ("policy", "peak phase", "peak op") else "num"}">{_e(h)}</th>'
                      for h in heads)
            + "</tr></thead><tbody>" + "".join(body) + "</tbody></table></section>")


def _lines(analysis: Analysis, policy: str, top: int | None) -> str:
    table = build_line_table(analysis, policy)
    shown = len(table.rows) if top is None else min(top, len(table.rows))
    return ('<section id="lines"><h2>Per-line attribution</h2>'
            f'<p class="meta">Policy {_e(policy)}; {shown} of {len(table.rows)} lines. Backward memory and FLOPs '
            "count on the forward line that caused them; layers list where the line runs (repeats grouped). "
            "FLOPs marked * include ops with no FLOP formula (counted as 0). Click a header to sort.</p>"
            + line_table_html(table, top=top) + "</section>")


def _layer_graph(analysis: Analysis, policy: str, layer: str | None, graph_svg: str | None) -> str:
    g = build_layer_graph(analysis, layer, policy)
    head = (f'<section id="layer-graph"><h2>Layer graph: {_e(g.layer)}</h2>'
            '<p class="meta">Ops of the layer are nodes (view-only ops folded into their producers), tensors are '
            "edges labelled with bytes and lifetime (allocated at op #i, freed after op #j); red, wide edges are "
            "saved for backward; dashed nodes are outside the layer. Click the graph to zoom.</p>")
    dot = layer_graph_dot(g)
    svg = graph_svg if graph_svg is not None else dot_to_svg(dot)
    if svg is None:
        return (head + f"<p>graphviz <code>dot</code> is not installed, so here is the DOT text "
                f"({_e(DOT_INSTALL_HINT)}).</p><pre>{_e(dot)}</pre></section>")
    return head + f'<div class="graph figure">{svg}</div></section>'


def _num(nbytes: int) -> str:
    return f'<td class="num" data-sort="{nbytes}">{format_bytes(nbytes)}</td>'


def _share(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else ""


def _e(text) -> str:
    return html.escape(str(text))
