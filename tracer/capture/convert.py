"""Convert the joint fx graph into ops over storages, with eager autograd's gradient semantics.

Conventions:
  * getitem nodes are not ops: they name an element of their parent's output tuple.
  * an op's output storage is new unless an earlier value already owns it (then the op is a view).
  * placeholders are pre-existing: parameters and buffers (tied parameters share one storage, as in
    eager), inputs; the loss tangent is a 4-byte `ones_like` made at the start of backward, as
    `loss.backward()` does.
  * gradients follow AccumulateGrad: with grads set to None before the step, a parameter's single
    gradient is stolen as `.grad` (no copy); a tied parameter's gradients are summed out of place when
    the last one is ready. With grads kept from the previous step (`zero_grad(set_to_none=False)`),
    every incoming gradient is added in place into the existing `.grad` and then freed.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from tracer.capture.joint import JointCapture
from tracer.capture.source import loc_from_stack_trace, module_from_stack, user_frames
from tracer.capture.storages import StorageTable, dtype_name
from tracer.stepgraph import Phase, SourceLoc, StorageRole, TensorValue


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


@dataclasses.dataclass
class GraphPart:
    ops: list[OpDraft]
    grad_sid_by_param: dict[int, int]          # id(parameter tensor) -> storage id of its final .grad
    loss_sid: int
    seed_sid: int | None                       # the ones_like(loss) gradient that starts backward


def convert_joint(cap: JointCapture, table: StorageTable, *, grads_preexisting: bool) -> GraphPart:
    joint = cap.joint
    values: dict[fx.Node, Any] = {}
    node_pos: dict[fx.Node, int] = {}
    ops: list[OpDraft] = []
    tangent = _add_placeholders(cap, table, values)
    for node in joint.graph.nodes:
        if node.op != "call_function":
            continue
        if node.target is _GETITEM:
            values[node] = values[node.args[0]][node.args[1]]
            node_pos[node] = node_pos[node.args[0]]
            continue
        if node.meta.get("partitioner_tag") == "is_backward" and not any(o.phase is Phase.BACKWARD for o in ops):
            ops.append(_tangent_op(tangent, table, values))
        ops.append(_convert_node(node, table, values))
        node_pos[node] = len(ops) - 1
    output_node = next(iter(joint.graph.find_nodes(op="output")))
    return _apply_grad_semantics(cap, output_node, table, values, node_pos, ops, grads_preexisting)


_GETITEM = operator.getitem
SEED_OP_NAME = "loss_grad_seed"


def _add_placeholders(cap, table, values) -> tuple:
    """Registers parameters, buffers and inputs; returns the loss tangent (node, fake value)."""
    sid_by_param_id: dict[int, int] = {}
    tangent = (None, None)
    for node in cap.joint.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        kind = type(desc).__name__
        val = node.meta.get("val")
        if kind == "ParamAOTInput" or kind == "BufferAOTInput":
            owner = cap.param_by_fqn.get(desc.target)
            if owner is None:
                owner = cap.buffer_by_fqn.get(desc.target)
            sid = sid_by_param_id.get(id(owner))
            if sid is None:
                role = StorageRole.PARAMETER if kind == "ParamAOTInput" else StorageRole.BUFFER
                sid = table.add(val, role, preexisting=True, persistent=True, name=desc.target)
                sid_by_param_id[id(owner)] = sid
                table.alias(owner, sid)
            else:
                table.alias(val, sid)
            values[node] = table.value(val, sid)
        elif kind == "TangentAOTInput":
            values[node] = None            # made by the synthetic ones_like op at the start of backward
            tangent = (node, val)
        elif isinstance(val, torch.Tensor):
            if val in table:
                values[node] = table.value(val)
            else:
                sid = table.add(val, StorageRole.INPUT, preexisting=True, persistent=True,
                                name=f"input {getattr(desc, 'idx', '?')}")
                values[node] = table.value(val, sid)
        else:
            values[node] = val
    return tangent


def _tangent_op(tangent, table: StorageTable, values) -> OpDraft:
    node, val = tangent
    sid = table.add(val, StorageRole.INTERMEDIATE, name="loss.backward() seed")
    tv = table.value(val, sid)
    values[node] = tv
    return OpDraft(name=SEED_OP_NAME, target="aten.ones_like.default", phase=Phase.BACKWARD, args=(),
                   kwargs=(), outputs=(tv,), source=None, module="", is_view=False)


def _convert_node(node: fx.Node, table: StorageTable, values) -> OpDraft:
    backward = node.meta.get("partitioner_tag") == "is_backward"
    outputs = []
    fresh = False
    for t in _tensors(node.meta.get("val")):
        if t in table:
            outputs.append(table.value(t))
        else:
            sid = table.add(t, StorageRole.INTERMEDIATE)
            outputs.append(table.value(t, sid))
            fresh = True
    values[node] = _structure(node.meta.get("val"), table)
    stack = node.meta.get("fwd_nn_module_stack") if backward else node.meta.get("nn_module_stack")
    return OpDraft(
        name=node.name,
        target=target_name(node.target),
        phase=Phase.BACKWARD if backward else Phase.FORWARD,
        args=_plain(node.args, values),
        kwargs=tuple((k, _plain(v, values)) for k, v in node.kwargs.items()),
        outputs=tuple(outputs),
        source=loc_from_stack_trace(node.meta.get("stack_trace")),
        module=module_from_stack(stack),
        is_view=bool(outputs) and not fresh,
        seq_nr=node.meta.get("seq_nr"),
        frames=user_frames(node.meta.get("stack_trace")) if not backward else (),
    )


def _apply_grad_semantics(cap, output_node, table, values, node_pos, ops, grads_preexisting) -> GraphPart:
    descs = output_node.meta.get("desc") or []
    outs = output_node.args[0]
    loss_sid = values[outs[0]].storage_id
    table.update(loss_sid, persistent=True, name="loss")
    grads: dict[int, list[tuple[int, TensorValue]]] = {}      # id(param) -> [(ready position, grad value)]
    owners: dict[int, torch.Tensor] = {}
    for out, desc in zip(outs, descs):
        if type(desc).__name__ != "GradAOTOutput" or out is None:
            continue
        param = cap.param_by_fqn[desc.grad_of.target]
        owners[id(param)] = param
        grads.setdefault(id(param), []).append((_end_of_autograd_node(ops, node_pos[out]), values[out]))
    inserts: list[tuple[int, OpDraft]] = []
    grad_sid_by_param: dict[int, int] = {}
    for pid, incoming in grads.items():
        incoming.sort(key=lambda item: item[0])
        param = owners[pid]
        name = next(fqn for fqn, p in cap.param_by_fqn.items() if p is param)
        if grads_preexisting:
            grad_sid = table.add(None, StorageRole.GRADIENT, nbytes=param.untyped_storage().nbytes(),
                                 dtype=dtype_name(param.dtype), shape=tuple(param.shape),
                                 preexisting=True, persistent=True, name=f"{name}.grad")
            grad_value = TensorValue(grad_sid, tuple(param.shape), dtype_name(param.dtype))
            for pos, value in incoming:
                inserts.append((pos, _accumulate_op(f"accumulate_grad_{name}", "aten.add_.Tensor",
                                                    (grad_value, value), grad_value, ops[pos])))
        elif len(incoming) == 1:
            grad_sid = incoming[0][1].storage_id
            table.update(grad_sid, role=StorageRole.GRADIENT, persistent=True, name=f"{name}.grad")
        else:
            first = incoming[0][1]
            grad_sid = table.add(None, StorageRole.GRADIENT, nbytes=param.untyped_storage().nbytes(),
                                 dtype=dtype_name(param.dtype), shape=tuple(param.shape),
                                 persistent=True, name=f"{name}.grad")
            total = TensorValue(grad_sid, tuple(param.shape), dtype_name(param.dtype))
            acc = first
            for pos, value in incoming[1:]:
                out = total if pos == incoming[-1][0] else _fresh_sum(table, param, name)
                inserts.append((pos, _accumulate_op(f"accumulate_grad_{name}", "aten.add.Tensor",
                                                    (acc, value), out, ops[pos], fresh=True)))
                acc = out
        grad_sid_by_param[pid] = grad_sid
    for pos, op in sorted(inserts, key=lambda item: item[0], reverse=True):
        ops.insert(pos + 1, op)
    seed = next((op.outputs[0].storage_id for op in ops if op.name == SEED_OP_NAME), None)
    return GraphPart(ops=ops, grad_sid_by_param=grad_sid_by_param, loss_sid=loss_sid, seed_sid=seed)


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


def _accumulate_op(name, target, args, out, producer: OpDraft, fresh=False) -> OpDraft:
    return OpDraft(name=name, target=target, phase=Phase.BACKWARD, args=args, kwargs=(), outputs=(out,),
                   source=producer.source, module=producer.module, is_view=not fresh)


def _tensors(val) -> list[torch.Tensor]:
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for item in val for t in _tensors(item)]
    return []


def plain_value(obj, table: StorageTable):
    """Arguments of a live op as plain data: tensors become TensorValues, containers tuples."""
    if isinstance(obj, torch.Tensor):
        return table.value(obj)
    if isinstance(obj, (tuple, list)):
        return tuple(plain_value(o, table) for o in obj)
    if isinstance(obj, (int, float, bool, str)) or obj is None:
        return obj
    return str(obj)


def _structure(val, table: StorageTable):
    if isinstance(val, torch.Tensor):
        return table.value(val)
    if isinstance(val, (tuple, list)):
        return tuple(_structure(v, table) for v in val)
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


def target_name(target) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))
