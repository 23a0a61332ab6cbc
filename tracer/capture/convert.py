"""Convert a captured step's fx graphs into ops over storages, with eager autograd's gradient semantics.

A step is read from a `Schedule`: either the joint graph (eager: forward nodes, then backward nodes in
autograd-engine order) or a partitioned pair (forward graph, then backward graph whose placeholders are
the forward graph's saved outputs; backward nodes not tagged `is_backward` are recomputed forward ops), or
the joint graph with compiled regions (`block.compile()`: each block's nodes replaced by its own compiled
forward and backward, tracer.capture.compiled_blocks).

Conventions:
  * getitem nodes are not ops: they name an element of their parent's output tuple.
  * an output that shares a storage with one of the op's inputs is a view (no allocation); any other
    output is a new storage (a recomputed op in the backward graph carries its forward twin's fake
    value, and still allocates anew).
  * placeholders are pre-existing: parameters and buffers (tied parameters share one storage, as in
    eager), inputs; the loss tangent is a 4-byte `ones_like` made at the start of backward, as
    `loss.backward()` does.
  * gradients follow AccumulateGrad: with grads set to None before the step, a parameter's single
    gradient is stolen as `.grad` (no copy); a tied parameter's gradients are summed out of place when
    the last one is ready. With grads kept from the previous step (`zero_grad(set_to_none=False)`),
    every incoming gradient is added in place into the existing `.grad` and then freed. In eager, a
    gradient is ready when its autograd node has run; in a compiled backward, when the graph returns.
"""
from __future__ import annotations

import dataclasses
import functools
import operator
from typing import Any

import torch
import torch.fx as fx

from tracer.capture.inplace import in_place_writes, input_copies_written_back
from tracer.capture.joint import JointCapture
from tracer.capture.schedule import Schedule, fill_rng_wrapper_meta, input_nodes, is_rng_wrapper
from tracer.capture.meta import (FORWARD_VALUE_KEY, FRAME_HELD_KEY, HELD_KEY, PARTIAL_HELD_KEY, REGION_KEY, RERUN_KEY,
                                 is_effect_token_input, is_gradient_output, inner_path, whole_desc, is_input_mutation_output, is_parameter_input, is_static_input,
                                 is_tangent_input, loss_output_index, rng_wrapped_call, target_name)
from tracer.capture.source import loc_from_stack_trace, module_from_stack, normalize_module_path, user_frames
from tracer.errors import CaptureError
from tracer.capture.storages import StorageTable, dtype_name, flat_tensors, storage_key
from tracer.stepgraph import Phase, SourceLoc, StorageRole, TensorValue

_GETITEM = operator.getitem
SEED_OP_NAME = "loss_grad_seed"


@dataclasses.dataclass
class OpDraft:
    name: str
    target: str
    phase: Phase
    args: tuple
    kwargs: tuple
    outputs: tuple[TensorValue, ...]
    source: SourceLoc | None
    module: str
    is_view: bool
    seq_nr: int | None = None           # autograd sequence number: ops of one autograd node share it
    frames: tuple = ()                  # user frames (file, line, function), outer to inner
    recomputed: bool = False            # a forward op re-run in backward
    checkpoint_region: int | None = None  # ac_graph_id of the checkpointed block this op belongs to
    must_save: bool = False             # selective checkpointing keeps this op's outputs
    rerun_of: str | None = None         # a reentrant checkpoint's forward op run again inside backward: its name
    held_to_region_end: tuple[TensorValue, ...] = ()   # its outputs the region's backward holds until it ends
    partial_held: bool = False          # a forward view of a tensor a reentrant region's partial binds
    frame_held: tuple = ()              # (region, shape, dtype, origin node) a non-reentrant region's frame holds
    micro_batch: int | None = None      # gradient accumulation: the micro-batch it belongs to (1-based)
    torch_call: str | None = None       # forward or recomputed: the Python torch call that ran it ("name_counter")
    writes_in_place: bool = False       # its output is an eager in-place write into a storage made before it
    casts_graph_input: bool = False     # a dtype cast (_to_copy) of a graph input itself, not of a view of one
    compiled_region: bool = False       # run by a compiled block's forward or backward (block.compile())

    @property
    def rerun(self) -> bool:
        """A reentrant checkpoint's forward op run again inside backward."""
        return self.rerun_of is not None


@dataclasses.dataclass
class GraphPart:
    ops: list[OpDraft]
    grad_sid_by_param: dict[int, int]          # id(parameter tensor) -> storage id of its final .grad
    loss_sid: int
    seed_sid: int | None                       # the ones_like(loss) gradient that starts backward


