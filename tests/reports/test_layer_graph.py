"""Per-layer liveness graph: DOT golden, an edge for every saved tensor of a llama-debug block, lifetimes,
folded views, recompute marking, graphviz output."""
from __future__ import annotations

import dataclasses
import re

import pytest
from golden_files import check_golden

from tracer.errors import UsageError
from tracer.passes.attribution import allocating_ops, layer_of
from tracer.passes.liveness import BEFORE_STEP
from tracer.reports.layer_graph import build_layer_graph, default_layer, dot_binary, dot_to_svg, layer_graph_dot, \
    render_layer_graph, write_layer_graph
from tracer.stepgraph import OpNode, Phase

needs_dot = pytest.mark.skipif(dot_binary() is None,
                               reason="graphviz `dot` is not installed (apt-get install graphviz)")
EDGE = re.compile(r'^  (\w+) -> (\w+) \[id="t(\d+)_\d+", label="([^"]*)"(.*)\];$', re.M)


def _saved_of_layer(analysis, layer: str, policy: str = "eager") -> set[int]:
    """Independently: saved storages made by a (non-view) op of the layer or read by a backward op of it."""
    result = analysis.policies[policy]
    graph = analysis.graph
    producers = allocating_ops(graph, result.liveness)
    out = set()
    for sid in result.saved.storage_ids:
        made_here = producers[sid] is not None and layer_of(producers[sid].module) == layer
        read_here = any(op.phase is Phase.BACKWARD and not op.is_view and layer_of(op.module) == layer
                        and sid in {v.storage_id for v in op.input_values()} for op in graph.ops)
        if made_here or read_here:
            out.add(sid)
    return out


def test_dot_golden(synthetic):
    assert default_layer(synthetic) == "blocks.1"                 # 192 B at the peak vs 96 B for blocks.0
    check_golden("layer_graph_blocks1.dot", render_layer_graph(synthetic))
    check_golden("layer_graph_blocks0.dot", render_layer_graph(synthetic, "blocks.0"))


@pytest.mark.parametrize("layer", [None, "blocks.1"])
def test_llama_debug_block_has_an_edge_for_every_saved_tensor(llama_debug, layer):
    g = build_layer_graph(llama_debug, layer)
    dot = layer_graph_dot(g)
    expected = _saved_of_layer(llama_debug, g.layer)
    assert len(expected) >= 15                                     # norms, q/k/v, rope, attention, mlp
    edges = EDGE.findall(dot)
    saved_in_dot = {int(sid) for _, _, sid, _, attrs in edges if 'class="saved"' in attrs}
    assert saved_in_dot == expected == g.saved_storage_ids
    for sid in expected:                                           # every saved tensor reaches a backward reader
        readers = [dst for _, dst, s, _, _ in edges if int(s) == sid]
        assert any(dst.startswith("op") and g.nodes[[n.node_id for n in g.nodes].index(dst)].phase == "backward"
                   or dst == "out_backward" for dst in readers), sid


def test_edges_show_bytes_and_lifetime(llama_debug):
    g = build_layer_graph(llama_debug, "blocks.0")
    intervals = llama_debug.policies["eager"].liveness.intervals
    for e in g.edges:
        iv = intervals[e.storage_id]
        assert (e.alloc_op, e.free_op, e.nbytes) == (iv.alloc_op, iv.free_op, iv.nbytes)
    for src, dst, sid, label, _ in EDGE.findall(layer_graph_dot(g)):
        iv = intervals[int(sid)]
        born = "pre" if iv.alloc_op == BEFORE_STEP else f"#{iv.alloc_op}"
        freed = "end" if iv.free_op is None else f"#{iv.free_op}"
        assert label.endswith(f"\\n{born}->{freed}"), label


def test_view_ops_are_folded_not_drawn(llama_debug):
    g = build_layer_graph(llama_debug, "blocks.0")
    ops = {op.index: op for op in llama_debug.graph.ops}
    drawn = [n for n in g.nodes if n.kind == "op"]
    assert drawn and not any(ops[n.op_index].is_view for n in drawn)
    views = sum(1 for op in ops.values() if op.is_view and layer_of(op.module) == "blocks.0")
    assert g.folded_views + g.dropped_views == views and g.folded_views > 0
    assert sum(n.views for n in drawn) == g.folded_views
    assert len(drawn) + views == sum(1 for op in ops.values() if op.module and layer_of(op.module) == "blocks.0")


def test_recomputed_ops_are_marked(synthetic):
    if "recomputed" not in OpNode.__dataclass_fields__:
        pytest.skip("this StepGraph has no OpNode.recomputed field yet")
    graph = synthetic.graph
    ops = list(graph.ops)
    ops[4] = dataclasses.replace(ops[4], recomputed=True)                          # relu of blocks.1
    from tracer.passes.analysis import analyze_graph
    analysis = analyze_graph(dataclasses.replace(graph, ops=tuple(ops)))
    dot = render_layer_graph(analysis, "blocks.1")
    line = next(text for text in dot.splitlines() if text.strip().startswith("op4 ["))
    assert "\\nRECOMPUTED" in line and 'peripheries="2"' in line and 'class="op recomputed"' in line
    assert not any("RECOMPUTED" in text for text in dot.splitlines() if not text.strip().startswith("op4 ["))


def test_unknown_layer_lists_the_layers(synthetic):
    with pytest.raises(UsageError, match=r"no layer 'blocks\.7' in two-block; layers: blocks\.0-1, x2"):
        build_layer_graph(synthetic, "blocks.7")


@needs_dot
def test_svg_and_png_through_graphviz(llama_debug, tmp_path):
    dot = render_layer_graph(llama_debug)
    svg = dot_to_svg(dot)
    saved = {int(s) for s in re.findall(r'<g id="t(\d+)_\d+" class="edge saved">', svg)}
    assert saved == build_layer_graph(llama_debug).saved_storage_ids
    write_layer_graph(dot, tmp_path / "g.png")
    write_layer_graph(dot, tmp_path / "g.dot")
    assert (tmp_path / "g.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "g.dot").read_text() == dot


def test_bad_suffix_and_missing_dot_are_usage_errors(synthetic, tmp_path, monkeypatch):
    dot = render_layer_graph(synthetic)
    with pytest.raises(UsageError, match=r"use a \.dot, \.gv, \.svg, \.png or \.pdf"):
        write_layer_graph(dot, tmp_path / "g.jpg")
    monkeypatch.setattr("tracer.reports.layer_graph.shutil.which", lambda name: None)
    with pytest.raises(UsageError, match="graphviz `dot` is not installed.*apt-get install graphviz"):
        write_layer_graph(dot, tmp_path / "g.svg")
    assert dot_to_svg(dot) is None
    write_layer_graph(dot, tmp_path / "g.dot")                     # DOT text needs no graphviz
