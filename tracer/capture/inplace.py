"""Eager's in-place writes in a functionalized graph.

The captured graph is functional: eager's `dst.copy_(src)` is traced as `out = aten.copy(dst, src)`, and a
write through a view (`state[:, :, i] = x`: a select view, then copy_) as `copy(select(base), x)` followed
by `select_scatter(base, copy, ...)`. Each functional op makes a new tensor where eager writes into the
storage it already has (autograd's CopySlices does the same in backward: `new_empty_strided`, then
`copy_` of the gradient into it). `in_place_writes(graph)` finds the functional ops that stand for such a
write: `aten.copy` and the view-scatter ops (`select_scatter`, `slice_scatter`, `diagonal_scatter`,
`as_strided_scatter`), which user code rarely calls out of place, whose destination's storage nothing
reads afterwards except the scatter that puts this very write back into the same storage. Their outputs
take the destination's storage (no allocation), as in eager.

Not modelled: other in-place ops (`masked_fill_`, `index_put_`, `add_` ...), whose functional forms are also
ordinary out-of-place ops that user code calls; a destination read again later keeps its own storage.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from tracer.capture.storages import storage_key

_aten = torch.ops.aten
_SCATTERS = frozenset({_aten.select_scatter.default, _aten.slice_scatter.default, _aten.diagonal_scatter.default,
                       _aten.as_strided_scatter.default})
_WRITES = _SCATTERS | {_aten.copy.default}


def in_place_writes(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Functional node that eager runs in place -> the input node whose storage its output takes."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "output")]
    readers: dict[int, list[int]] = {}          # storage key -> positions of the nodes that read it
    for pos, node in enumerate(nodes):
        for arg in _tensor_inputs(node):
            readers.setdefault(storage_key(arg.meta["val"]), []).append(pos)
    writes = {}
    for pos, node in enumerate(nodes):
        if node.target not in _WRITES or not _is_tensor_node(node.args[0]):
            continue
        key = storage_key(node.args[0].meta["val"])
        if all(_puts_back(nodes[later], node, key) for later in readers.get(key, ()) if later > pos):
            writes[node] = node.args[0]
    return writes


def _puts_back(reader: fx.Node, write: fx.Node, key: int) -> bool:
    """`reader` is the scatter that writes `write`'s result back into the storage `key`."""
    return (reader.target in _SCATTERS and len(reader.args) > 1 and reader.args[1] is write
            and _is_tensor_node(reader.args[0]) and storage_key(reader.args[0].meta["val"]) == key)


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return [n for n in found if _is_tensor_node(n)]


def _is_tensor_node(arg) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)