def convert_step(cap: JointCapture, table: StorageTable, schedule: Schedule, *, grads_preexisting: bool) -> GraphPart:
    values: dict[fx.Node, Any] = {}
    node_pos: dict[fx.Node, int] = {}
    ops: list[OpDraft] = []
    descs = {node.name: node.meta.get("desc") for node in schedule.joint.graph.find_nodes(op="placeholder")}
    if schedule.forward is None:
        tangent = _add_placeholders(cap, schedule.joint, descs, table, values)
        _convert_nodes(schedule.joint, table, values, node_pos, ops, tangent, partitioned=False,
                       regions=schedule.regions)
        out = _output_args(schedule.joint)
        out_descs = _output_node(schedule.joint).meta.get("desc") or []
        loss_node, grad_outputs = out[loss_output_index(out_descs)], _grad_outputs(out, out_descs)
        _write_into_buffers(out, out_descs, table, values)
    else:
        _add_placeholders(cap, schedule.forward, descs, table, values)
        if schedule.forward_plan is not None:
            convert_planned(schedule.forward_plan, table, values, node_pos, ops, None, phase=Phase.FORWARD)
        else:
            _convert_nodes(schedule.forward, table, values, node_pos, ops, None, partitioned=True,
                           phase=Phase.FORWARD, fake_mode=cap.fake_mode)
        fw_out = _output_args(schedule.forward)
        out_descs = _output_node(schedule.joint).meta.get("desc") or []   # the forward's outputs come first
        loss_node = fw_out[loss_output_index(out_descs)]
        _write_into_buffers(fw_out[:schedule.num_forward_outputs], out_descs, table, values)
        tangent = (None, None)
        saved_inputs = []
        forward_nodes = {node.name: node for node in schedule.forward.graph.nodes}
        for node in schedule.backward.graph.find_nodes(op="placeholder"):
            if is_effect_token_input(descs.get(node.name)):    # the backward's effect token: no memory
                val = node.meta.get("val")
                values[node] = table.value(val, table.add(val, StorageRole.INPUT, preexisting=True, persistent=True,
                                                          name="effect token"))
            elif node.name.startswith("tangents"):
                tangent = (node, node.meta.get("val"))
            elif FORWARD_VALUE_KEY in node.meta:      # a parameter an eager recompute reads (policies.py)
                values[node] = values[forward_nodes[node.meta[FORWARD_VALUE_KEY]]]
            elif isinstance(node.meta.get("val"), torch.Generator):
                values[node] = _generator_state(node.meta["val"])
            else:
                saved_inputs.append(node)
        saved_outputs = fw_out[schedule.num_forward_outputs:]
        if len(saved_outputs) != len(saved_inputs):
            raise CaptureError(f"the partition's backward takes {len(saved_inputs)} saved values but its forward "
                               f"returns {len(saved_outputs)}")
        for placeholder, produced in zip(saved_inputs, saved_outputs):   # same order (saved_values)
            values[placeholder] = values[produced]
        if schedule.backward_plan is not None:
            convert_planned(schedule.backward_plan, table, values, node_pos, ops, tangent, phase=Phase.BACKWARD)
        else:
            _convert_nodes(schedule.backward, table, values, node_pos, ops, tangent, partitioned=True,
                           phase=Phase.BACKWARD, fake_mode=cap.fake_mode)
        # the backward returns the joint graph's gradients: one per primal input, none for an effect token
        primal_descs = [d for d in (descs.get(n.name) for n in schedule.forward.graph.find_nodes(op="placeholder"))
                        if not is_effect_token_input(d)]
        grad_outputs = [(whole_desc(d).target, out) for d, out in zip(primal_descs, _output_args(schedule.backward))
                        if is_parameter_input(d) and _is_tensor_node(out)]
    return _apply_grad_semantics(cap, loss_node, grad_outputs, table, values, node_pos, ops, grads_preexisting,
                                 compiled=schedule.compiled)


def _output_node(gm: fx.GraphModule) -> fx.Node:
    return next(iter(gm.graph.find_nodes(op="output")))


def _output_args(gm: fx.GraphModule) -> list:
    return list(_output_node(gm).args[0])


def _write_into_buffers(outs: list, descs: list, table: StorageTable, values) -> None:
    """A buffer the forward updates (`running_mean`), or a user input (`labels.masked_fill_(...)`), is written
    in place in eager: the graph's new value of it is never a storage of its own."""
    for out, desc in zip(outs, descs):
        if is_input_mutation_output(desc) and isinstance(values.get(out), TensorValue) \
                and not table.get(values[out].storage_id).preexisting:       # not the input's own storage
            table.update(values[out].storage_id, fused=True, preexisting=True,
                         name=f"{_input_name(desc.mutated_input)} (updated in place)")


def _input_name(desc) -> str:
    """A buffer's or parameter's module path; a user input (PlainAOTInput) has only its flat index."""
    if getattr(desc, "target", None) is not None:
        return normalize_module_path(desc.target)
    return f"input {desc.idx}" if hasattr(desc, "idx") else desc.expr()


def _grad_outputs(outs: list, descs: list) -> list[tuple[str, fx.Node]]:
    return [(whole_desc(d).grad_of.target, out) for out, d in zip(outs, descs)
            if is_gradient_output(d) and _is_tensor_node(out)]


def _is_tensor_node(out) -> bool:
    """A gradient output that is a tensor: not None, nor the device mesh a DTensor gradient carries."""
    return isinstance(out, fx.Node) and isinstance(out.meta.get("val"), torch.Tensor)


