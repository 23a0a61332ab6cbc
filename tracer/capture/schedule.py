"""How a policy reads the captured step (`Schedule`), and the random-op wrappers a partition leaves.

A `Schedule` is the joint graph alone (eager), or a (forward, backward) partition of it (checkpointing,
compiled) with Inductor's plans, or the joint with compiled blocks cut out of it; tracer/capture/policies.py
makes it, tracer/capture/convert.py reads it. Checkpointed random ops come out of the partitioner wrapped in
run_and_save_rng_state / run_with_rng_state nodes without meta: `fill_rng_wrapper_values` and
`restore_rng_wrapper_meta` give them their values and the wrapped op's source meta.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any

import torch
import torch.fx as fx

from tracer.capture.meta import rng_wrapped_call

_GETITEM = operator.getitem


@dataclasses.dataclass(frozen=True)
class Schedule:
    """How to read the step: the joint graph alone, or a (forward, backward) partition of it."""
    joint: fx.GraphModule
    forward: fx.GraphModule | None = None
    backward: fx.GraphModule | None = None
    num_forward_outputs: int = 1
    compiled: bool = False            # one compiled autograd node: grads ready when the backward returns
    notes: tuple[str, ...] = ()       # how the policy was applied, for the report
    forward_plan: Any = None          # inductor_plan.GraphPlan of `forward` (compiled): order and storages
    backward_plan: Any = None
    regions: tuple = ()               # block.compile(): compiled_blocks.CompiledRegion per block of the joint


def is_rng_wrapper(node: fx.Node) -> bool:
    return node.op == "call_function" and rng_wrapped_call(node) is not None


def fill_rng_wrapper_values(gm: fx.GraphModule, fake_mode) -> None:
    """`fill_rng_wrapper_meta` for every wrapper of `gm` that has no value yet (before Inductor plans it)."""
    for node in gm.graph.nodes:
        if node.op == "call_function" and is_rng_wrapper(node) and node.meta.get("val") is None:
            fill_rng_wrapper_meta(node, fake_mode)


_WRAPPED_OP_META = ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "seq_nr", "ac_graph_id")


def restore_rng_wrapper_meta(forward: fx.GraphModule, backward: fx.GraphModule) -> None:
    """The partitioner replaces each recomputed random op (dropout, attention with dropout) by a wrapper
    node without meta: run_and_save_rng_state in the forward, whose `[1]` item gets the op's meta, and
    run_with_rng_state in the backward, which gets none. Give each wrapper the wrapped op's source meta
    (its stack trace, module, torch call, sequence number, region): the backward's from the forward wrapper
    of the same op on the same arguments (the partitioner keeps the joint's node names)."""
    by_call: dict[tuple, dict] = {}
    for node in forward.graph.nodes:
        if node.op != "call_function" or getattr(node.target, "__name__", "") != "run_and_save_rng_state":
            continue
        item = next((u for u in node.users if u.target is _GETITEM and u.args[1] == 1), None)
        if item is None:
            continue
        meta = {k: item.meta[k] for k in _WRAPPED_OP_META if k in item.meta}
        for key, value in meta.items():
            node.meta.setdefault(key, value)
        by_call[_wrapped_call(node.args[0], node.args[1:])] = meta
    for node in backward.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "run_with_rng_state":
            for key, value in by_call.get(_wrapped_call(node.args[1], node.args[2:]), {}).items():
                node.meta.setdefault(key, value)


def _wrapped_call(op, args) -> tuple:
    return (op, tuple(a.name if isinstance(a, fx.Node) else repr(a) for a in args))


def fill_rng_wrapper_meta(node: fx.Node, fake_mode) -> None:
    """Checkpointing wraps random ops in run_and_save_rng_state(op, *args) -> (rng_state, out) and
    run_with_rng_state(rng_state, op, *args) -> out; the partitioner leaves these nodes without meta.
    Their values come from running the wrapped op on fake inputs; the saved CPU RNG state is a uint8
    tensor of torch.get_rng_state()'s size. Attribution comes from the wrapped op (`restore_rng_wrapper_meta`),
    else falls back to the first input's line and module."""
    saving = node.target.__name__ == "run_and_save_rng_state"
    op, args, kwargs = rng_wrapped_call(node)
    fake_args = fx.node.map_arg(args, lambda n: n.meta.get("val"))
    fake_kwargs = fx.node.map_arg({k: v for k, v in kwargs.items() if k != "rng_state"},
                                  lambda n: n.meta.get("val"))
    with fake_mode:
        out = op(*fake_args, **fake_kwargs)
        rng_state = torch.empty(torch.get_rng_state().numel(), dtype=torch.uint8) if saving else None
    node.meta["val"] = (rng_state, out) if saving else out
    source = next((n for n in input_nodes(node) if n.meta.get("stack_trace")), None)
    if source is not None:
        for key in ("stack_trace", "nn_module_stack", "fwd_nn_module_stack", "seq_nr", "ac_graph_id"):
            if key in source.meta:
                node.meta.setdefault(key, source.meta[key])
    node.meta["wrapped_target"] = op


def input_nodes(node: fx.Node) -> list[fx.Node]:
    found: list[fx.Node] = []
    fx.node.map_arg((node.args, node.kwargs), found.append)
    return found
