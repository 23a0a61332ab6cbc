"""Per-layer liveness graph: the ops of one layer as nodes, the tensors they pass as edges (graphviz DOT).

Contract:
    build_layer_graph(analysis, layer=None, policy="eager") -> LayerGraph
        Pure. `layer` is a layer name as `attribution.layer_of` cuts module paths ("blocks.3"); default:
        the numbered layer holding most bytes at the policy's peak (else the named layer holding most).
        * Nodes: every op of the layer (backward ops belong to the forward module that caused them) that
          is not view-only. A view-only op (`OpNode.is_view`) allocates nothing, so it is folded into the
          op that allocated the storage it views (the node says "+k views"); views of storages made
          outside the layer (parameter transposes) are dropped. Tensors made outside the layer come from
          one external node per producing op, or one "before the step" node per category; a tensor made in
          the layer and read outside it gets one edge per phase of its outside readers, to one sink node
          per phase.
        * Edges: one per (storage, reading op), storage-level, so a read through a view is a read of the
          storage. Each edge carries the storage's bytes, dtype, shape, category, whether it is saved for
          backward, and its lifetime: allocated by op `alloc_op` (-1 = before the step), freed after op
          `free_op` (None = outlives the step). A tensor made in the layer that nothing reads gets an edge
          to a "never read" sink, so every tensor of the layer is an edge.
        * Parameters, buffers and optimizer state that exist before the step are not drawn (they are live
          the whole step); the graph counts them in `hidden_bytes`.
        * Recomputed ops (`policy_view.is_recomputed`) are marked; the peak op is outlined when it is in
          the layer.
    layer_graph_dot(graph) -> str                  deterministic DOT text (goldens pin it)
    render_layer_graph(analysis, layer=None, policy="eager") -> str    the two above
    write_layer_graph(dot, path)                   .dot/.gv as text; .svg/.png/.pdf through graphviz `dot`
    dot_to_svg(dot) -> str | None                  SVG text, None when `dot` is not installed

Edge look: saved-for-backward edges are red, darker and wider with more bytes (penwidth 1.5-6 by the
square root of bytes over the largest saved tensor of the layer); other edges grey. Node fill by phase.
Raises UsageError for an unknown layer (listing the layers) and when `dot` is needed but missing.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import shutil
import subprocess

from tracer.errors import TracerError, UsageError
from tracer.passes.analysis import Analysis
from tracer.passes.attribution import allocating_ops, layer_of
from tracer.passes.liveness import BEFORE_STEP
from tracer.reports.line_table import group_layer_names
from tracer.reports.policy_view import is_recomputed, policy_graph, policy_result
from tracer.reports.units import format_bytes

HIDDEN_CATEGORIES = ("parameter", "optimizer_state")
PHASE_FILL = {"forward": "#dbe7f7", "backward": "#fbe3d0", "optimizer": "#e6e6e6", "recompute": "#d5f0d8"}
GRAPH_FORMATS = ("dot", "gv", "svg", "png", "pdf")
DOT_INSTALL_HINT = "install graphviz (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz)"


@dataclasses.dataclass(frozen=True)
class GraphNode:
    node_id: str                      # "op12", "ext12" (a producer outside the layer), "pre_input", "out_backward"
    kind: str                         # "op" | "external" | "before" | "sink"
    label: str                        # "\n"-separated lines
    phase: str | None
    op_index: int | None
    views: int = 0                    # view-only ops folded into this node
    recomputed: bool = False
    is_peak: bool = False
    tooltip: str = ""


@dataclasses.dataclass(frozen=True)
class TensorEdge:
    storage_id: int
    src: str
    dst: str
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    category: str
    saved: bool
    alloc_op: int | None              # BEFORE_STEP (-1) for storages that exist before the step
    free_op: int | None               # None: outlives the step


@dataclasses.dataclass(frozen=True)
class LayerGraph:
    layer: str
    policy: str
    model: str
    nodes: tuple[GraphNode, ...]
    edges: tuple[TensorEdge, ...]
    folded_views: int                 # view-only ops folded into their producers
    dropped_views: int                # view-only ops of storages made outside the layer
    hidden_count: int                 # storages of HIDDEN_CATEGORIES not drawn
    hidden_bytes: int

    @property
    def saved_storage_ids(self) -> frozenset[int]:
        return frozenset(e.storage_id for e in self.edges if e.saved)


def layer_names(analysis: Analysis, policy: str = "eager") -> tuple[str, ...]:
    """Layers that have ops, in first-appearance order."""
    graph = policy_graph(analysis, policy_result(analysis, policy))
    return tuple(dict.fromkeys(layer_of(op.module) for op in graph.ops if op.module))


def default_layer(analysis: Analysis, policy: str = "eager") -> str:
    """The numbered layer (`prefix.N`) holding most bytes at the peak; else the named layer holding most."""
    result = policy_result(analysis, policy)
    known = set(layer_names(analysis, policy))
    rows = [row for row in result.at_peak.layers if row.layer in known]
    numbered = [row for row in rows if re.fullmatch(r".*\.\d+", row.layer)]
    pool = numbered or rows
    if not pool:
        raise UsageError(f"{analysis.graph.config.model}: no op has a module path, so there is no layer to draw")
    return max(pool, key=lambda row: row.bytes_at_peak).layer      # max keeps the first of equals


def build_layer_graph(analysis: Analysis, layer: str | None = None, policy: str = "eager") -> LayerGraph:
    result = policy_result(analysis, policy)
    graph = policy_graph(analysis, result)
    layer = layer or default_layer(analysis, policy)
    ops_in = [op for op in graph.ops if op.module and layer_of(op.module) == layer]
    if not ops_in:
        names = layer_names(analysis, policy)
        raise UsageError(f"no layer {layer!r} in {graph.config.model}; layers: {group_layer_names(names)}",
                         hint="pass a layer name as printed, e.g. " + (names[0] if names else "blocks.0"))
    liveness = result.liveness
    producers = allocating_ops(graph, liveness)
    in_layer = {op.index for op in ops_in}
    drawn = {op.index for op in ops_in if not op.is_view}
    nodes: dict[str, GraphNode] = {}
    views: dict[int, int] = {}
    dropped = 0
    for op in ops_in:
        if not op.is_view:
            continue
        sids = [v.storage_id for v in op.input_values() + op.outputs]
        owner = producers[sids[0]] if sids else None
        if owner is not None and owner.index in drawn:
            views[owner.index] = views.get(owner.index, 0) + 1
        else:
            dropped += 1
    peak_index = result.peak_op.index
    for op in ops_in:
        if op.index in drawn:
            nodes[f"op{op.index}"] = _op_node(op, views.get(op.index, 0), op.index == peak_index)

    readers: dict[int, list] = {}
    for op in graph.ops:
        if op.is_view:
            continue
        for sid in dict.fromkeys(v.storage_id for v in op.input_values()):
            readers.setdefault(sid, []).append(op)
    touched: dict[int, None] = {}
    for op in ops_in:
        if op.index in drawn:
            for v in op.input_values() + op.outputs:
                touched.setdefault(v.storage_id)

    edges: list[TensorEdge] = []
    hidden_count = hidden_bytes = 0
    for sid in sorted(touched):
        storage = graph.storage(sid)
        iv = liveness.intervals[sid]
        category = result.categories[sid]
        if iv.alloc_op == BEFORE_STEP and category in HIDDEN_CATEGORIES:
            hidden_count += 1
            hidden_bytes += storage.nbytes
            continue
        producer = producers[sid]
        if producer is not None and producer.index in drawn:
            src = f"op{producer.index}"
        elif producer is None:
            src = f"pre_{category}"
            nodes.setdefault(src, GraphNode(src, "before", f"before the step\n{category.replace('_', ' ')}", None,
                                            None))
        else:
            src = f"ext{producer.index}"
            nodes.setdefault(src, _external_node(producer, src))
        dsts = [f"op{op.index}" for op in readers.get(sid, ()) if op.index in drawn and f"op{op.index}" != src]
        if src.startswith("op"):
            outside = {getattr(op.phase, "value", op.phase): op for op in reversed(readers.get(sid, ()))
                       if op.index not in in_layer}
            for first_reader in sorted(outside.values(), key=lambda op: op.index):
                dsts.append(_sink(nodes, layer, first_reader))
            if not outside and not dsts:
                dsts.append(_sink(nodes, layer, None, persistent=iv.free_op is None))
        saved = sid in result.saved.storage_ids
        for dst in dict.fromkeys(dsts):
            edges.append(TensorEdge(sid, src, dst, storage.nbytes, storage.dtype, storage.shape, category, saved,
                                    iv.alloc_op, iv.free_op))
    return LayerGraph(layer=layer, policy=policy, model=graph.config.model, nodes=tuple(nodes.values()),
                      edges=tuple(edges), folded_views=sum(views.values()), dropped_views=dropped,
                      hidden_count=hidden_count, hidden_bytes=hidden_bytes)


def _op_node(op, views: int, is_peak: bool) -> GraphNode:
    phase = getattr(op.phase, "value", op.phase)
    lines = [f"#{op.index} {op.name}"]
    if op.source is not None:
        lines.append(f"{os.path.basename(op.source.file)}:{op.source.line}")
    extras = ([f"+{views} view{'s' if views > 1 else ''}"] if views else []) + (["RECOMPUTED"] if is_recomputed(op)
                                                                               else []) + (["PEAK"] if is_peak else [])
    if extras:
        lines.append(" ".join(extras))
    tooltip = f"{op.target} [{phase}] module {op.module}" + (f"; {op.source.code.strip()}" if op.source else "")
    return GraphNode(f"op{op.index}", "op", "\n".join(lines), phase, op.index, views, is_recomputed(op), is_peak,
                     tooltip)


def _external_node(op, node_id: str) -> GraphNode:
    phase = getattr(op.phase, "value", op.phase)
    where = op.module or "(root)"
    return GraphNode(node_id, "external", f"#{op.index} {op.name}\nin {where}", phase, op.index,
                     tooltip=f"{op.target} [{phase}] outside the layer")


def _sink(nodes: dict[str, GraphNode], layer: str, first_reader, persistent: bool = False) -> str:
    if first_reader is None:
        node_id, label = ("out_after_step", "kept after the step") if persistent else ("out_unread", "never read")
    else:
        phase = getattr(first_reader.phase, "value", first_reader.phase)
        node_id, label = f"out_{phase}", f"read by {phase} ops\noutside {layer}"
    nodes.setdefault(node_id, GraphNode(node_id, "sink", label, None, None))
    return node_id


# ---------------------------------------------------------------------------------------------- DOT

def layer_graph_dot(g: LayerGraph) -> str:
    saved = [e for e in g.edges if e.saved]
    saved_ids = {e.storage_id for e in saved}
    max_saved = max((e.nbytes for e in saved), default=0)
    title = (f"{g.model} {g.layer} (policy {g.policy}): {sum(n.kind == 'op' for n in g.nodes)} ops "
             f"({g.folded_views} view ops folded into their producers), "
             f"{len({e.storage_id for e in g.edges})} tensors, {len(saved_ids)} saved for backward "
             f"({format_bytes(sum({e.storage_id: e.nbytes for e in saved}.values()))})\n"
             f"edge: bytes, allocated at op #i -> freed after op #j; red and wide = saved for backward "
             f"(by bytes); not drawn: {g.hidden_count} parameter/optimizer-state tensors "
             f"({format_bytes(g.hidden_bytes)}) live the whole step")
    out = [f"digraph {_q(g.layer)} {{",
           f"  graph [rankdir=TB, newrank=true, nodesep=0.25, ranksep=0.35, fontname=\"Helvetica\", fontsize=11, "
           f"labelloc=t, label={_q(title)}];",
           "  node [shape=box, style=\"rounded,filled\", fontname=\"Helvetica\", fontsize=9, margin=\"0.08,0.03\"];",
           "  edge [fontname=\"Helvetica\", fontsize=8, color=\"#8c8c8c\", fontcolor=\"#444444\", arrowsize=0.6];"]
    by_phase: dict[str, list[GraphNode]] = {}
    loose: list[GraphNode] = []
    for node in g.nodes:
        (by_phase.setdefault(node.phase, []) if node.kind == "op" else loose).append(node)
    for phase, members in by_phase.items():
        out.append(f"  subgraph {_q('cluster_' + str(phase))} {{")
        out.append(f"    label={_q(str(phase))}; style=\"rounded,dashed\"; color=\"#9a9a9a\"; fontsize=10;")
        out += [f"    {_node_line(n)}" for n in sorted(members, key=lambda n: n.op_index)]
        out.append("  }")
    out += [f"  {_node_line(n)}" for n in loose]
    counts: dict[int, int] = {}
    for e in g.edges:
        k = counts.get(e.storage_id, 0)
        counts[e.storage_id] = k + 1
        born = "pre" if e.alloc_op == BEFORE_STEP else f"#{e.alloc_op}"
        freed = "end" if e.free_op is None else f"#{e.free_op}"
        attrs = {"id": f"t{e.storage_id}_{k}", "label": f"{format_bytes(e.nbytes)}\n{born}->{freed}",
                 "tooltip": f"storage {e.storage_id}: {e.dtype}{list(e.shape)} {e.category}, {e.nbytes:,} B, "
                            f"allocated {'before the step' if born == 'pre' else 'at ' + born}, "
                            + ("live after the step" if freed == "end" else f"freed after {freed}")
                            + (", saved for backward" if e.saved else "")}
        if e.saved:
            share = math.sqrt(e.nbytes / max_saved) if max_saved else 1.0
            attrs.update({"class": "saved", "color": _ramp(share), "fontcolor": "#8b1a1a",
                          "penwidth": f"{1.5 + 4.5 * share:.2f}"})
        out.append(f"  {e.src} -> {e.dst} [{_attrs(attrs)}];")
    out.append("}")
    return "\n".join(out) + "\n"


def _node_line(n: GraphNode) -> str:
    attrs = {"label": n.label, "id": n.node_id}
    if n.kind == "op":
        attrs["fillcolor"] = PHASE_FILL.get(n.phase or "", "#f2f2f2")
        attrs["class"] = "op"
        if n.recomputed:
            attrs.update({"fillcolor": PHASE_FILL["recompute"], "peripheries": "2", "class": "op recomputed"})
        if n.is_peak:
            attrs.update({"color": "#d62728", "penwidth": "2.5"})
    elif n.kind == "external":
        attrs.update({"style": "rounded,dashed", "fillcolor": "white", "fontcolor": "#555555", "class": "external"})
    else:
        attrs.update({"shape": "plaintext", "style": "", "fontcolor": "#555555", "class": n.kind})
    if n.tooltip:
        attrs["tooltip"] = n.tooltip
    return f"{n.node_id} [{_attrs(attrs)}];"


def _ramp(share: float) -> str:
    low, high = (0xf4, 0xa2, 0x61), (0x9b, 0x22, 0x26)
    return "#" + "".join(f"{round(a + (b - a) * share):02x}" for a, b in zip(low, high))


def _attrs(attrs: dict[str, str]) -> str:
    return ", ".join(f"{key}={_q(value)}" for key, value in attrs.items())


def _q(text: str) -> str:
    """A DOT double-quoted string; newlines become graphviz's centred line breaks."""
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def render_layer_graph(analysis: Analysis, layer: str | None = None, policy: str = "eager") -> str:
    return layer_graph_dot(build_layer_graph(analysis, layer, policy))