def _convert_nodes(gm, table, values, node_pos, ops, tangent, *, partitioned: bool, phase: Phase | None = None,
                   fake_mode=None, regions: tuple = ()):
    """`regions` (block.compile()): each region's nodes are replaced by its compiled forward, run where its
    first forward node is, and its compiled backward, run where its first backward node is."""
    writes = in_place_writes(gm)
    input_copies = input_copies_written_back(gm, writes)       # eager writes the input itself
    written_inputs: set[int] = set()
    region_at = {node: (region, False) for region in regions for node in region.forward_nodes}
    region_at.update({node: (region, True) for region in regions for node in region.backward_nodes})
    region_runs: dict[tuple[int, bool], tuple] = {}     # (id(region), backward) -> (storages made, saved values)
    forward_lines: dict = {}                             # `_summing_module`'s index of forward lines
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if node in region_at:
            region, backward = region_at[node]
            if backward and tangent[0] is not None and tangent[0] not in values:
                ops.append(_tangent_op(tangent, table, values))
            if (id(region), backward) not in region_runs:
                region_runs[id(region), backward] = _convert_region(
                    region, backward, table, values, node_pos, ops, region_runs.get((id(region), False)))
            continue
        if node.target is _GETITEM:
            values[node] = values[node.args[0]][node.args[1]]
            node_pos[node] = node_pos[node.args[0]]
            if node.meta.get(HELD_KEY):     # one output of a multi-output op is the region's output
                parent = ops[node_pos[node]]
                parent.held_to_region_end += tuple(_iter_tensor_values(values[node]))
            continue
        tagged_backward = node.meta.get("partitioner_tag") == "is_backward"
        node_phase = phase or (Phase.BACKWARD if tagged_backward else Phase.FORWARD)
        if node_phase is Phase.BACKWARD and tangent[0] is not None and tangent[0] not in values:
            ops.append(_tangent_op(tangent, table, values))
        recomputed = partitioned and node_phase is Phase.BACKWARD and not tagged_backward
        if is_rng_wrapper(node):
            fill_rng_wrapper_meta(node, fake_mode)
        if node in input_copies:
            written = values[input_copies[node]].storage_id
            written_inputs.add(written)
        else:
            written = _written_storage(writes.get(node), table, values, written_inputs)
        ops.append(_convert_node(node, node_phase, recomputed, table, values, written=written))
        if tagged_backward and "fwd_nn_module_stack" not in node.meta:
            ops[-1].module = _summing_module(node, node_pos, ops, forward_lines)
        node_pos[node] = len(ops) - 1


def _summing_module(node: fx.Node, node_pos: dict, ops: list[OpDraft], forward_lines: dict) -> str:
    """The module of a backward op that no forward op made: autograd's engine summing the gradients a tensor
    gets from its readers. Eager sums when the last of them arrives, as part of the autograd node that made
    it, so the sum belongs to that node's module. The graph names that node's forward line (the op's own
    source: "gradient addition ... around" it) but not always its op: a node whose backward is the identity
    (an add's) leaves no op, so the newest input is made by the node before it, in a module inside the
    line's. The sum takes the module of the newest input's op where a forward op at the line runs in it,
    else the innermost module of the line's forward ops that encloses it (`forward_lines`: (file, line) ->
    the modules of the forward ops there, filled on first use)."""
    positions = [node_pos[a] for a in node.all_input_nodes if a in node_pos]
    newest = ops[max(positions)].module if positions else ""
    loc = ops[-1].source
    if loc is None:
        return newest
    if not forward_lines:
        for op in ops:
            if op.phase is Phase.FORWARD and op.source is not None:
                forward_lines.setdefault((op.source.file, op.source.line), set()).add(op.module)
        forward_lines[None] = set()          # filled
    at_line = forward_lines.get((loc.file, loc.line), set())
    if not at_line or newest in at_line:
        return newest
    enclosing = [m for m in at_line if m == "" or newest.startswith(m + ".")]
    return max(enclosing, key=len) if enclosing else newest


