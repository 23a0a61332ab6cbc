"""Apply a recompute policy to the captured joint graph and partition it (the user's model is untouched).

  * eager: the joint graph as is.
  * compiled: `min_cut_rematerialization_partition` with parameters and buffers as static inputs (what
    torch.compile's partitioner saves), optionally under `activation_memory_budget`.
  * full / selective: forward nodes inside checkpointed blocks get `meta["recompute"]` (PREFER_RECOMPUTE,
    or MUST_SAVE for ops the save predicate names) and `meta["ac_graph_id"]` = block index, as
    torch.utils.checkpoint's selective contexts would tag them (a block's outputs stay untagged: eager
checkpointing returns them as ordinary tensors); then `default_partition` materialises the
    recomputation in the backward graph, as eager non-reentrant checkpointing does.
Blocks are module paths `prefix.N` repeated in forward (the most frequent prefix with >= 2 indices), or
those matching `--blocks` (a glob such as `layers.*`).
Not modelled: Inductor's fusion of intermediates inside the compiled graphs (every op's output is
materialised), CUDA-graph pools.
"""
from __future__ import annotations

import collections
import copy
import fnmatch
import re

import torch

from tracer.capture.convert import Schedule, target_name
from tracer.capture.joint import JointCapture
from tracer.capture.source import module_from_stack
from tracer.errors import UsageError
from tracer.policies import PolicySpec, save_predicate

_BLOCK_RE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def block_of(module_path: str) -> str | None:
    match = _BLOCK_RE.match(module_path)
    return match.group(1) if match else None


def find_blocks(joint: torch.fx.GraphModule, pattern: str | None) -> list[str]:
    """Block module paths in forward order."""
    seen: dict[str, None] = {}
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward":
            path = module_from_stack(node.meta.get("nn_module_stack"))
            if pattern is not None:
                parts = path.split(".")
                for i in range(len(parts), 0, -1):
                    if fnmatch.fnmatchcase(".".join(parts[:i]), pattern):
                        seen.setdefault(".".join(parts[:i]))
                        break
            elif (block := block_of(path)) is not None:
                seen.setdefault(block)
    blocks = list(seen)
    if pattern is None:
        prefixes = collections.Counter(b.rsplit(".", 1)[0] for b in blocks)
        if not prefixes or prefixes.most_common(1)[0][1] < 2:
            return []
        top = prefixes.most_common(1)[0][0]
        blocks = [b for b in blocks if b.rsplit(".", 1)[0] == top]
    return blocks


def policy_schedule(cap: JointCapture, spec: PolicySpec) -> Schedule:
    if spec.name == "eager":
        return Schedule(joint=cap.joint)
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._guards import TracingContext, tracing

    joint = copy.deepcopy(cap.joint)
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    static = [i for i, p in enumerate(placeholders)
              if type(p.meta.get("desc")).__name__ in ("ParamAOTInput", "BufferAOTInput")]
    output = next(iter(joint.graph.find_nodes(op="output")))
    num_fwd = sum(1 for d in output.meta["desc"] if d is not None and type(d).__name__ != "GradAOTOutput")
    if spec.name == "compiled":
        partition, budget = min_cut_rematerialization_partition, spec.memory_budget
    elif spec.name in ("full", "selective"):
        _tag_checkpointed_blocks(joint, spec)
        partition, budget = default_partition, None
    else:
        raise UsageError(f"unknown policy {spec.name!r}", hint="valid: eager, compiled, selective, full")
    config = {} if budget is None else {"activation_memory_budget": budget}
    with torch.no_grad(), tracing(TracingContext(cap.fake_mode)), torch._functorch.config.patch(**config):
        forward, backward = partition(joint, None, num_fwd_outputs=num_fwd, static_lifetime_input_indices=static)
    return Schedule(joint=cap.joint, forward=forward, backward=backward, num_forward_outputs=num_fwd,
                    compiled=spec.name == "compiled")


def _tag_checkpointed_blocks(joint: torch.fx.GraphModule, spec: PolicySpec) -> None:
    from torch.utils.checkpoint import CheckpointPolicy

    blocks = find_blocks(joint, spec.blocks)
    if not blocks:
        raise UsageError("no repeated blocks found to checkpoint",
                         hint="name them with --blocks 'layers.*' (a glob over module paths)")
    chosen = {b: i for i, b in enumerate(blocks) if i % spec.checkpoint_every == 0}
    keep = save_predicate(spec) if spec.name == "selective" else (lambda target: False)
    block_of_node = {}
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward":
            path = module_from_stack(node.meta.get("nn_module_stack"))
            block_of_node[node] = next((b for b in chosen if path == b or path.startswith(b + ".")), None)
    for node, block in block_of_node.items():
        if block is None or any(block_of_node.get(user, block) != block for user in node.users):
            continue       # outside every checkpointed block, or a block output: eager keeps it as is
        node.meta["ac_graph_id"] = chosen[block]
        node.meta["recompute"] = (CheckpointPolicy.MUST_SAVE if keep(target_name(node.target))
                                  else CheckpointPolicy.PREFER_RECOMPUTE)
