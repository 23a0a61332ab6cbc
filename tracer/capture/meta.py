"""What the capture's stages write on fx nodes and read back: the node-meta keys and the AOT autograd
descriptor predicates, in one place below every stage (model input, build, joint trace, policies, conversion,
lifetimes), so that no stage imports a later one to read what an earlier one wrote.

Keys on `node.meta` (or `node.meta["custom"]`, where torch.export carries user annotations through):

    CHECKPOINT_KEY       the index of the torch.utils.checkpoint call a forward node ran inside (export's trace)
    PARTIAL_HELD_KEY     a view of a tensor a reentrant region's functools.partial binds
    FRAME_HELD_KEY       (region, shape, dtype, node) of a tensor a non-reentrant region's frame holds
    REGION_KEY           the reentrant region a forward op, or its rerun, belongs to
    RERUN_KEY            a reentrant region's forward op run again inside backward: its name
    HELD_KEY             a rerun value the region's backward holds until it ends
    FORWARD_VALUE_KEY    a backward placeholder for a forward node's value, not saved: its name
    BACKWARD_REGION_KEY  a backward node of a checkpointed region's forward op
    MEMBER_KEY           a forward node of a checkpointed region (outputs included)
    TWIN_KEY             a region output's recomputed twin: the output's node name
    INPLACE_CALL_KEY     ("custom") the nodes of one in-place torch call
    FORMULA_WRITE_KEY    ("custom") an in-place aten op of a backward formula
    SUBCLASS_OP_KEY      a forward node made inside a tensor subclass's handler of one op (the op's name):
                         selective checkpointing sees that op, not the ops its handler runs
    SUBCLASS_OUTPUT_KEY  of those, the node that makes one of the op's outputs (its last maker)

Descriptors (`meta["desc"]` of the joint's placeholders and outputs, torch._functorch's AOT descriptors) are
told apart by class name, as torch 2.13 names them; the predicates below are the only place that does.
"""
from __future__ import annotations

import torch

CHECKPOINT_KEY = "tracer_checkpoint"
PARTIAL_HELD_KEY = "tracer_partial_held"
FRAME_HELD_KEY = "tracer_frame_held"
REGION_KEY = "tracer_checkpoint_region"
RERUN_KEY = "tracer_rerun"
HELD_KEY = "tracer_held_to_region_end"
FORWARD_VALUE_KEY = "tracer_forward_value"
BACKWARD_REGION_KEY = "tracer_backward_of_region"
MEMBER_KEY = "tracer_region_member"
TWIN_KEY = "tracer_twin_of"
INPLACE_CALL_KEY = "tracer_inplace_call"
FORMULA_WRITE_KEY = "tracer_formula_write"
SUBCLASS_OP_KEY = "tracer_subclass_op"
SUBCLASS_OUTPUT_KEY = "tracer_subclass_op_output"

# the names a module's call goes through, as a function (`functools.partial(layer.__call__, ...)`)
MODULE_CALL_ENTRIES = ("forward", "__call__", "_call_impl", "_wrapped_call_impl")


_SUBCLASS_PARTS = ("SubclassGetAttrAOTInput", "SubclassGetAttrAOTOutput")


def whole_desc(desc):
    """The descriptor of the tensor a placeholder or an output is part of: a tensor subclass (a DTensor
    parameter, its gradient) is flattened into its inner attributes, each described as
    `SubclassGetAttr(base, attr)`; anything else is its own whole."""
    while _kind(desc) in _SUBCLASS_PARTS:
        desc = desc.base
    return desc


def inner_path(desc) -> tuple[str, ...]:
    """The attributes from the whole tensor down to this part (`("_local_tensor",)` for a DTensor's shard;
    () for a plain tensor)."""
    path = []
    while _kind(desc) in _SUBCLASS_PARTS:
        path.append(desc.attr)
        desc = desc.base
    return tuple(reversed(path))


def _kind(desc) -> str:
    return type(desc).__name__


def is_parameter_input(desc) -> bool:
    """A placeholder for a parameter, or for a part of a subclass parameter (a leaf the forward makes is
    lifted to one too: see forward_leaves)."""
    return _kind(whole_desc(desc)) == "ParamAOTInput"


def is_static_input(desc) -> bool:
    """A placeholder for a parameter or a buffer (or a part of one): a static input of a compiled graph."""
    return _kind(whole_desc(desc)) in ("ParamAOTInput", "BufferAOTInput")


def is_effect_token_input(desc) -> bool:
    """The placeholder of an effect token (an effectful op in forward: a c10d collective under `--ep`); the
    joint graph returns no gradient for it."""
    return _kind(desc) in ("ForwardTokenAOTInput", "BackwardTokenAOTInput")


def is_tangent_input(desc) -> bool:
    """The placeholder of the gradient that starts backward (the loss's tangent)."""
    return _kind(desc) == "TangentAOTInput"


def is_gradient_output(desc) -> bool:
    """A parameter's or input's gradient, or a part of a subclass gradient."""
    return _kind(whole_desc(desc)) == "GradAOTOutput"


def is_forward_output(desc) -> bool:
    """An output the forward graph returns (the loss, a buffer's new value, the forward's effect token),
    not a gradient nor the backward's effect token, which the joint graph returns after the gradients."""
    return desc is not None and _kind(whole_desc(desc)) not in ("GradAOTOutput", "BackwardTokenAOTOutput")


def is_input_mutation_output(desc) -> bool:
    """An output that writes a buffer or a user input the forward updated in place."""
    return _kind(desc) == "InputMutationAOTOutput"


def loss_output_index(descs: list) -> int:
    """The loss is the module's output 0; the buffers a forward updates (BatchNorm's running stats) come
    before it in the joint's outputs."""
    return next((i for i, d in enumerate(descs) if _kind(d) == "PlainAOTOutput" and d.idx == 0), 0)


def target_name(target) -> str:
    """An fx node's target as the step graph names it: "aten.mm.default", else its __name__."""
    if isinstance(target, torch._ops.OpOverload):
        return f"aten.{target._opname}.{target._overloadname}" if target.namespace == "aten" else str(target)
    return getattr(target, "__name__", str(target))


def rng_wrapped_call(node) -> tuple | None:
    """(op, args, kwargs) that a recomputed random op's wrapper runs, or None for any other node. The
    partitioner wraps a random op that backward recomputes: on the CPU (and for the C++ plan)
    `run_and_save_rng_state(op, *args) -> (state, out)` and `run_with_rng_state(state, op, *args)`, whose
    saved state is kept as an `rng_state` keyword; on CUDA `graphsafe_run_with_rng_state(op, *args,
    rng_state=generator)` in forward and backward alike (the generator's state is a graph input)."""
    name = getattr(node.target, "__name__", "")
    if name == "run_and_save_rng_state":
        return node.args[0], node.args[1:], dict(node.kwargs)
    if name == "run_with_rng_state":
        return node.args[1], node.args[2:], {**node.kwargs, "rng_state": node.args[0]}
    if name == "graphsafe_run_with_rng_state":
        return node.args[0], node.args[1:], dict(node.kwargs)
    return None