def _convert_region(region, backward: bool, table: StorageTable, values, node_pos, ops,
                    forward_run: tuple | None) -> tuple[set[int], list]:
    """One compiled block's forward or backward (compiled_blocks.CompiledRegion), as its CompiledFunction
    runs it inside the eager step: its graph's inputs bound to the joint's values, its outputs bound to the
    joint nodes they stand for. The compiled backward frees a saved activation where its wrapper deletes it
    when the block's forward made it (`forward_run`: what the forward returned for this block); the block's
    inputs and incoming gradients are eager tensors: the gradients stay held by the node's arguments until
    it returns. Its ops have no autograd sequence number: eager's per-node rules (formula temporaries,
    saved-for-shape) do not apply. Returns the storages this graph made and the values it saved (identical
    blocks share one compiled graph, as Dynamo reuses it: values are bound afresh for each block)."""
    gm, plan = (region.backward, region.backward_plan) if backward else (region.forward, region.forward_plan)
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    forward_storages, saved_values = forward_run if backward else (None, [])
    saved = iter(saved_values)
    for placeholder in placeholders:
        kind, _, number = placeholder.name.rpartition("_")
        if isinstance(placeholder.meta.get("val"), torch.Generator):
            values[placeholder] = _generator_state(placeholder.meta["val"])
        elif kind == "tangents":
            values[placeholder] = values[region.tangents[int(number) - 1]]
        elif backward:
            values[placeholder] = next(saved)
        else:
            values[placeholder] = values[region.primals[int(number) - 1]]
    start = len(ops)
    made = convert_planned(plan, table, values, node_pos, ops, (None, None),
                            phase=Phase.BACKWARD if backward else Phase.FORWARD, releasable=forward_storages)
    for op in ops[start:]:
        op.seq_nr, op.frames, op.compiled_region = None, (), True
        op.checkpoint_region, op.must_save = None, False       # checkpointing inside is the partition's
        if op.module == region.graph_block or op.module.startswith(region.graph_block + "."):
            op.module = region.block + op.module[len(region.graph_block):]     # a graph shared with an identical block
    for placeholder in placeholders:
        if placeholder.name.startswith("tangents") and isinstance(values.get(placeholder), TensorValue):
            sid = values[placeholder].storage_id
            table.hold_until(sid, len(ops) - 1)
    joint_outputs = region.backward_outputs if backward else region.forward_outputs
    for joint_node, out in zip(joint_outputs, _output_args(gm)):
        values[joint_node] = values[out]
        node_pos[joint_node] = len(ops) - 1
        _bind_items(joint_node, values, node_pos)
    return set(made), [values[out] for out in _output_args(gm)[len(joint_outputs):]]


def _written_storage(destination: fx.Node | None, table: StorageTable, values,
                     written_inputs: set[int] = frozenset()) -> int | None:
    """The intermediate storage an in-place write (capture/inplace.py) puts its output in, if any; or an
    input's own storage that the forward writes in place (`written_inputs`)."""
    value = values.get(destination) if destination is not None else None
    if not isinstance(value, TensorValue):
        return None
    entry = table.get(value.storage_id)
    if value.storage_id in written_inputs:
        return value.storage_id
    return value.storage_id if entry.role is StorageRole.INTERMEDIATE and not entry.preexisting else None


def convert_planned(plan, table, values, node_pos, ops, tangent, *, phase: Phase,
                     releasable: set[int] | None = None) -> list[int]:
    """A compiled graph as Inductor runs it (`inductor_plan.GraphPlan`): its fx nodes in kernel order, each
    output in the storage Inductor keeps it in (several values share one when the wrapper reuses a freed
    buffer or updates in place) or in a 0-byte fused storage when it lives only inside a kernel. Every
    storage is allocated at the first op of the kernel step that allocates it (an `inductor_allocates`
    keyword, which the formulas ignore) and released after the last op of the step where the wrapper drops
    its last name; a saved activation the backward's wrapper deletes is released there too (only those in
    `releasable`, when given: an input that eager code holds as well outlives the graph's reference).
    Returns the storages the plan allocates."""
    shapes = _planned_storage_layouts(plan)
    sids = [table.add(None, StorageRole.INTERMEDIATE, nbytes=s.nbytes, dtype=shapes.get(i, ("uint8",))[0],
                      shape=shapes.get(i, (None, (s.nbytes,)))[1], name=f"inductor {s.name}")
            for i, s in enumerate(plan.storages)]
    first_op, last_op, stored_later = {}, {}, {}
    for node in plan.order:
        step = plan.step_of[node]
        if phase is Phase.BACKWARD and tangent[0] is not None and tangent[0] not in values:
            ops.append(_tangent_op(tangent, table, values))
        recomputed = phase is Phase.BACKWARD and node.meta.get("partitioner_tag") != "is_backward"
        # a value inlined into this step's kernels that a later kernel stores (positions saved for backward)
        later = [isinstance(e, int) and plan.storages[e].alloc_step > step for e in plan.storage_of[node]]
        if any(later):
            stored_later[node] = plan.storage_of[node]
        outputs = [None if late else sids[e] if isinstance(e, int) else
                   (values[e].storage_id if isinstance(e, fx.Node) else None)
                   for e, late in zip(plan.storage_of[node], later)]
        ops.append(_convert_node(node, phase, recomputed, table, values, output_sids=outputs))
        node_pos[node] = len(ops) - 1
        _bind_items(node, values, node_pos)
        first_op.setdefault(step, len(ops) - 1)
        last_op[step] = len(ops) - 1
    for i, storage in enumerate(plan.storages):
        at = _op_at_or_after(first_op, storage.alloc_step)
        if at is None:      # the last kernels only finish values of earlier ops (the loss's final reduction)
            at = max(last_op.values())
        ops[at].kwargs = tuple(ops[at].kwargs) + (("inductor_allocates", TensorValue(sids[i], (storage.nbytes,), "uint8")),)
        if storage.release_step is not None:
            table.update(sids[i], released_after_op=_op_at_or_before(last_op, storage.release_step, at))
    for node, sizes in plan.scratch.items():
        add_kernel_scratch(ops[node_pos[node]], node_pos[node], sizes, table)
    for node, entries in stored_later.items():      # what reads it later (the backward) reads the stored copy
        flat = list(_iter_tensor_values(values[node]))
        stored = {id(t): TensorValue(sids[e], v.shape, v.dtype) if isinstance(e, int) else v
                  for t, v, e in zip(flat_tensors(node.meta.get("val")), flat, entries)}
        values[node] = _structure(node.meta.get("val"), stored)
        _bind_items(node, values, node_pos)
    for placeholder, step in plan.input_release_step.items():
        value = values.get(placeholder)
        if isinstance(value, TensorValue):
            entry = table.get(value.storage_id)
            if entry.role is StorageRole.INTERMEDIATE and not entry.persistent and not entry.preexisting \
                    and (releasable is None or value.storage_id in releasable):
                table.update(value.storage_id, released_after_op=_op_at_or_before(last_op, step, 0))
    return sids


