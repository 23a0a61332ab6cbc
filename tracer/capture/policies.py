"""Apply a recompute policy to the captured joint graph and partition it (the user's model is untouched).

  * eager: the joint graph as is, or, when the user's forward calls torch.utils.checkpoint (seen in a fake
    run; export tags each call's nodes with its index, `joint.CHECKPOINT_KEY`), those regions checkpointed
    as written: non-reentrant ones tagged as below (with the user's own selective policy function, when
    the call passes one), reentrant ones rewritten so the region reruns whole inside backward
    (`_rerun_reentrant_regions`). A region's output op stays untagged; the region's own backward reads
    a recomputed twin of it.
  * compiled: what torch.compile with Inductor does (tracer.capture.inductor_plan): Inductor's decompositions,
    joint-graph passes and min-cut partition (parameters and buffers static), optionally under
    `activation_memory_budget`, then each graph's kernels and buffers as Inductor lowers, fuses, orders and
    plans them.
  * full / selective: forward nodes inside checkpointed blocks get `meta["recompute"]` (PREFER_RECOMPUTE,
    or MUST_SAVE for ops the save predicate names) and `meta["ac_graph_id"]` = block index, as
    torch.utils.checkpoint's selective contexts would tag them (a block's outputs stay untagged: eager
    checkpointing returns them as ordinary tensors); then `default_partition` materialises the
    recomputation in the backward graph, as eager non-reentrant checkpointing does.
Blocks are module paths `prefix.N` repeated in forward (the most frequent prefix with >= 2 indices), or
those matching `--blocks` (a glob such as `layers.*`); a model with no repeated blocks is checkpointed
as one region (the whole forward), and the report says so.
CUDA-graph pools are not modelled.
"""
from __future__ import annotations

import copy
import dataclasses
import fnmatch
import operator

import torch

from tracer.capture.schedule import Schedule, fill_rng_wrapper_values, restore_rng_wrapper_meta
from tracer.capture.eager_rerun import rerun_as_eager
from tracer.capture.meta import BACKWARD_REGION_KEY, HELD_KEY, MEMBER_KEY, REGION_KEY, RERUN_KEY, TWIN_KEY, \
    CHECKPOINT_KEY, SUBCLASS_OP_KEY, SUBCLASS_OUTPUT_KEY, MODULE_CALL_ENTRIES, is_forward_output, is_parameter_input, is_static_input, target_name, whole_desc
from tracer.capture.joint import JointCapture
from tracer.capture.source import module_from_stack
from tracer.errors import ModelRunError, UsageError
from tracer.passes.blocks import block_of, most_frequent_blocks
from tracer.policies import PolicySpec, save_policy_label, save_predicate