# ---------------------------------------------------------------------------------------------- output

def dot_binary() -> str | None:
    return shutil.which("dot")


def run_dot(dot: str, fmt: str, *, timeout_s: float = 120.0) -> bytes:
    """Lay out `dot` with graphviz and return the `fmt` output. Raises UsageError when `dot` is missing,
    TracerError when graphviz fails (its message is kept)."""
    binary = dot_binary()
    if binary is None:
        raise UsageError(f"graphviz `dot` is not installed, so the layer graph cannot be written as {fmt}",
                         hint=f"{DOT_INSTALL_HINT}, or write a .dot file")
    try:
        proc = subprocess.run([binary, f"-T{fmt}"], input=dot.encode("utf-8"), capture_output=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise TracerError(f"graphviz `dot -T{fmt}` took more than {timeout_s:.0f} s on the layer graph") from exc
    if proc.returncode != 0:
        raise TracerError(f"graphviz `dot -T{fmt}` failed: {proc.stderr.decode('utf-8', 'replace').strip()}")
    return proc.stdout


def dot_to_svg(dot: str) -> str | None:
    if dot_binary() is None:
        return None
    text = run_dot(dot, "svg").decode("utf-8")
    return text[text.index("<svg"):]


def write_layer_graph(dot: str, path) -> None:
    """Write DOT text as .dot/.gv, or render it to .svg/.png/.pdf with graphviz (by the suffix of `path`)."""
    fmt = os.path.splitext(str(path))[1].lstrip(".").lower()
    if fmt not in GRAPH_FORMATS:
        raise UsageError(f"cannot write the layer graph as {path}: use a .dot, .gv, .svg, .png or .pdf file name")
    data = dot.encode("utf-8") if fmt in ("dot", "gv") else run_dot(dot, fmt)
    from tracer.outputs import write_output
    write_output(path, data, what="the layer graph")