def add_kernel_scratch(op, index: int, sizes: tuple[int, ...], table) -> None:
    """Scratch a kernel allocates and frees inside its call (`GraphPlan.scratch`): storages of the op (a
    `kernel_scratch` keyword, which the formulas ignore), released right after it."""
    for nbytes in sizes:
        sid = table.add(None, StorageRole.INTERMEDIATE, nbytes=nbytes, dtype="uint8", shape=(nbytes,),
                        name=f"kernel scratch of {op.target}", released_after_op=index)
        op.kwargs = tuple(op.kwargs) + (("kernel_scratch", TensorValue(sid, (nbytes,), "uint8")),)


def _bind_items(node: fx.Node, values, node_pos) -> None:
    """getitem nodes name elements of their parent's output tuple."""
    for user in node.users:
        if user.target is _GETITEM:
            values[user] = values[node][user.args[1]]
            node_pos[user] = node_pos[node]
            _bind_items(user, values, node_pos)


def _planned_storage_layouts(plan) -> dict[int, tuple[str, tuple[int, ...]]]:
    """storage index -> (dtype, shape) of the first fx value kept in it, for the report."""
    out: dict[int, tuple[str, tuple[int, ...]]] = {}
    for node in plan.order:
        for entry, t in zip(plan.storage_of[node], flat_tensors(node.meta.get("val"))):
            if isinstance(entry, int) and entry not in out:
                out[entry] = (dtype_name(t.dtype), tuple(int(d) for d in t.shape))
    return out


def _op_at_or_after(first_op: dict[int, int], step: int) -> int | None:
    later = [s for s in first_op if s >= step]
    return first_op[min(later)] if later else None


def _op_at_or_before(last_op: dict[int, int], step: int, floor: int) -> int:
    earlier = [s for s in last_op if s <= step]
    return max(last_op[max(earlier)], floor) if earlier else floor


def _add_placeholders(cap, gm, descs, table, values) -> tuple:
    """Registers parameters, buffers and inputs; returns the loss tangent (node, fake value)."""
    sid_by_param_id: dict[tuple, int] = {}     # (id(parameter), path to a part) -> storage id
    tangent = (None, None)
    for node in gm.graph.find_nodes(op="placeholder"):
        desc = descs.get(node.name)
        val = node.meta.get("val")
        leaf = _forward_leaf(cap, desc)
        if leaf is not None:
            # made in forward: allocated by its first reader; the autograd graph holds it until the step ends,
            # but a reentrant region's leaf belongs to the rerun's own graph, which dies with its backward
            sid = table.add(val, StorageRole.INTERMEDIATE, persistent=not _in_reentrant_region(cap, leaf),
                            name=f"leaf made in forward{_at(leaf.source)}")
            table.alias(leaf.tensor, sid)
            values[node] = table.value(val, sid)
        elif is_static_input(desc):
            # a subclass parameter (a DTensor) is flattened into its parts: each tensor part is a storage
            whole, path = whole_desc(desc), inner_path(desc)
            owner = cap.param_by_fqn.get(whole.target)
            if owner is None:
                owner = cap.buffer_by_fqn.get(whole.target)
            part = functools.reduce(getattr, path, owner)
            if not isinstance(part, torch.Tensor):          # a DTensor's device mesh: no memory
                values[node] = val
                continue
            sid = sid_by_param_id.get((id(owner), path))
            if sid is None:
                role = StorageRole.PARAMETER if is_parameter_input(desc) else StorageRole.BUFFER
                sid = table.add(val, role, preexisting=True, persistent=True, name=normalize_module_path(whole.target),
                                frozen=role is StorageRole.PARAMETER and not owner.requires_grad)
                sid_by_param_id[(id(owner), path)] = sid
                table.alias(part, sid)
            values[node] = table.value(val, sid)
        elif is_tangent_input(desc):
            tangent = (node, val)          # made by the synthetic ones_like op at the start of backward
        elif isinstance(val, torch.Tensor):
            sid = table.lookup(val)
            if sid is None:
                sid = table.add(val, StorageRole.INPUT, preexisting=True, persistent=True,
                                name=f"input {getattr(desc, 'idx', '?')}")
            values[node] = table.value(val, sid)
        elif isinstance(val, torch.Generator):
            values[node] = _generator_state(val)
        else:
            values[node] = val
    return tangent


