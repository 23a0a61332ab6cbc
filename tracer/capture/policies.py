"""Apply a recompute policy to the captured joint graph and partition it (the user's model is untouched).

  * eager: the joint graph as is, or, when the user's forward checkpoints modules (seen in a fake run,
    since non-strict export drops torch.utils.checkpoint), those modules checkpointed as below.
  * compiled: `min_cut_rematerialization_partition` with parameters and buffers as static inputs (what
    torch.compile's partitioner saves), optionally under `activation_memory_budget`.
  * full / selective: forward nodes inside checkpointed blocks get `meta["recompute"]` (PREFER_RECOMPUTE,
    or MUST_SAVE for ops the save predicate names) and `meta["ac_graph_id"]` = block index, as
    torch.utils.checkpoint's selective contexts would tag them (a block's outputs stay untagged: eager
    checkpointing returns them as ordinary tensors); then `default_partition` materialises the
    recomputation in the backward graph, as eager non-reentrant checkpointing does.
Blocks are module paths `prefix.N` repeated in forward (the most frequent prefix with >= 2 indices), or
those matching `--blocks` (a glob such as `layers.*`); a model with no repeated blocks is checkpointed
as one region (the whole forward), and the report says so.
Inductor's fusion is modelled in tracer.capture.convert; CUDA-graph pools are not.
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
    """Partition for the policy. Modules the user's forward already checkpoints are checkpointed in every
    policy (as torch.compile and eager both honour them); `full`/`selective` then tag their own blocks."""
    user_regions = list(cap.seen.checkpointed_modules)
    notes: tuple[str, ...] = ()
    if spec.name == "eager" and not user_regions:
        return Schedule(joint=cap.joint)
    from torch._functorch.partitioners import default_partition, min_cut_rematerialization_partition
    from torch._guards import TracingContext, tracing
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    joint = _lazy_copy(cap.joint)
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    static = [i for i, p in enumerate(placeholders)
              if type(p.meta.get("desc")).__name__ in ("ParamAOTInput", "BufferAOTInput")]
    output = next(iter(joint.graph.find_nodes(op="output")))
    num_fwd = sum(1 for d in output.meta["desc"] if d is not None and type(d).__name__ != "GradAOTOutput")
    if user_regions:
        _tag_regions(joint, user_regions, lambda target: False)
    if spec.name == "compiled":
        partition, budget = min_cut_rematerialization_partition, spec.memory_budget
    elif spec.name in ("full", "selective"):
        blocks = find_blocks(joint, spec.blocks)
        if not blocks and spec.blocks is not None:
            raise UsageError(f"no module matches --blocks {spec.blocks!r}",
                             hint="give a glob over module paths, e.g. --blocks 'layers.*'")
        if not blocks:
            blocks = [""]       # nothing repeats: the whole forward is one checkpointed region
            notes = ("no repeated blocks: the whole forward is checkpointed as one region (its inputs are kept, "
                     "everything else is recomputed in backward); name blocks with --blocks",)
        keep = save_predicate(spec) if spec.name == "selective" else (lambda target: False)
        _tag_regions(joint, blocks[::spec.checkpoint_every], keep, first_id=len(user_regions))
        partition, budget = default_partition, None
    elif spec.name == "eager":
        partition, budget = default_partition, None
    else:
        raise UsageError(f"unknown policy {spec.name!r}", hint="valid: eager, compiled, selective, full")
    config = {} if budget is None else {"activation_memory_budget": budget}
    # lazy graph modules: the partitions are read, never run, so their Python code is never generated
    with torch.no_grad(), tracing(TracingContext(cap.fake_mode)), torch._functorch.config.patch(**config), \
            _use_lazy_graph_module(True):
        forward, backward = partition(joint, None, num_fwd_outputs=num_fwd, static_lifetime_input_indices=static)
    return Schedule(joint=cap.joint, forward=forward, backward=backward, num_forward_outputs=num_fwd,
                    compiled=spec.name == "compiled", notes=notes)


def _lazy_copy(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the joint to tag and partition (the partitioners edit it): new nodes with their own meta
    dicts, and a lazy graph module, whose Python code is never generated since it never runs."""
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
    with _use_lazy_graph_module(True):
        return _make_graph_module(joint, copy.deepcopy(joint.graph))


def _tag_regions(joint: torch.fx.GraphModule, regions: list[str], keep, first_id: int = 0) -> None:
    """Tag the forward nodes of each region (a module path) for recomputation, as checkpoint would."""
    from torch.utils.checkpoint import CheckpointPolicy

    region_id = {b: first_id + i for i, b in enumerate(regions)}
    region_of_node = {}
    for node in joint.graph.nodes:
        if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward":
            path = module_from_stack(node.meta.get("nn_module_stack"))
            region_of_node[node] = next((b for b in regions if b == "" or path == b or path.startswith(b + ".")), None)
    for node, region in region_of_node.items():
        if region is None or any(region_of_node.get(user, region) != region for user in node.users):
            continue       # outside every region, or a region output: eager keeps it as is
        node.meta["ac_graph_id"] = region_id[region]
        node.meta["recompute"] = (CheckpointPolicy.MUST_SAVE if keep(target_name(node.target))
                                  else CheckpointPolicy.PREFER_RECOMPUTE)
