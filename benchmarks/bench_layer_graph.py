"""Benchmark: time to draw one layer's liveness graph as SVG, and to render the other reports.

    python benchmarks/bench_layer_graph.py [--model llama-88m] [--layer blocks.3] [--seq 256] [--batch 1]
                                           [--out DIR]

Captures the model once (not timed in the report times), then times: building the layer graph, the DOT
text, graphviz `dot -Tsvg`, the timeline PNG, the per-line table, the memory_viz export and the HTML
report. Goal (issue 4): llama-88m `blocks.3` as SVG in under 10 s. The graph's size does not depend on
--seq or --batch (only the byte labels do). Needs graphviz `dot` on PATH.
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-88m")
    p.add_argument("--layer", default="blocks.3")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--out", help="directory for the outputs (default: a temporary one)")
    args = p.parse_args()

    import tracer
    from tracer.reports.html_report import render_html
    from tracer.reports.layer_graph import build_layer_graph, layer_graph_dot, write_layer_graph
    from tracer.reports.line_table import build_line_table, render_line_table
    from tracer.reports.memviz import write_memviz_snapshot
    from tracer.reports.timeline import render_timeline

    out = Path(args.out or tempfile.mkdtemp(prefix="tracer-bench-"))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    analysis = tracer.analyze(args.model, batch=args.batch, seq=args.seq)
    print(f"capture + analysis of {args.model} (batch {args.batch}, seq {args.seq}): "
          f"{time.perf_counter() - t0:.1f} s, {len(analysis.graph.ops):,} ops")

    t0 = time.perf_counter()
    graph = build_layer_graph(analysis, args.layer)
    dot = layer_graph_dot(graph)
    t_build = time.perf_counter() - t0
    write_layer_graph(dot, out / "layer.svg")
    t_svg = time.perf_counter() - t0
    print(f"layer graph {graph.layer}: {sum(n.kind == 'op' for n in graph.nodes)} op nodes, {len(graph.edges)} edges "
          f"({len(graph.saved_storage_ids)} saved tensors); build + DOT {t_build:.2f} s, to SVG {t_svg:.2f} s "
          f"(goal < 10 s): {'ok' if t_svg < 10 else 'TOO SLOW'}")
    html_path = out / "report.html"
    for name, fn in (("timeline PNG", lambda: render_timeline(analysis, out / "timeline.png")),
                     ("per-line table", lambda: render_line_table(build_line_table(analysis))),
                     ("memory_viz export", lambda: write_memviz_snapshot(analysis, out / "predicted.pickle")),
                     ("HTML report", lambda: html_path.write_text(render_html(analysis, layer=args.layer)))):
        t0 = time.perf_counter()
        fn()
        print(f"{name}: {time.perf_counter() - t0:.2f} s")
    print(f"outputs in {out}")


if __name__ == "__main__":
    main()