def _generator_state(generator: torch.Generator) -> str:
    """A generator's state that a replayed random op reads (CUDA's graph-safe RNG: the seed and offset, held
    on the host), as plain data."""
    return f"<{generator.device} generator state>"


def _in_reentrant_region(cap, leaf) -> bool:
    """The leaf is made by a use_reentrant=True region: its forward runs without grad and its rerun in
    backward makes the leaf (and its .grad) afresh in a graph of its own, gone when the region's backward
    returns."""
    calls = cap.seen.checkpoint_calls
    return leaf.region is not None and 0 <= leaf.region < len(calls) and calls[leaf.region].reentrant


def _forward_leaf(cap, desc):
    """The lifted leaf (tracer/capture/forward_leaves.py) a placeholder's descriptor names, if any."""
    target = getattr(whole_desc(desc), "target", None) if is_parameter_input(desc) else None
    return next((leaf for leaf in cap.forward_leaves if leaf.fqn == target), None)


def _at(source) -> str:
    return f" at {source.short()}" if source is not None else ""


def _tangent_op(tangent, table: StorageTable, values) -> OpDraft:
    node, val = tangent
    sid = table.add(val, StorageRole.INTERMEDIATE, name="loss.backward() seed")
    tv = table.value(val, sid)
    values[node] = tv
    return OpDraft(name=SEED_OP_NAME, target="aten.ones_like.default", phase=Phase.BACKWARD, args=(),
                   kwargs=(), outputs=(tv,), source=None, module="", is_view=False)


def _convert_node(node: fx.Node, phase: Phase, recomputed: bool, table: StorageTable, values,
                  output_sids: list | None = None, written: int | None = None) -> OpDraft:
    """`output_sids`: the storage of each tensor output, decided by a compiled graph's plan (None: a value that
    lives only inside a kernel, a 0-byte fused storage); without it, storages follow the fake values.
    `written`: the storage an eager in-place write puts the (single) output in."""
    if output_sids is not None:
        return _planned_node(node, phase, recomputed, table, values, output_sids)
    inputs = {}
    for arg in input_nodes(node):
        val, tv = arg.meta.get("val"), values.get(arg)
        if isinstance(val, torch.Tensor) and isinstance(tv, TensorValue):
            inputs.setdefault(storage_key(val), tv.storage_id)
    if written is not None:
        inputs[storage_key(node.meta["val"])] = written
    new_values = {}
    fresh = False
    for t in flat_tensors(node.meta.get("val")):
        key = storage_key(t)
        sid = inputs.get(key)
        if sid is None:
            sid = inputs[key] = table.add(t, StorageRole.INTERMEDIATE)
            fresh = True
        new_values[id(t)] = TensorValue(sid, tuple(int(d) for d in t.shape), dtype_name(t.dtype))
    values[node] = _structure(node.meta.get("val"), new_values)
    draft = _draft(node, phase, recomputed, values, tuple(new_values.values()), is_view=bool(new_values) and not fresh)
    draft.writes_in_place = written is not None
    return draft


def _planned_node(node, phase, recomputed, table, values, output_sids: list) -> OpDraft:
    inputs = {v.storage_id for v in _iter_tensor_values(_plain(_unwrapped_args(node), values))}
    new_values = {}
    for t, sid in zip(flat_tensors(node.meta.get("val")), output_sids):
        if sid is None:
            sid = table.add(None, StorageRole.INTERMEDIATE, nbytes=t.untyped_storage().nbytes(), dtype=dtype_name(t.dtype),
                            shape=tuple(int(d) for d in t.shape), fused=True)
        new_values[id(t)] = TensorValue(sid, tuple(int(d) for d in t.shape), dtype_name(t.dtype))
    values[node] = _structure(node.meta.get("val"), new_values)
    outputs = tuple(new_values.values())
    return _draft(node, phase, recomputed, values, outputs,
                  is_view=bool(outputs) and all(v.storage_id in inputs for v in outputs))


def _iter_tensor_values(obj):
    if isinstance(obj, TensorValue):
        yield obj
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _iter_tensor_values(item)


