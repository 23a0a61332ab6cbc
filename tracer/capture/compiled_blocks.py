"""`block.compile()` on every repeated block: each block a compiled region of its own inside an eager step.

What torch does (torch 2.13): Dynamo traces the block's forward alone; AOT autograd builds the block's own
joint graph (its inputs: the block's parameters, static, and the activations it receives; its tangents: the
gradients of the tensors it returns) and partitions it with Inductor's min-cut, so only the block's own
values can be saved or recomputed; Inductor lowers and plans the block's forward and backward graphs. At
run time the block is one autograd Function (`CompiledFunction`): its forward returns eager tensors, its
saved tensors stay on the node until backward reaches it, and its backward (`CompiledFunctionBackward`)
runs the whole compiled backward graph at once: the saved tensors are handed to it and freed as its
wrapper deletes them, the incoming gradients stay held by the node's arguments until it returns, and the
gradients it returns (parameters and block inputs) all exist when it returns. Everything outside the
blocks runs eager.

Here each block's region is cut out of the captured whole-model joint graph (`compiled_regions`): its
forward nodes (by module path), its backward nodes (by the sequence number of the forward op they
differentiate), and the gradient-accumulation adds that sum gradients of values used more than once
inside the block (`is_gradient_acc` nodes placed among the block's backward nodes, with an input from the
block). The region becomes a joint graph of its own (`primals_*` for every value it reads from outside
forward, `tangents_*` for every gradient it receives), which goes through tracer.capture.inductor_plan
like a whole model.

Not modelled: a gradient accumulation for a value that a block and code outside it both use, when the
engine's sum happens right after the block's backward, is taken as the block's own (one add at the same
place); Dynamo guards and graph breaks inside a block (a block that breaks would be several regions); a
block called more than once per step (refused).
"""
from __future__ import annotations

import dataclasses
import operator

import torch
import torch.fx as fx

from tracer.capture.meta import is_static_input
from tracer.passes.blocks import block_of
from tracer.capture.source import module_from_stack


@dataclasses.dataclass(frozen=True)
class CompiledRegion:
    """One compiled block: its nodes in the whole-model joint graph, and its own partition and plans."""
    block: str
    graph_block: str                    # the block whose nodes the (shared) compiled graphs were made from
    forward_nodes: frozenset            # joint forward nodes of the block (getitems included)
    backward_nodes: frozenset           # joint backward nodes it runs in its compiled backward
    primals: tuple                      # joint nodes the region's forward reads, in `primals_*` order
    tangents: tuple                     # joint nodes (gradients) the region's backward receives, `tangents_*`
    forward_outputs: tuple              # joint nodes the region's forward returns (its user outputs)
    backward_outputs: tuple             # joint nodes the region's backward returns
    forward: fx.GraphModule
    backward: fx.GraphModule
    num_forward_outputs: int
    forward_plan: object                # inductor_plan.GraphPlan
    backward_plan: object