def find_blocks(joint: torch.fx.GraphModule, pattern: str | None) -> list[str]:
    """Block module paths in forward order: those matching `pattern`, else passes.blocks' rule."""
    paths = [module_from_stack(node.meta.get("nn_module_stack")) for node in joint.graph.nodes
             if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward"]
    if pattern is None:
        return most_frequent_blocks(paths)
    seen: dict[str, None] = {}
    for path in paths:
        parts = path.split(".")
        for i in range(len(parts), 0, -1):
            if fnmatch.fnmatchcase(".".join(parts[:i]), pattern):
                seen.setdefault(".".join(parts[:i]))
                break
    return list(seen)


def policy_schedule(cap: JointCapture, spec: PolicySpec, *, plans_in_parallel: bool = False) -> Schedule:
    """Partition for the policy. Regions the user's forward already checkpoints are checkpointed in every
    policy (as torch.compile and eager both honour them), with the user's own selective policy function
    where one was given; `full`/`selective` then tag their own blocks. `plans_in_parallel`: a compiled
    policy's forward is planned in a forked child while this process plans its backward, when this process's
    planning may keep more than one core busy (for a process that may fork: a planning child of its own)."""
    user_calls = cap.seen.checkpoint_calls
    notes: tuple[str, ...] = ()
    if spec.name == "eager" and not user_calls:
        return Schedule(joint=cap.joint)
    if spec.policy.compiled_any:
        notes += recurrent_graph_break_notes(cap.model)
    if spec.policy.compiled_blocks:
        schedule = _compiled_blocks_schedule(cap, spec, _planning_child_starter(plans_in_parallel))
        return dataclasses.replace(schedule, notes=notes + schedule.notes)
    from torch._functorch.partitioners import default_partition
    from torch._guards import TracingContext, tracing
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    joint = _lazy_copy(cap.joint)
    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    static = [i for i, p in enumerate(placeholders)
              if is_static_input(p.meta.get("desc"))]
    output = next(iter(joint.graph.find_nodes(op="output")))
    num_fwd = sum(1 for d in output.meta["desc"] if is_forward_output(d))
    if user_calls:
        notes += _tag_user_regions(joint, user_calls, cap.fake_mode)
        if spec.name == "eager" and all(c.reentrant for c in user_calls):
            return Schedule(joint=joint, notes=notes)     # nothing left for a partitioner to decide
    policy = spec.policy
    if policy.checkpoint is not None:
        blocks = find_blocks(joint, spec.blocks)
        if not blocks and spec.blocks is not None:
            raise UsageError(f"no module matches --blocks {spec.blocks!r}",
                             hint="give a glob over module paths, e.g. --blocks 'layers.*'")
        if not blocks:
            blocks = [""]       # nothing repeats: the whole forward is one checkpointed region
            notes = ("no repeated blocks: the whole forward is checkpointed as one region (its inputs are kept, "
                     "everything else is recomputed in backward); name blocks with --blocks",)
        regions = blocks[::spec.checkpoint_every]
        _tag_regions(joint, _regions_by_module(joint, regions, first_id=len(user_calls)),
                     _region_deciders(spec, cap.fake_mode), whole_regions=policy.compiled)
        if policy.checkpoint == "selective":
            notes += (f"save policy: {save_policy_label(spec)}",)
    partition, budget = default_partition, spec.memory_budget
    config = {} if budget is None else {"activation_memory_budget": budget}
    if policy.compiled:
        return _inductor_schedule(cap, joint, num_fwd, static, config, notes,
                                  _planning_child_starter(plans_in_parallel))
    # lazy graph modules: the partitions are read, never run, so their Python code is never generated
    with torch.no_grad(), tracing(TracingContext(cap.fake_mode)), torch._functorch.config.patch(**config), \
            _use_lazy_graph_module(True):
        forward, backward = partition(joint, None, num_fwd_outputs=num_fwd, static_lifetime_input_indices=static)
    restore_rng_wrapper_meta(forward, backward)
    _drop_backward_ops_from_forward(forward)
    rerun_as_eager(joint, backward, _parameter_placeholders(joint, cap))
    return Schedule(joint=cap.joint, forward=forward, backward=backward, num_forward_outputs=num_fwd, notes=notes)


def recurrent_graph_break_notes(model) -> tuple[str, ...]:
    """torch.compile breaks the graph at an nn.RNN, nn.LSTM or nn.GRU module (dynamo's `allow_rnn`, off by
    default): the recurrent layer runs eagerly between two compiled graphs. A compiled policy plans one graph
    with the layer unrolled in it; the note says so."""
    import torch._dynamo.config
    if model is None or torch._dynamo.config.allow_rnn:
        return ()
    recurrent = sorted({type(m).__name__ for m in model.modules() if isinstance(m, torch.nn.RNNBase)})
    if not recurrent:
        return ()
    return (f"torch.compile breaks the graph at {', '.join(recurrent)} (torch._dynamo.config.allow_rnn is off): "
            "the recurrent layers run eagerly between compiled graphs, which this plan does not model; it plans "
            "them unrolled inside the one compiled graph",)


def _drop_backward_ops_from_forward(forward: torch.fx.GraphModule) -> None:
    """The partitioner copies into the forward every op it can compute from the forward's inputs, and keeps
    the ones nothing reads there (its dead-code pass spares all but collectives); the backward computes its
    own. An op traced in backward that the forward does not read (the context-parallel ring's first
    key/value concatenation, which needs no gradient) runs in backward in eager: removed from the forward."""
    for node in reversed(list(forward.graph.nodes)):
        if node.op == "call_function" and not node.users and node.meta.get("partitioner_tag") == "is_backward":
            forward.graph.erase_node(node)


def _parameter_placeholders(joint: torch.fx.GraphModule, cap: JointCapture) -> frozenset[str]:
    """Names of the joint's placeholders that are parameters (a leaf made in forward is lifted to one, but
    is an activation)."""
    leaves = {leaf.fqn for leaf in cap.forward_leaves}
    return frozenset(p.name for p in joint.graph.find_nodes(op="placeholder")
                     if is_parameter_input(p.meta.get("desc")) and whole_desc(p.meta["desc"]).target not in leaves)


def _inductor_schedule(cap: JointCapture, joint, num_fwd: int, static: list[int], config: dict,
                       notes: tuple[str, ...], start_apart=None) -> Schedule:
    """torch.compile's step: Inductor's decompositions and partition, then each graph's kernels and buffer
    plan as Inductor lowers, fuses, orders and plans it (tracer.capture.inductor_plan)."""
    from tracer.capture.inductor_plan import donated_inputs, inductor_partition, plan_forward_and_backward

    with torch._functorch.config.patch(**config):
        forward, backward = inductor_partition(joint, cap.fake_mode, num_fwd_outputs=num_fwd, static_inputs=static)
    restore_rng_wrapper_meta(forward, backward)
    for graph in (forward, backward):
        fill_rng_wrapper_values(graph, cap.fake_mode)     # recomputed random ops (checkpointed blocks)
    donated = donated_inputs(forward, backward, num_fwd)
    forward_plan, backward_plan = plan_forward_and_backward(forward, backward, cap.fake_mode, donated=donated,
                                                            start_apart=start_apart)
    if forward_plan.scratch or backward_plan.scratch:
        from tracer.capture.triton_target import intra_op_threads
        notes += (f"CPU flash-attention scratch sized for the run's {intra_op_threads()} intra-op "
                  "threads (torch.get_num_threads(); it grows with the training run's thread count)",)
    return Schedule(joint=cap.joint, forward=forward, backward=backward, num_forward_outputs=num_fwd,
                    compiled=True, notes=notes, forward_plan=forward_plan, backward_plan=backward_plan)


def _planning_child_starter(plans_in_parallel: bool):
    """How a compiled graph pair's forward is planned beside its backward (`plan_forward_and_backward`):
    in a forked child, when asked and this process's planning may keep more than one core busy; else None."""
    from tracer.capture.triton_target import planning_cores, start_forked
    return start_forked if plans_in_parallel and planning_cores() > 1 else None


def _compiled_blocks_schedule(cap: JointCapture, spec: PolicySpec, start_apart=None) -> Schedule:
    """block.compile() on every block: the joint as eager runs it, with each block's nodes replaced by its own
    compiled forward and backward (tracer.capture.compiled_blocks). Checkpointing inside a block (the
    policy's own, as torchtitan wraps each block before compiling it, or the model's checkpoint calls made
    inside a block's forward) is traced into the block's graph: its nodes are tagged as AOT autograd tags the
    checkpoint operator's body, and the block's min-cut partition recomputes them in its compiled backward."""
    from tracer.capture.compiled_blocks import compiled_regions

    joint = _lazy_copy(cap.joint)
    blocks = find_blocks(joint, spec.blocks)
    if not blocks:
        raise UsageError(f"--policy {spec.name} compiles each repeated block, and "
                         + (f"no module matches --blocks {spec.blocks!r}" if spec.blocks else "this model has none"),
                         hint="name the blocks with --blocks (a glob such as 'layers.*'), or use --policy compiled")
    user_calls = cap.seen.checkpoint_calls
    notes: tuple[str, ...] = ()
    if user_calls:
        _check_checkpoints_inside_blocks(user_calls, blocks, spec)
        notes += _tag_user_regions(joint, user_calls, cap.fake_mode, whole_regions=True)
    if spec.policy.checkpoint is not None:
        _tag_regions(joint, _regions_by_module(joint, blocks[::spec.checkpoint_every], first_id=len(user_calls)),
                     _region_deciders(spec, cap.fake_mode), whole_regions=True)
        if spec.policy.checkpoint == "selective":
            notes += (f"save policy: {save_policy_label(spec)}",)
    regions = compiled_regions(joint, blocks, cap.fake_mode, start_apart=start_apart)
    return Schedule(joint=joint, regions=regions,
                    notes=(f"compiled blocks: {', '.join(r.block for r in regions)}",) + notes)


def _check_checkpoints_inside_blocks(calls, blocks: list[str], spec: PolicySpec) -> None:
    """A checkpoint call compiled with its block runs inside the block's forward: it checkpoints a
    sub-module of a block, or a method of the block other than its forward. Refuses a call that wraps a whole
    block from outside (eager checkpointing around a compiled block reruns the block's compiled forward in
    backward, which is not modelled), one outside every block or not located, and a reentrant one."""
    for call in calls:
        whole_block = call.module in blocks and (
            call.written == "module" or call.target.rsplit(".", 1)[-1] in MODULE_CALL_ENTRIES)
        inside = call.module is not None and not whole_block and block_of(call.module, blocks) != ""
        if call.reentrant or not inside:
            how = ("is reentrant" if call.reentrant else "wraps a whole block from outside it" if whole_block
                   else "is not inside a block")
            raise UsageError(f"--policy {spec.name}: the model's checkpoint call ({call.describe()}) {how}: "
                             "only non-reentrant checkpointing inside a compiled block is modelled",
                             hint="checkpoint inside each block (torchtitan's checkpoint_wrapper before "
                                  "torch.compile), or use --policy compiled-blocks+full, compiled, or eager")


def _lazy_copy(joint: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of the joint to tag and partition (the partitioners edit it): new nodes with their own meta
    dicts, and a lazy graph module, whose Python code is never generated since it never runs."""
    from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
    with _use_lazy_graph_module(True):
        return _make_graph_module(joint, copy.deepcopy(joint.graph))


def _save_if(save: bool):
    from torch.utils.checkpoint import CheckpointPolicy
    return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE


def _forward_nodes(joint: torch.fx.GraphModule):
    return [node for node in joint.graph.nodes
            if node.op == "call_function" and node.meta.get("partitioner_tag") != "is_backward"]


def _regions_by_module(joint: torch.fx.GraphModule, regions: list[str], first_id: int = 0) -> dict:
    """node -> region id, for regions given as module paths ("" is the whole forward)."""
    out = {}
    for node in _forward_nodes(joint):
        path = module_from_stack(node.meta.get("nn_module_stack"))
        out[node] = next((first_id + i for i, b in enumerate(regions)
                          if b == "" or path == b or path.startswith(b + ".")), None)
    return out


def _tag_user_regions(joint: torch.fx.GraphModule, calls, fake_mode, *, whole_regions: bool = False) -> tuple[str, ...]:
    """Tag the regions the user's forward checkpoints: by the call index export's trace stamped on their
    nodes (`meta["custom"]`), or, where a capture path kept no stamps (strict export, torch.compile), by
    the checkpointed module's path. Returns notes for regions that cannot be simulated as written.
    `whole_regions`: inside torch.compile (`_tag_regions`)."""
    forward = _forward_nodes(joint)
    region_of_node = {node: (node.meta.get("custom") or {}).get(CHECKPOINT_KEY) for node in forward}
    notes = []
    if not any(r is not None for r in region_of_node.values()):
        by_module = [c for c in calls if c.module is not None]
        region_of_node = {node: None if r is None else by_module[r - len(calls)].index
                          for node, r in _regions_by_module(joint, [c.module for c in by_module],
                                                            first_id=len(calls)).items()}
        lost = [c for c in calls if c.module is None]
        if lost:
            notes.append(f"{len(lost)} checkpointed function(s) ({lost[0].target}, ...) cannot be located in "
                         "this capture path's graph: their ops are kept as if not checkpointed")
    deciders = {c.index: _user_policy(c.policy_fn, fake_mode) for c in calls if c.policy_fn is not None}
    reentrant = {c.index for c in calls if c.reentrant}
    if reentrant:
        _rerun_reentrant_regions(joint, {n: r for n, r in region_of_node.items() if r in reentrant})
        region_of_node = {n: (None if r in reentrant else r) for n, r in region_of_node.items()}

    def decide(node, region):
        decider = deciders.get(region)
        return decider(node) if decider is not None else _save_if(False)

    _tag_regions(joint, region_of_node, decide, whole_regions=whole_regions)
    return tuple(notes)


def _region_deciders(spec: PolicySpec, fake_mode):
    """decide(node, region) -> CheckpointPolicy for the policy's own blocks: full recomputes everything;
    selective asks the policy function (`spec.save_fn`) or a fresh save predicate per region, as torch
    gives each checkpoint call its own selective-checkpointing context."""
    if spec.policy.checkpoint != "selective":
        return lambda node, region: _save_if(False)
    deciders: dict = {}

    def decide(node, region):
        if region not in deciders:
            if spec.save_fn is not None:
                deciders[region] = _user_policy(spec.save_fn, fake_mode)
            else:
                keep = save_predicate(spec)
                deciders[region] = lambda n: _save_if(_saved_by(n, keep))
        return deciders[region](node)
    return decide


def _saved_by(node, keep) -> bool:
    """Whether the save predicate `keep` keeps `node`'s output. A node a tensor subclass's handler made
    (meta.SUBCLASS_OP_KEY: a DTensor's context-parallel ring) is decided as the op the handler ran:
    torch's selective checkpointing caches that op's outputs (the handler's last makers of them) and never
    sees the ops inside it."""
    op = node.meta.get(SUBCLASS_OP_KEY)
    if op is None:
        return keep(target_name(node.target))
    return bool(node.meta.get(SUBCLASS_OUTPUT_KEY)) and keep(op)


def _user_policy(policy_fn, fake_mode):
    """The user's selective-checkpointing policy (torch's signature: policy_fn(ctx, op, *args, **kwargs) ->
    CheckpointPolicy or bool), asked for each forward op of the region in forward order, on the op's fake
    arguments, as torch's caching dispatch mode asks it in the forward; ops torch never asks about
    (SAC_IGNORED_OPS) are recomputed."""
    from torch.utils.checkpoint import SAC_IGNORED_OPS, CheckpointPolicy, SelectiveCheckpointContext
    def decide(node):
        target = node.target
        if not isinstance(target, torch._ops.OpOverload) or target in SAC_IGNORED_OPS:
            return CheckpointPolicy.PREFER_RECOMPUTE
        args = torch.fx.node.map_arg(node.args, lambda n: n.meta.get("val"))
        kwargs = torch.fx.node.map_arg(dict(node.kwargs), lambda n: n.meta.get("val"))
        ctx = SelectiveCheckpointContext(is_recompute=False, op_output=node.meta.get("val"))
        try:
            with fake_mode:
                policy = policy_fn(ctx, target, *args, **kwargs)
        except Exception as exc:
            name = getattr(policy_fn, "__qualname__", type(policy_fn).__name__)
            raise ModelRunError(f"the selective policy {name} raised {type(exc).__name__} on {target}: {exc}",
                                hint="the policy is called as torch calls it: policy(ctx, op, *args, **kwargs) "
                                     "-> CheckpointPolicy or bool") from exc
        if isinstance(policy, bool):
            return _save_if(policy)
        return _save_if(policy in (CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_SAVE))

    return decide


def _tag_regions(joint: torch.fx.GraphModule, region_of_node: dict, decide, *, whole_regions: bool = False) -> None:
    """Tag the forward nodes of each region (node -> region id, None outside every region) for
    recomputation, as checkpoint would: `decide(node, region)` -> CheckpointPolicy. A region's outputs stay
    untagged (eager checkpointing returns them as ordinary tensors); where the backward reads such an
    output's op (layer norm's mean and rstd, a tanh's result), it reads a recomputed twin of the op, as
    eager's backward reads the region's recomputed values. `whole_regions` (inside torch.compile): every
    node is tagged, outputs included, as AOT autograd traces the checkpoint operator's body; the
    partitioner then decides the region boundaries itself."""
    def leaves_region(node, region) -> bool:
        for user in node.users:
            if user.target is operator.getitem:      # an element of a multi-output op (layer norm's output)
                if leaves_region(user, region):
                    return True
            elif region_of_node.get(user, region) != region:
                return True
        return False

    boundary = []
    for node, region in list(region_of_node.items()):
        if region is not None:
            node.meta[MEMBER_KEY] = region       # eager's rerun runs it (eager_rerun.py)
        if region is None or node.target is operator.getitem:
            continue
        policy = decide(node, region)
        if not whole_regions and leaves_region(node, region):
            boundary.append((node, region))
            continue       # a region output: eager keeps it as is
        for tagged in [node] + [g for g in node.users if g.target is operator.getitem]:
            tagged.meta["ac_graph_id"] = region
            tagged.meta["recompute"] = policy
    region_of_seq = {node.meta["seq_nr"]: region for node, region in region_of_node.items()
                     if region is not None and node.meta.get("seq_nr") is not None}
    for node in joint.graph.nodes:
        if _is_backward(node) and node.meta.get("seq_nr") in region_of_seq:
            node.meta[BACKWARD_REGION_KEY] = region_of_seq[node.meta["seq_nr"]]
    for node, region in boundary:
        _recompute_for_backward(joint, node, region, lambda user: region_of_seq.get(user.meta.get("seq_nr")))


def _is_backward(node) -> bool:
    return node.meta.get("partitioner_tag") == "is_backward"


def _recompute_for_backward(joint: torch.fx.GraphModule, node, region: int, region_of_backward) -> None:
    """The region's backward nodes (those of its forward ops, by seq_nr) that read `node` (directly or
    through its getitems) read a twin tagged for recomputation instead; the forward keeps `node` for the
    nodes after the region, and the backward of ops after the region reads `node` itself."""
    from torch.utils.checkpoint import CheckpointPolicy

    def reads_recomputed(user) -> bool:
        return _is_backward(user) and region_of_backward(user) == region

    direct = [u for u in node.users if reads_recomputed(u)]
    items = [g for g in node.users if g.target is operator.getitem and any(reads_recomputed(u) for u in g.users)]
    if not direct and not items:
        return
    graph = joint.graph
    with graph.inserting_after(node):
        twin = graph.node_copy(node, lambda n: n)
    twin.meta = dict(node.meta, ac_graph_id=region, recompute=CheckpointPolicy.PREFER_RECOMPUTE, **{TWIN_KEY: node.name})
    for user in direct:
        user.replace_input_with(node, twin)
    for item in items:
        with graph.inserting_after(twin):
            item_twin = graph.node_copy(item, lambda n: twin if n is node else n)
        item_twin.meta = dict(item.meta, ac_graph_id=region, recompute=CheckpointPolicy.PREFER_RECOMPUTE,
                              **{TWIN_KEY: item.name})
        for user in [u for u in item.users if reads_recomputed(u)]:
            user.replace_input_with(item, item_twin)


def _rerun_reentrant_regions(joint: torch.fx.GraphModule, region_of_node: dict) -> None:
    """Reentrant checkpointing (CheckpointFunction): the region's forward runs under no_grad (nothing
    saved; its temporaries die at their last use), its tensor inputs are saved; when backward reaches the
    region, the whole forward runs again with grad (no early stop) and the region's backward runs on that
    rerun, as a graph of its own. Rewrite the joint graph so: copies of every forward node of the region,
    placed just before the region's first backward node, tagged as backward nodes; the region's backward
    nodes (matched by seq_nr) read the copies; the original forward nodes keep only forward users. A copy
    carries no seq_nr (the backward's per-node rules must not take it for its twin's autograd node) but names
    its forward node (RERUN_KEY), so the rerun's Python locals hold it as the forward's held its twin. The
    copies of the region's outputs are held until the region's backward ends (its `outputs` local)."""
    by_region: dict[int, list] = {}
    for node, region in region_of_node.items():
        if region is not None:
            by_region.setdefault(region, []).append(node)
    order = {node: i for i, node in enumerate(joint.graph.nodes)}
    for region, nodes in by_region.items():
        members = set(nodes)
        seqs = {n.meta.get("seq_nr") for n in nodes if n.meta.get("seq_nr") is not None}
        backward = [n for n in joint.graph.nodes if _is_backward(n) and n.meta.get("seq_nr") in seqs]
        for node in nodes:
            node.meta[REGION_KEY] = region
        if not backward:
            continue
        copies: dict = {}
        with joint.graph.inserting_before(min(backward, key=order.__getitem__)):
            for node in sorted(nodes, key=order.__getitem__):
                copy_ = joint.graph.node_copy(node, lambda n: copies.get(n, n))
                meta = {k: v for k, v in node.meta.items() if k not in ("seq_nr", "recompute", "ac_graph_id")}
                meta.update({"partitioner_tag": "is_backward", REGION_KEY: region, RERUN_KEY: node.name,
                             "fwd_nn_module_stack": node.meta.get("nn_module_stack")})
                if any(u not in members and not _is_backward(u) for u in node.users):
                    meta[HELD_KEY] = True        # a region output
                copy_.meta = meta
                copies[node] = copy_
        for user in backward:
            for original in [a for a in user.all_input_nodes if a in members]:
                user.replace_input_with(original, copies[original])