def _draft(node, phase, recomputed, values, outputs, *, is_view: bool) -> OpDraft:
    backward_meta = node.meta.get("partitioner_tag") == "is_backward"
    stack = node.meta.get("fwd_nn_module_stack") if backward_meta else node.meta.get("nn_module_stack")
    return OpDraft(
        name=node.name,
        target=target_name(node.meta.get("wrapped_target", node.target)),
        phase=phase,
        args=_plain(_unwrapped_args(node), values),
        kwargs=tuple((k, _plain(v, values)) for k, v in _unwrapped_kwargs(node).items()),
        outputs=outputs,
        source=loc_from_stack_trace(node.meta.get("stack_trace")),
        module=module_from_stack(stack),
        is_view=is_view,
        seq_nr=node.meta.get("seq_nr"),
        frames=user_frames(node.meta.get("stack_trace")) if phase is Phase.FORWARD else (),
        torch_call=(node.meta.get("torch_fn") or (None,))[0] if phase is Phase.FORWARD or recomputed else None,
        recomputed=recomputed or bool(node.meta.get(RERUN_KEY)),
        checkpoint_region=node.meta.get("ac_graph_id", node.meta.get(REGION_KEY)),
        held_to_region_end=outputs if node.meta.get(HELD_KEY) else (),
        partial_held=phase is Phase.FORWARD and bool((node.meta.get("custom") or {}).get(PARTIAL_HELD_KEY)),
        frame_held=tuple((node.meta.get("custom") or {}).get(FRAME_HELD_KEY, ())) if phase is Phase.FORWARD
        and not recomputed else (),
        rerun_of=node.meta.get(RERUN_KEY),
        must_save=getattr(node.meta.get("recompute"), "name", "") == "MUST_SAVE",
        casts_graph_input=_casts_graph_input(node),
    )


def _casts_graph_input(node: fx.Node) -> bool:
    args = _unwrapped_args(node)
    return target_name(node.meta.get("wrapped_target", node.target)) == "aten._to_copy.default" and \
        bool(args) and isinstance(args[0], fx.Node) and args[0].op == "placeholder"


def _unwrapped_args(node: fx.Node) -> tuple:
    call = rng_wrapped_call(node) if "wrapped_target" in node.meta else None
    return node.args if call is None else call[1]


def _unwrapped_kwargs(node: fx.Node) -> dict:
    """A replayed random op reads the saved RNG state: kept as an input (a keyword the formulas ignore)."""
    call = rng_wrapped_call(node) if "wrapped_target" in node.meta else None
    return dict(node.kwargs) if call is None else call[2]


def _apply_grad_semantics(cap, loss_node, grad_outputs, table, values, node_pos, ops, grads_preexisting, *,
                          compiled: bool) -> GraphPart:
    loss_sid = values[loss_node].storage_id
    table.update(loss_sid, persistent=True, name="loss")
    grads: dict[int, list[tuple[int, TensorValue]]] = {}      # id(param) -> [(ready position, grad value)]
    fake_grads: dict[int, Any] = {}                           # id(grad value) -> its fake tensor (strides)
    owners: dict[int, tuple[str, torch.Tensor]] = {}
    leaves = {leaf.fqn: leaf for leaf in cap.forward_leaves}
    leaves_by_tensor = {id(leaf.tensor): leaf for leaf in cap.forward_leaves}
    for fqn, out in grad_outputs:
        param = leaves[fqn].tensor if fqn in leaves else cap.param_by_fqn[fqn]
        name = f"leaf made in forward{_at(leaves[fqn].source)}" if fqn in leaves else normalize_module_path(fqn)
        owners.setdefault(id(param), (name, param))
        ready = len(ops) - 1 if compiled else _end_of_autograd_node(ops, node_pos[out])
        grads.setdefault(id(param), []).append((ready, values[out]))
        fake_grads[id(values[out])] = out.meta.get("val")
    inserts: list[tuple[int, OpDraft]] = []
    grad_sid_by_param: dict[int, int] = {}
    for pid, incoming in grads.items():
        incoming.sort(key=lambda item: item[0])
        name, param = owners[pid]
        made_in_forward = any(leaf.tensor is param for leaf in cap.forward_leaves)
        # .grad lives with its tensor: a reentrant region's leaf dies with the rerun's graph
        kept = not (made_in_forward and _in_reentrant_region(cap, leaves_by_tensor[pid]))
        if grads_preexisting and not made_in_forward:      # a fresh leaf has no .grad from the last step
            grad_value = _new_grad(table, param, name, preexisting=True)
            for pos, value in incoming:
                inserts.append((pos, _accumulate_op(f"accumulate_grad_{name}", "aten.add_.Tensor",
                                                    (grad_value, value), grad_value, ops[pos])))
        elif len(incoming) == 1 and not _obeys_layout_contract(fake_grads.get(id(incoming[0][1])), param):
            # AccumulateGrad's `clone_obey_contract`: a gradient with other strides than its parameter (a
            # conv's weight gradient is channels_last when its input is) is copied into a new tensor with the
            # parameter's strides (`new_empty_strided` + `copy_`); the incoming one is freed
            pos, value = incoming[0]
            grad_value = _new_grad(table, param, name, preexisting=False, persistent=kept)
            inserts.append((pos, _accumulate_op(f"accumulate_grad_{name}", "aten.clone.default", (value,),
                                                grad_value, ops[pos], fresh=True, own_node=not compiled)))
        elif len(incoming) == 1:
            grad_value = incoming[0][1]
            table.update(grad_value.storage_id, role=StorageRole.GRADIENT, persistent=kept, name=f"{name}.grad")
        else:
            grad_value = _new_grad(table, param, name, preexisting=False, persistent=kept)
            acc = incoming[0][1]
            for pos, value in incoming[1:]:
                out = grad_value if pos == incoming[-1][0] else _fresh_sum(table, param, name)
                inserts.append((pos, _accumulate_op(f"accumulate_grad_{name}", "aten.add.Tensor",
                                                    (acc, value), out, ops[pos], fresh=True)))
                acc = out
        if not made_in_forward:       # not the model's: the optimizer and zero_grad never see it
            grad_sid_by_param[pid] = grad_value.storage_id
    for pos, op in sorted(inserts, key=lambda item: item[0], reverse=True):
        ops.insert(pos + 1, op)
    seed = next((op.outputs[0].storage_id for op in ops if op.name == SEED_OP_NAME), None)
    return GraphPart(ops=ops, grad_sid_by_param=grad_sid_by_param, loss_sid=loss_sid, seed_sid=seed)


