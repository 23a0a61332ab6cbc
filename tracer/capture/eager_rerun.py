"""Where and what eager non-reentrant torch.utils.checkpoint recomputes, on a partitioned backward graph.

`rerun_as_eager(joint, backward, parameters)` rewrites, in place, each checkpointed region's recompute in
the backward graph the partitioner made, so it runs as `_checkpoint_hook`'s rerun does: the region's
Python code again, at the first unpack of a tensor saved inside the region, op for op in forward order,
until the last saved tensor the region's backward needs has been packed again (the early stop). The
partitioner instead recomputes only the ops whose values the backward reads, each just before its first
use; so this moves the region's recomputed ops before its first unpacking backward node, in forward
order, and adds the region's ops before the early stop that no backward node reads (an embedding whose
output only feeds the region's outputs): eager runs them, and its frames hold their results.

Not modelled: a region whose recompute reads something made after that node keeps the partitioner's
place and order; an unread op is not rerun when it reads a value the backward graph does not have (an
activation from before the region that nothing saved, a buffer, a user input), nor are the ops that
depend on it; ops a selective policy saves (MUST_SAVE) are not rerun (eager pops their cached outputs).
"""
from __future__ import annotations

import collections
import operator

import torch

from tracer.capture.meta import BACKWARD_REGION_KEY, FORWARD_VALUE_KEY, MEMBER_KEY, TWIN_KEY



def rerun_as_eager(joint: torch.fx.GraphModule, backward: torch.fx.GraphModule, parameters: frozenset[str]) -> None:
    """Each region's recompute at its first unpacking backward node, in forward order, with the region's
    unread ops before the early stop. `joint`: the tagged joint the partition was made from (its node names
    are the backward's recomputed nodes' names); `parameters`: names of its placeholders that are
    parameters, which a rerun op may read though nothing saved them."""
    rank = {node.name: i for i, node in enumerate(joint.graph.nodes)}
    for region, recomputed in _recomputed_by_region(backward).items():
        trigger = _first_unpack(backward, region)
        if trigger is None:
            continue
        position = {n: i for i, n in enumerate(backward.graph.nodes)}
        if any(position[a] > position[trigger] and a not in recomputed for n in recomputed for a in n.all_input_nodes):
            continue       # reads something made after the trigger: keep the partitioner's place
        copies = _joint_names(joint, recomputed)
        added = _add_unread_ops(joint, backward, region, copies, rank, parameters, trigger)
        copies.update({node: node.name for node in added})
        for node in _forward_order(recomputed + added, copies, rank):
            trigger.prepend(node)


def _recomputed_by_region(backward: torch.fx.GraphModule) -> dict[int, list]:
    recomputed: dict[int, list] = collections.defaultdict(list)
    for node in backward.graph.nodes:
        if node.op == "call_function" and not _is_backward(node) and node.meta.get("ac_graph_id") is not None:
            recomputed[node.meta["ac_graph_id"]].append(node)
    return recomputed


def _first_unpack(backward: torch.fx.GraphModule, region: int):
    """Eager non-reentrant checkpointing recomputes a region when its backward first unpacks a tensor saved
    inside it, and autograd unpacks all of a node's saved tensors before the node computes anything: the
    first op of the region's first backward node (by seq_nr) that reads any saved value (a parameter, an
    input or a forward value, recomputed or not). The partitioner places each recomputed op just before its
    own first use instead (after a linear's input-gradient matmul, which reads only the weight)."""
    def saved(value) -> bool:
        return (value.op == "placeholder" and not value.name.startswith("tangents")) or \
            (value.op == "call_function" and not _is_backward(value))

    nodes = [n for n in backward.graph.nodes if n.op == "call_function"]
    unpacking = {n.meta.get("seq_nr") for n in nodes
                 if _is_backward(n) and n.meta.get(BACKWARD_REGION_KEY) == region
                 and any(saved(a) for a in n.all_input_nodes)}
    return next((n for n in nodes if _is_backward(n) and n.meta.get(BACKWARD_REGION_KEY) == region
                 and n.meta.get("seq_nr") in unpacking), None)


