"""Write every report of one analysis into a directory (what `--report DIR` produces).

Contract:
    write_report_dir(analysis, out_dir, *, policy="eager", layer=None, device_memory_bytes=None, top=None)
        -> dict[str, Path]
    creates `out_dir` if needed and writes, returning {kind: path}:
        report.html            self-contained HTML (tracer.reports.html_report)
        timeline.png, .svg     the peak timeline, every policy (tracer.reports.timeline)
        lines.txt, lines.json  the per-line table of `policy` (tracer.reports.line_table)
        layer.dot              the layer graph (tracer.reports.layer_graph); layer.svg too when graphviz
                               `dot` is installed (the HTML then inlines the same SVG)
        predicted_snapshot.pickle   the memory_viz export of `policy` (tracer.reports.memviz)
    Existing files of those names are overwritten; nothing else in `out_dir` is touched. Every file is
    made in memory first (a failing graphviz writes nothing), then the folder is written whole or not at
    all (tracer.outputs.write_output_dir: a full disk leaves it as it was).
Raises UsageError when the directory cannot be created or written.
"""
from __future__ import annotations

import json
import pickle
from pathlib import Path

from tracer.errors import UsageError
from tracer.passes.analysis import Analysis
from tracer.reports.html_report import render_html
from tracer.reports.layer_graph import dot_to_svg, render_layer_graph
from tracer.reports.line_table import build_line_table, line_table_json, render_line_table
from tracer.outputs import write_output_dir
from tracer.reports.memviz import predicted_snapshot
from tracer.reports.timeline import timeline_image


def write_report_dir(analysis: Analysis, out_dir, *, policy: str = "eager", layer: str | None = None,
                     device_memory_bytes: int | None = None, top: int | None = None) -> dict[str, Path]:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"the report directory {out} is a file", hint="name a folder for --report")
    paths = {kind: out / name for kind, name in (
        ("html", "report.html"), ("timeline_png", "timeline.png"), ("timeline_svg", "timeline.svg"),
        ("lines_txt", "lines.txt"), ("lines_json", "lines.json"), ("layer_dot", "layer.dot"),
        ("layer_svg", "layer.svg"), ("snapshot", "predicted_snapshot.pickle"))}
    images = {kind: timeline_image(analysis, fmt, device_memory_bytes=device_memory_bytes)[0]
              for kind, fmt in (("timeline_png", "png"), ("timeline_svg", "svg"))}
    table = build_line_table(analysis, policy)
    dot = render_layer_graph(analysis, layer, policy)
    svg = dot_to_svg(dot)
    texts = {"lines_txt": render_line_table(table, top=top),
             "lines_json": json.dumps(line_table_json(table, top=top), indent=2) + "\n",
             "layer_dot": dot}
    if svg is None:
        del paths["layer_svg"]
    else:
        texts["layer_svg"] = svg
    texts["html"] = render_html(analysis, policy=policy, layer=layer, device_memory_bytes=device_memory_bytes,
                                top=top, graph_svg=svg)
    images["snapshot"] = pickle.dumps(predicted_snapshot(analysis, policy), protocol=pickle.HIGHEST_PROTOCOL)
    write_output_dir(out, {paths[kind].name: data for kind, data in {**texts, **images}.items()},
                     what="the report directory")
    return paths