def _obeys_layout_contract(grad, param) -> bool:
    """`obeys_layout_contract` (torch/csrc/autograd/utils/grad_layout_contract.h), for AccumulateGrad's
    steal of a strided gradient: a non-overlapping and dense parameter takes it as `.grad` only with its own
    strides (sizes of 1 aside, unless 0-strided); any other parameter only a contiguous one. Unknown
    strides (no fake value) count as obeying."""
    if not isinstance(grad, torch.Tensor) or not isinstance(param, torch.Tensor) or grad.layout != torch.strided \
            or param.layout != torch.strided:
        return True
    if not _non_overlapping_and_dense(param):
        return grad.is_contiguous()
    for size, grad_stride, param_stride in zip(grad.shape, grad.stride(), param.stride()):
        if (size != 1 and grad_stride != param_stride) or (size == 1 and grad_stride == 0):
            return False
    return True


def _non_overlapping_and_dense(t: torch.Tensor) -> bool:
    """c10's `is_non_overlapping_and_dense`: some permutation of the dims makes the tensor contiguous."""
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _new_grad(table, param, name, *, preexisting: bool, persistent: bool = True) -> TensorValue:
    sid = table.add(None, StorageRole.GRADIENT, nbytes=param.untyped_storage().nbytes(), dtype=dtype_name(param.dtype),
                    shape=tuple(param.shape), preexisting=preexisting, persistent=persistent, name=f"{name}.grad")
    return TensorValue(sid, tuple(param.shape), dtype_name(param.dtype))


def _end_of_autograd_node(ops: list[OpDraft], pos: int) -> int:
    """Eager runs AccumulateGrad after the whole backward node that produced the gradient."""
    seq_nr = ops[pos].seq_nr
    while seq_nr is not None and pos + 1 < len(ops) and ops[pos + 1].seq_nr == seq_nr:
        pos += 1
    return pos


def _fresh_sum(table, param, name) -> TensorValue:
    sid = table.add(None, StorageRole.INTERMEDIATE, nbytes=param.untyped_storage().nbytes(),
                    dtype=dtype_name(param.dtype), shape=tuple(param.shape), name=f"{name} partial grad sum")
    return TensorValue(sid, tuple(param.shape), dtype_name(param.dtype))


def _accumulate_op(name, target, args, out, producer: OpDraft, fresh=False, own_node=False) -> OpDraft:
    """`own_node`: the op runs in AccumulateGrad's own node, after the producer's node has released what it
    saved and its incoming gradients."""
    return OpDraft(name=name, target=target, phase=Phase.BACKWARD, args=args, kwargs=(), outputs=(out,),
                   source=producer.source, module=producer.module, is_view=not fresh,
                   seq_nr=None if own_node else producer.seq_nr)


def plain_value(obj, table: StorageTable):
    """Arguments of a live op as plain data: tensors become TensorValues, containers tuples."""
    if isinstance(obj, torch.Tensor):
        return table.value(obj)
    if isinstance(obj, (tuple, list)):
        return tuple(plain_value(o, table) for o in obj)
    if isinstance(obj, (int, float, bool, str)) or obj is None:
        return obj
    return str(obj)


def _structure(val, new_values: dict[int, TensorValue]):
    if isinstance(val, torch.Tensor):
        return new_values[id(val)]
    if isinstance(val, (tuple, list)):
        return tuple(_structure(v, new_values) for v in val)
    return val


def _plain(obj, values):
    if isinstance(obj, fx.Node):
        return values.get(obj)
    if isinstance(obj, (tuple, list)):
        return tuple(_plain(o, values) for o in obj)
    if isinstance(obj, dict):
        return tuple((k, _plain(v, values)) for k, v in obj.items())
    if isinstance(obj, (int, float, bool, str)) or obj is None:
        return obj
    return str(obj)


def input_values(d: OpDraft) -> tuple:
    """The tensor values an op reads (its args and keyword values)."""
    from tracer.stepgraph import _iter_values
    return tuple(_iter_values((d.args, tuple(v for _, v in d.kwargs))))