def _joint_names(joint: torch.fx.GraphModule, recomputed: list) -> dict:
    """recomputed node -> the name of the joint node it copies: its own name (the partitioner keeps them),
    or, for the partitioner's wrapper of a recomputed random op (run_with_rng_state, named anew; CPU flash
    attention counts as one), the joint node that runs the same op under the same seq_nr."""
    by_call: dict[tuple, list[str]] = collections.defaultdict(list)
    for node in joint.graph.nodes:
        if node.op == "call_function":
            by_call[node.meta.get("seq_nr"), node.target].append(node.name)
    names = {}
    for node in recomputed:
        if getattr(node.target, "__name__", "") == "run_with_rng_state" and len(node.args) > 1:
            candidates = by_call.get((node.meta.get("seq_nr"), node.args[1]))
            if candidates:
                names[node] = candidates.pop(0)
                continue
        names[node] = node.name
    return names


def _forward_order(nodes: list, names: dict, rank: dict[str, int]) -> list:
    """`nodes` in the order the forward ran the joint nodes they copy (`names`); a node with no joint
    counterpart right after its latest input among `nodes`."""
    members = set(nodes)
    key: dict = {}
    for node in nodes:       # backward order: a node's inputs among `nodes` come first
        if names.get(node) in rank:
            key[node] = (rank[names[node]], 0)
        else:
            key[node] = (max((key[a][0] for a in node.all_input_nodes if a in members and a in key), default=-1), 1)
    return sorted(nodes, key=key.__getitem__)


def _add_unread_ops(joint, backward, region: int, recomputed: dict, rank: dict[str, int],
                    parameters: frozenset[str], trigger) -> list:
    """Copies, before `trigger`, of the region's joint nodes that come before its last recomputed node but
    were not recomputed (no backward node reads them), where every input is at hand: a recomputed node, a
    copy made here, a saved value or a parameter. `recomputed`: the region's recomputed nodes -> the joint
    node each copies (`_joint_names`). Returns the copies."""
    from torch.utils.checkpoint import CheckpointPolicy
    by_name = {n.name: n for n in backward.graph.nodes if not _is_backward(n)}
    covered = set(recomputed.values()) | {n.meta[TWIN_KEY] for n in recomputed if TWIN_KEY in n.meta}
    twin_of = {n.meta[TWIN_KEY]: n for n in recomputed if TWIN_KEY in n.meta}
    twin_of.update({name: n for n, name in recomputed.items() if name != n.name})
    stop = max(rank.get(name, -1) for name in recomputed.values())
    copies: dict = {}
    placeholders: dict[str, torch.fx.Node] = {}

    def resolve(value):
        if value in copies:
            return copies[value]
        if value.name in twin_of:
            return twin_of[value.name]
        found = by_name.get(value.name)
        if found is not None and (found.op == "placeholder" or found in recomputed):
            return found
        if value.op == "placeholder" and value.name in parameters:
            return _forward_value(backward, value, placeholders)
        return None

    for node in joint.graph.nodes:
        if node.meta.get(MEMBER_KEY) != region or TWIN_KEY in node.meta or node.name in covered \
                or rank[node.name] > stop or node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE:
            continue
        if not (isinstance(node.target, torch._ops.OpOverload) or node.target is operator.getitem):
            continue
        inputs = {a: resolve(a) for a in node.all_input_nodes}
        if any(v is None for v in inputs.values()):
            continue
        with backward.graph.inserting_before(trigger):
            copy = backward.graph.node_copy(node, inputs.__getitem__)
        copy.meta = dict(node.meta, ac_graph_id=region, recompute=CheckpointPolicy.PREFER_RECOMPUTE)
        copies[node] = copy
    return list(copies.values())


def _forward_value(backward: torch.fx.GraphModule, value, made: dict):
    """A backward placeholder bound to the forward's `value` (a parameter) without saving it."""
    if value.name not in made:
        first = next(iter(backward.graph.nodes))
        with backward.graph.inserting_before(first):
            placeholder = backward.graph.placeholder(f"{value.name}_rerun")
        placeholder.meta = {"val": value.meta.get("val"), FORWARD_VALUE_KEY: value.name}
        made[value.name] = placeholder
    return made[value.name]


def _is_backward(node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"
