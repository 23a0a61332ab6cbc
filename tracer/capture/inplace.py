"""Eager's in-place writes in a functionalized graph.

The captured graph is functional: eager's `dst.copy_(src)` is traced as `out = aten.copy(dst, src)`, and a
write through a view (`state[:, :, i] = x`: a select view, then copy_) as `copy(select(base), x)` followed
by `select_scatter(base, copy, ...)`. Each functional op makes a new tensor where eager writes into the
storage it already has (autograd's CopySlices does the same in backward: `new_empty_strided`, then
`copy_` of the gradient into it). `in_place_writes(graph)` finds the functional ops that stand for such a
write: `aten.copy` and the view-scatter ops (`select_scatter`, `slice_scatter`, `diagonal_scatter`,
`as_strided_scatter`), which user code rarely calls out of place; and the functional op of an in-place
torch call of the forward (`out.index_add_(...)`, `mask.masked_fill_(...)`, `x += y`, `x[idx] = v`,
`F.relu(x, inplace=True)`: `is_inplace_call`), which the trace marks on its nodes (`INPLACE_CALL_KEY` in
`meta["custom"]`): the call's last node whose first argument has the output's shape and dtype is the write.
A write counts when its destination's storage nothing reads afterwards except the scatters that put this
very write back into the same storage, level by level for a write through nested views, and the views of
that storage those scatters write into (or, for a marked call, the views by which functionalization
replays the destination's view chain within the call). Its output takes the destination's storage (no allocation), as in
eager. The in-place aten ops of backward formulas (`maximum`'s `masked_fill_`), which no Python call makes,
are marked while the joint graph is traced (`formula_writes_marked`) and count the same way.

On the export rungs the call is known by the name export records for it (`torch_fn`), so an in-place
method or operator is found there too, but not `inplace=True`. Not modelled: in-place calls on
torch.compile's rung (its graphs name no calls): their functional ops allocate; a destination read again
later (eager would refuse the backward, or autograd clones it) keeps its own storage.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.fx as fx

from tracer.capture.meta import FORMULA_WRITE_KEY, INPLACE_CALL_KEY, is_input_mutation_output
from tracer.capture.storages import storage_key

_aten = torch.ops.aten
_SCATTERS = frozenset({_aten.select_scatter.default, _aten.slice_scatter.default, _aten.diagonal_scatter.default,
                       _aten.as_strided_scatter.default})
_WRITES = _SCATTERS | {_aten.copy.default}

# Tensor methods named with a trailing underscore that change no tensor data (not in-place ops)
_NOT_INPLACE = frozenset({"requires_grad_", "share_memory_", "retain_grad_", "pin_memory_"})
_INPLACE_DUNDERS = frozenset({"__setitem__", "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__",
                              "__imod__", "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__",
                              "__irshift__", "__imatmul__"})


def is_inplace_call(func, kwargs=None) -> bool:
    """A torch call that writes into its first tensor argument: an in-place method or dunder (`add_`,
    `__iadd__`, `__setitem__`), or a functional with `inplace=True` (`F.relu(x, inplace=True)`)."""
    return (kwargs or {}).get("inplace") is True or _is_inplace_name(getattr(func, "__name__", ""))


def _is_inplace_name(name: str) -> bool:
    if name in _INPLACE_DUNDERS:
        return True
    return name.endswith("_") and not name.startswith("_") and name not in _NOT_INPLACE


def _in_inplace_call(node: fx.Node) -> bool:
    """The node was made by an in-place torch call: marked by the direct trace, or (export's interpreter
    names each call's function in `torch_fn`, as "method_descriptor.index_add_") named as one."""
    if (node.meta.get("custom") or {}).get(INPLACE_CALL_KEY):
        return True
    torch_fn = node.meta.get("torch_fn")
    return bool(torch_fn) and len(torch_fn) > 1 and _is_inplace_name(str(torch_fn[1]).rsplit(".", 1)[-1])


def in_place_writes(gm: fx.GraphModule) -> dict[fx.Node, fx.Node]:
    """Functional node that eager runs in place -> the input node whose storage its output takes."""
    nodes = [n for n in gm.graph.nodes if n.op in ("call_function", "output")]
    readers: dict[int, list[int]] = {}          # storage key -> positions of the nodes that read it
    for pos, node in enumerate(nodes):
        for arg in _tensor_inputs(node):
            readers.setdefault(storage_key(arg.meta["val"]), []).append(pos)
    writes = {}
    marked = _marked_call_writes(nodes)
    formula_writes = _formula_writes(nodes)
    for pos, node in enumerate(nodes):
        if (node.target not in _WRITES and node not in marked and node not in formula_writes) or not node.args \
                or not _is_tensor_node(node.args[0]):
            continue
        key = storage_key(node.args[0].meta["val"])
        if _only_put_back(node, [nodes[later] for later in readers.get(key, ()) if later > pos], key,
                          marked=node in marked):
            writes[node] = node.args[0]
    return writes


def overwritten_backward_reads(gm: fx.GraphModule) -> list[tuple[fx.Node, fx.Node]]:
    """(write, backward reader) for each in-place torch call of the forward (`_marked_call_writes`) whose
    destination an earlier forward op saved for backward: a backward op of an op that ran before the write
    (a smaller `seq_nr`) reads the destination's storage, before or after the write (functionalization
    hands the saved tensor's new value to that backward). Eager, which writes the storage itself, refuses
    that backward ("one of the variables needed for gradient computation has been modified by an inplace
    operation"); a trace alone would go on and predict a step that cannot run. The write's own backward and
    those of later ops read its result legitimately. A destination in a graph input's storage (a parameter
    written through `.data`, which autograd's version counter does not see) is left alone."""
    nodes = [n for n in gm.graph.nodes if n.op == "call_function"]
    inputs = {storage_key(n.meta["val"]) for n in gm.graph.nodes if n.op == "placeholder" and _is_tensor_node(n)}
    backward = [n for n in nodes if n.meta.get("partitioner_tag") == "is_backward" and n.meta.get("seq_nr") is not None]
    found = []
    for write in _marked_call_writes(nodes):
        seq_nr = write.meta.get("seq_nr")
        if seq_nr is None or not write.args or not _is_tensor_node(write.args[0]) or not _is_tensor_node(write):
            continue
        keys = {storage_key(write.args[0].meta["val"]), storage_key(write.meta["val"])}
        if keys & inputs:
            continue
        reader = next((n for n in backward if n.meta["seq_nr"] < seq_nr
                       and any(storage_key(arg.meta["val"]) in keys for arg in _tensor_inputs(n))), None)
        if reader is not None:
            found.append((write, reader))
    return found


def input_copies_written_back(gm: fx.GraphModule, writes: dict[fx.Node, fx.Node]) -> dict[fx.Node, fx.Node]:
    """`clone(input)` node -> the input's placeholder, where the graph's new value of a mutated input (an
    `InputMutationAOTOutput` of `gm`'s outputs) is that clone written in place (`writes`) or viewed, and the
    graph reads the input's old value no more after the clone. Functionalization copies an input that the
    forward changes through a view autograd does not see (`weight.data.clamp_(...)`, weight clipping);
    eager writes the input's own storage, so the copy and what is saved of it are the input itself."""
    output = next(iter(gm.graph.find_nodes(op="output")), None)
    descs = (output.meta.get("desc") or []) if output is not None else []
    order = {node: pos for pos, node in enumerate(gm.graph.nodes)}
    copies = {}
    for out, desc in zip(output.args[0] if output is not None else (), descs):
        if not is_input_mutation_output(desc) or not _is_tensor_node(out):
            continue
        node = out
        while node.op == "call_function" and node.target is not _aten.clone.default:
            if node in writes:
                node = writes[node]
            elif node.args and _is_tensor_node(node.args[0]) \
                    and storage_key(node.meta["val"]) == storage_key(node.args[0].meta["val"]):
                node = node.args[0]                        # a view of what it reads (detach, alias)
            else:
                break
        source = node.args[0] if node.target is _aten.clone.default and node.args else None
        if not (isinstance(source, fx.Node) and source.op == "placeholder"):
            continue
        if all(order[user] <= order[node] or user is output for user in source.users):
            copies[node] = source
    return copies


def _only_put_back(write: fx.Node, later_readers: list[fx.Node], key: int, *, marked: bool) -> bool:
    """Nothing reads the storage `key` after `write` but the scatters that put the write back into it, and
    the views of that storage those scatters write into. A write through nested views (`base[:, -1, :, w:]
    = x`, or autograd's CopySlices of it in backward: `grad_slice.copy_(...)`) is put back level by level:
    `slice_scatter(select(base), copy)`, then `select_scatter(base, that)`; the `select` is a view of the
    same storage that only the chain's scatters read."""
    chain, views = {write}, set()
    for reader in later_readers:
        if marked and (_replays_view(reader, write) or _reads_apart_from(reader, write.args[0], key)):
            continue
        if reader.target in _SCATTERS and len(reader.args) > 1 and reader.args[1] in chain \
                and _is_tensor_node(reader.args[0]) and storage_key(reader.args[0].meta["val"]) == key:
            chain.add(reader)
        elif _is_view_of(reader, key):
            views.add(reader)
        else:
            return False
    # each view serves the chain only: read as the destination of one of its scatters, or viewed again
    return all(user in views or (user in chain and user.args[0] is view) for view in views for user in view.users)


def _reads_apart_from(reader: fx.Node, destination: fx.Node, key: int) -> bool:
    """`reader` reads the storage `key` only through tensors whose elements lie apart from the
    destination's: aliases autograd does not track as views (`unsafe_chunk`'s pieces, which ATen's GRU cell
    writes one by one, `add_` then `sigmoid_`), so the write leaves what the reader reads unchanged."""
    inputs = [arg for arg in _tensor_inputs(reader) if storage_key(arg.meta["val"]) == key]
    if reader.op != "call_function" or destination in inputs or not inputs:
        return False
    return all(_apart(destination.meta["val"], arg.meta["val"]) for arg in inputs)


def _apart(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Two strided tensors of one storage with the same strides and dtype share no element: in the
    mixed radix of the strides (each stride past the extent of the dims inside it, so every offset has one
    index), `b`'s origin lies outside `a`'s index range in some dim and `b` never carries over into the dim
    outside. False when that cannot be shown."""
    if a.dtype != b.dtype or a.dim() != b.dim() or a.stride() != b.stride() or a.numel() == 0 or b.numel() == 0:
        return a.numel() == 0 or b.numel() == 0
    if b.storage_offset() < a.storage_offset():
        a, b = b, a
    dims = sorted((d for d in range(a.dim()) if max(a.shape[d], b.shape[d]) > 1), key=lambda d: -a.stride(d))
    delta, origin = b.storage_offset() - a.storage_offset(), {}
    for d in dims:
        stride = a.stride(d)
        if stride <= 0:
            return False
        origin[d], delta = divmod(delta, stride)
    if delta:
        return False
    for outer, inner in zip(dims, dims[1:]):           # b's index in `inner` stays within one `outer` step
        inside = sum((max(a.shape[d], origin[d] + b.shape[d]) - 1) * a.stride(d) for d in dims[dims.index(inner):])
        if inside >= a.stride(outer):
            return False
    return any(origin[d] >= a.shape[d] for d in dims)


def _is_view_of(node: fx.Node, key: int) -> bool:
    out = node.meta.get("val")
    return (isinstance(out, torch.Tensor) and storage_key(out) == key and isinstance(node.target, torch._ops.OpOverload)
            and node.target.is_view)


def _marked_call_writes(nodes: list[fx.Node]) -> set[fx.Node]:
    """The node of each marked in-place torch call whose result eager writes into the call's tensor: the
    call's last forward node (not a view-scatter, already a write) that makes a new tensor of its first
    argument's shape and dtype."""
    last_of_call: dict[str, fx.Node] = {}
    for node in nodes:
        if not _in_inplace_call(node) or node.meta.get("partitioner_tag") == "is_backward":
            continue
        call = (node.meta.get("torch_fn") or (None,))[0]
        if call is not None and node.target not in _SCATTERS and _writes_first_argument(node):
            last_of_call[(call, _inner_call(node))] = node
    return set(last_of_call.values())


@contextlib.contextmanager
def formula_writes_marked():
    """While the joint graph is traced: the nodes that each in-place aten op run by a backward formula
    traces are marked with an id of their own (FORMULA_WRITE_KEY in `meta["custom"]`). Eager's C++ formulas
    write in place (`maximum`'s `at::where(...).masked_fill_(self < other, 0)` writes into the `where`
    result it returns); below the torch-function level no Python call marks them, and functionalization
    traces the write as an out-of-place op with a new output. `FunctionalTensorMode.__torch_dispatch__`
    sees the in-place op before it is made functional; it is wrapped for the trace only. A new `custom`
    dict each time: the current one may be a forward node's own, which backward's meta starts from."""
    import torch.fx.traceback as fx_traceback
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    original = FunctionalTensorMode.__dict__["__torch_dispatch__"]
    ids = itertools.count(1)

    def dispatch(self, func, types, args=(), kwargs=None):
        if torch._C._current_autograd_node() is None or not _is_inplace_aten_op(func):
            return original(self, func, types, args, kwargs)
        meta = fx_traceback.current_meta
        had_custom, custom = "custom" in meta, meta.get("custom")
        meta["custom"] = {**(custom or {}), FORMULA_WRITE_KEY: next(ids)}
        try:
            return original(self, func, types, args, kwargs)
        finally:
            if had_custom:
                meta["custom"] = custom
            else:
                meta.pop("custom", None)

    FunctionalTensorMode.__torch_dispatch__ = dispatch
    try:
        yield
    finally:
        FunctionalTensorMode.__torch_dispatch__ = original


def _is_inplace_aten_op(func) -> bool:
    """An aten overload that writes the data of its first argument (`masked_fill_`, `mul_`), not its
    metadata (`as_strided_`, `transpose_`) and not an out= variant."""
    if not isinstance(func, torch._ops.OpOverload) or torch.Tag.inplace_view in func.tags:
        return False
    schema = func._schema
    first = schema.arguments[0].alias_info if schema.arguments else None
    return schema.name.endswith("_") and first is not None and first.is_write


def _formula_writes(nodes: list[fx.Node]) -> set[fx.Node]:
    """The node of each in-place aten op of a backward formula (marked by `formula_writes_marked`) whose
    result eager writes into the op's first argument: the op's last node that makes a new tensor of its
    first argument's shape and dtype (not a view-scatter: already a write)."""
    last_of_op: dict[int, fx.Node] = {}
    for node in nodes:
        op_id = (node.meta.get("custom") or {}).get(FORMULA_WRITE_KEY)
        if op_id is not None and node.target not in _SCATTERS and _writes_first_argument(node):
            last_of_op[op_id] = node
    return set(last_of_op.values())


def _inner_call(node: fx.Node):
    """The in-place call a node belongs to within its torch call: a kernel that tracer runs in place of a
    torch op (eager_kernels: ATen's GRU cell) makes several in-place calls within the one torch call the
    model makes, each marked with an id of its own; True for a call marked as a whole."""
    return (node.meta.get("custom") or {}).get(INPLACE_CALL_KEY)


def _writes_first_argument(node: fx.Node) -> bool:
    out = node.meta.get("val")
    if not node.args or not _is_tensor_node(node.args[0]) or not isinstance(out, torch.Tensor):
        return False
    dst = node.args[0].meta["val"]
    return (tuple(out.shape) == tuple(dst.shape) and out.dtype == dst.dtype
            and storage_key(out) != storage_key(dst))        # a new tensor, not a view of the destination


def _replays_view(reader: fx.Node, write: fx.Node) -> bool:
    """`reader` is a view, made by the same in-place call, of the storage the write goes into:
    functionalization replays the destination's view chain from its base while it writes through a view
    (`scores += bias` where `scores` is a permute of a matmul's output)."""
    call = (write.meta.get("torch_fn") or (None,))[0]
    out = reader.meta.get("val")
    return (call is not None and (reader.meta.get("torch_fn") or (None,))[0] == call
            and isinstance(out, torch.Tensor) and any(storage_key(out) == storage_key(arg.meta["val"])
                                                      for arg in _tensor_inputs(reader)))


def _tensor_inputs(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return [n for n in found if _is_tensor_node(n)]


def _is_tensor_node(arg) -> bool:
    return isinstance(arg, fx.Node) and isinstance(arg.meta.get("val"), torch.Tensor)
