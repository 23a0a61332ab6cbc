"""Who holds the memory live at one moment: bytes by category, by source line and by layer.

A storage is attributed to the op that allocated it: its source line (for backward ops, the forward
line that caused them) and its module. Pre-existing storages have no line; parameters are attributed
to the module that owns them. Layers are module paths cut after the first numeric index
(`blocks.3.attn.wq` -> `blocks.3`) or at the first component (`lm_head`).
"""
from __future__ import annotations

import dataclasses

from tracer.passes.blocks import BLOCK_RE
from tracer.passes.liveness import BEFORE_STEP, Liveness
from tracer.passes.saved import SavedTensors
from tracer.stepgraph import OpNode, Phase, SourceLoc, StepGraph, StorageRole

CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "caller_held")
MODEL_STATE_CATEGORIES = CATEGORIES[:3]     # what the training state holds, whatever the batch


@dataclasses.dataclass(frozen=True)
class LineBytes:
    source: SourceLoc | None
    label: str                        # "file:line" or a bracketed role like "(parameters)"
    bytes_at_peak: int
    saved_bytes: int


@dataclasses.dataclass(frozen=True)
class LayerBytes:
    layer: str
    bytes_at_peak: int
    saved_bytes: int


@dataclasses.dataclass(frozen=True)
class Attribution:
    op_index: int
    by_category: dict[str, int]
    lines: tuple[LineBytes, ...]      # sorted by bytes_at_peak, descending
    layers: tuple[LayerBytes, ...]    # in first-appearance order


def categorize(graph: StepGraph, liveness: Liveness, saved: SavedTensors) -> tuple[str, ...]:
    """The bill category of every storage, indexed by storage id."""
    out = []
    for storage in graph.storages:
        role = storage.role
        if storage.caller_held:                 # the training loop's (capture/caller_held.py), saved or not
            out.append("caller_held")
        elif role in (StorageRole.PARAMETER, StorageRole.BUFFER):
            out.append("parameter")
        elif role is StorageRole.GRADIENT:
            out.append("gradient")
        elif role is StorageRole.OPTIMIZER_STATE:
            out.append("optimizer_state")
        elif role is StorageRole.INPUT:
            out.append("input")
        elif storage.storage_id in saved.storage_ids:
            out.append("activation")
        else:
            out.append("temporary")
    return tuple(out)


def frozen_parameter_bytes(graph: StepGraph) -> int:
    """Bytes of the parameters with requires_grad=False (live for the whole step, so at any peak)."""
    return sum(s.nbytes for s in graph.storages if s.frozen and not s.fused)


def allocating_ops(graph: StepGraph, liveness: Liveness) -> tuple[OpNode | None, ...]:
    return tuple(graph.ops[iv.alloc_op] if iv.alloc_op not in (None, BEFORE_STEP) else None
                 for iv in liveness.intervals)


def layer_of(module_path: str) -> str:
    match = BLOCK_RE.match(module_path)
    if match:
        return match.group(1)
    return module_path.split(".", 1)[0] if module_path else ""


def attribute(graph: StepGraph, liveness: Liveness, saved: SavedTensors, categories: tuple[str, ...],
              op_index: int) -> Attribution:
    producers = allocating_ops(graph, liveness)
    by_category = dict.fromkeys(CATEGORIES, 0)
    lines: dict[str, list] = {}
    layers: dict[str, list] = {}
    for sid in liveness.live_storages_at(op_index):
        storage = graph.storage(sid)
        nbytes = liveness.intervals[sid].nbytes
        if nbytes == 0:          # fused into its consumers' kernels, or another storage's value: no row
            continue
        by_category[categories[sid]] += nbytes
        producer = producers[sid]
        label, source = _line_label(producer, categories[sid])
        entry = lines.setdefault(label, [source, 0, 0])
        entry[1] += nbytes
        layer = _layer_label(storage, producer, categories[sid])
        layers.setdefault(layer, [0, 0])[0] += nbytes
    for sid in saved.storage_ids:
        storage = graph.storage(sid)
        if liveness.intervals[sid].alloc_op == BEFORE_STEP:
            continue
        label, source = _line_label(producers[sid], "activation")
        lines.setdefault(label, [source, 0, 0])[2] += storage.nbytes
        layers.setdefault(_layer_label(storage, producers[sid], "activation"), [0, 0])[1] += storage.nbytes
    line_rows = sorted((LineBytes(src, label, b, s) for label, (src, b, s) in lines.items()),
                       key=lambda r: (-r.bytes_at_peak, -r.saved_bytes, r.label))
    layer_rows = tuple(LayerBytes(name, *layers[name]) for name in _in_step_order(layers, graph))
    return Attribution(op_index=op_index, by_category=by_category, lines=tuple(line_rows), layers=layer_rows)


def _line_label(producer: OpNode | None, category: str) -> tuple[str, SourceLoc | None]:
    if producer is not None and producer.source is not None:
        return f"{producer.source.file}:{producer.source.line}", producer.source
    if producer is None:
        return {"parameter": "(parameters)", "gradient": "(gradients from the previous step)",
                "optimizer_state": "(optimizer state)", "input": "(inputs)",
                "caller_held": "(held by the training loop)"}.get(category, "(before the step)"), None
    if producer.phase is Phase.BACKWARD:
        return "(autograd engine)", None
    return f"({producer.target})", None


def _in_step_order(layers, graph: StepGraph) -> list[str]:
    """The model's layers in the order its forward first runs an op of theirs, then the rest by name (the
    root module's own ops, the inputs, the optimizer step, parameters of modules that run no op): one order
    whichever way the step was captured, where storage ids are numbered differently and the ops outside
    any layer (a checkpoint's detaches, the loss) differ."""
    first: dict[str, int] = {}
    for i, op in enumerate(graph.ops):
        if op.phase is Phase.FORWARD and layer_of(op.module):
            first.setdefault(layer_of(op.module), i)
    return sorted(layers, key=lambda name: (0, first[name], "") if name in first else (1, 0, name))


def _layer_label(storage, producer: OpNode | None, category: str) -> str:
    if producer is None:
        if category in MODEL_STATE_CATEGORIES and storage.name:
            return layer_of(storage.name.rsplit(".", 1)[0]) or "(root)"
        return f"({category})"
    if producer.phase is Phase.OPTIMIZER:
        return "(optimizer step)"
    return layer_of(producer.module) or "(root)"