def _is_backward(node: fx.Node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _block_nodes(joint: fx.GraphModule, blocks: list[str]) -> dict[str, tuple[list, list]]:
    """block -> (forward nodes, backward nodes) in joint order."""
    members = frozenset(blocks)

    def block_of_path(path: str) -> str | None:
        return block_of(path, members) or None

    out: dict[str, tuple[list, list]] = {b: ([], []) for b in blocks}
    block_of_seq: dict[int, str] = {}
    region_of: dict[fx.Node, str | None] = {}
    for node in joint.graph.nodes:
        if node.op != "call_function" or _is_backward(node):
            continue
        if node.target is operator.getitem:
            block = region_of.get(node.args[0])
        else:
            block = block_of_path(module_from_stack(node.meta.get("nn_module_stack")))
            if block is not None and node.meta.get("seq_nr") is not None:
                block_of_seq[node.meta["seq_nr"]] = block
        region_of[node] = block
        if block is not None:
            out[block][0].append(node)
    current = None          # the block whose backward nodes the engine is running
    for node in joint.graph.nodes:
        if node.op != "call_function" or not _is_backward(node):
            continue
        if node.target is operator.getitem:
            block = region_of.get(node.args[0])
        elif node.meta.get("is_gradient_acc"):
            # the sum of a value's gradients: the block's own when it comes among the block's backward
            # nodes and adds a gradient the block made
            block = current if any(region_of.get(a) == current for a in node.all_input_nodes) else None
        else:
            block = block_of_seq.get(node.meta.get("seq_nr"))
            current = block
        region_of[node] = block
        if block is not None:
            out[block][1].append(node)
    return out


@dataclasses.dataclass(frozen=True)
class RegionJoint:
    """A block's own joint graph; the node lists are the whole-model joint's nodes that each placeholder
    (`primals_1`, ..., `tangents_1`, ...) or output (forward outputs, then backward outputs) stands for."""
    gm: fx.GraphModule
    primals: tuple
    tangents: tuple
    forward_outputs: tuple
    backward_outputs: tuple
    static_inputs: tuple[int, ...]      # the primals that are parameters or buffers


def region_joint(joint: fx.GraphModule, forward_nodes: list, backward_nodes: list) -> RegionJoint:
    """The block's own joint graph, as AOT autograd traces the compiled block."""
    members = set(forward_nodes) | set(backward_nodes)
    ordered = [n for n in joint.graph.nodes if n in members]
    primals: list = []
    tangents: list = []
    for node in ordered:
        for arg in node.all_input_nodes:
            if arg in members or arg in primals or arg in tangents:
                continue
            is_gradient = _is_backward(arg) or (arg.op == "placeholder" and arg.name.startswith("tangents"))
            (tangents if is_gradient else primals).append(arg)
    graph = fx.Graph()
    env: dict = {}
    static = []
    for i, node in enumerate(primals):
        env[node] = graph.placeholder(f"primals_{i + 1}")
        env[node].meta.update(val=node.meta.get("val"), desc=node.meta.get("desc"))
        if is_static_input(node.meta.get("desc")):
            static.append(i)
    for i, node in enumerate(tangents):
        env[node] = graph.placeholder(f"tangents_{i + 1}")
        env[node].meta.update(val=node.meta.get("val"), desc=None)
    for node in ordered:
        env[node] = graph.node_copy(node, env.__getitem__)

    def leaves(node) -> bool:
        return any(user not in members for user in node.users)

    forward_outputs = [n for n in ordered if not _is_backward(n) and leaves(n)]
    backward_outputs = [n for n in ordered if _is_backward(n) and leaves(n)]
    output = graph.output(tuple(env[n] for n in forward_outputs + backward_outputs))
    output.meta["desc"] = [None] * (len(forward_outputs) + len(backward_outputs))   # the partitioner zips them
    return RegionJoint(fx.GraphModule(torch.nn.Module(), graph), tuple(primals), tuple(tangents),
                       tuple(forward_outputs), tuple(backward_outputs), tuple(static))


def compiled_regions(joint: fx.GraphModule, blocks: list[str], fake_mode, *,
                     start_apart=None) -> tuple[CompiledRegion, ...]:
    """Every block's region, partitioned and planned as block.compile() has Inductor compile it
    (`start_apart`: as inductor_plan.plan_forward_and_backward takes it)."""
    from tracer.capture.schedule import fill_rng_wrapper_values
    from tracer.capture.inductor_plan import donated_inputs, inductor_partition, plan_forward_and_backward

    regions = []
    compiled: dict[tuple, tuple] = {}          # structure -> (forward, backward, their plans)
    for block, (forward_nodes, backward_nodes) in _block_nodes(joint, blocks).items():
        if not forward_nodes:
            continue
        _check_one_call(joint, block, forward_nodes)
        cut = region_joint(joint, forward_nodes, backward_nodes)
        num_forward_outputs = len(cut.forward_outputs)
        key = _structure(cut.gm)
        if key not in compiled:       # identical blocks run one compiled graph, as Dynamo reuses it
            forward, backward = inductor_partition(cut.gm, fake_mode, num_fwd_outputs=num_forward_outputs,
                                                   static_inputs=list(cut.static_inputs))
            for graph in (forward, backward):
                fill_rng_wrapper_values(graph, fake_mode)
            donated = donated_inputs(forward, backward, num_forward_outputs)
            compiled[key] = (forward, backward, *plan_forward_and_backward(
                forward, backward, fake_mode, donated=donated, start_apart=start_apart), block)
        forward, backward, forward_plan, backward_plan, graph_block = compiled[key]
        regions.append(CompiledRegion(
            block=block, graph_block=graph_block, forward_nodes=frozenset(forward_nodes), backward_nodes=frozenset(backward_nodes),
            primals=cut.primals, tangents=cut.tangents, forward_outputs=cut.forward_outputs,
            backward_outputs=cut.backward_outputs, forward=forward, backward=backward,
            num_forward_outputs=num_forward_outputs, forward_plan=forward_plan, backward_plan=backward_plan))
    return tuple(regions)


def _check_one_call(joint: fx.GraphModule, block: str, forward_nodes: list) -> None:
    """A compiled block runs as one call: its forward ops are one run of the joint's forward. Raises
    UsageError for a block whose ops other code interleaves (a block called twice in one step)."""
    from tracer.errors import UsageError

    members = set(forward_nodes)
    forward = [n for n in joint.graph.nodes if n.op == "call_function" and not _is_backward(n)]
    inside = [i for i, n in enumerate(forward) if n in members]
    stray = next((n for n in forward[inside[0]:inside[-1] + 1] if n not in members), None)
    if stray is not None:
        raise UsageError(f"block {block} does not run as one call ({stray.name} runs between its ops): "
                         "calling a compiled block more than once per step is not modelled",
                         hint="name other blocks with --blocks, or use --policy compiled")


def _structure(gm: fx.GraphModule) -> tuple:
    """What the region's compiled graphs depend on: every node's op, target, arguments (other nodes by
    position), tags and value layouts; equal for blocks that differ only in their parameters' values."""
    position: dict = {}
    out = []
    for i, node in enumerate(gm.graph.nodes):
        position[node] = i
        arguments = fx.node.map_arg((node.args, node.kwargs), lambda n: ("node", position[n]))
        out.append((node.op, str(node.target), repr(arguments), _layout(node.meta.get("val")),
                    type(node.meta.get("desc")).__name__, node.meta.get("partitioner_tag"),
                    bool(node.meta.get("is_gradient_acc")), str(node.meta.get("recompute"))))
    return tuple(out)


def _layout(val):
    if isinstance(val, torch.Tensor):
        return (tuple(val.shape), tuple(val.stride()), val.storage_offset(), str(val.dtype), val.requires_grad)
    if isinstance(val, (list, tuple)):
        return tuple(_layout(v) for v in val)
    return repr(val)
