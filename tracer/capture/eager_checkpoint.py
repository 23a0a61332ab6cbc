"""Eager torch.utils.checkpoint's lifetimes on a converted (non-compiled) step, per checkpointed region.

`eager_checkpoint_semantics(ops, table)` applies, in place, what eager checkpointing keeps beyond what the
partition needs: the CPU RNG state saved at the region's entry and the one fork_rng stashes while it
recomputes (a CPU target's device memory; on a CUDA target they are host tensors and left out); MUST_SAVE outputs of a selective region, cached until the recompute pops them (or until the
region's backward ends when the recompute stops before them); reentrant regions' saved inputs, rerun
outputs and the gradients CheckpointFunction.backward was called with, until the region's backward ends;
and a recomputed value freed when the backward node that unpacked it returns (before the engine's
`sum_to`). `recompute_local_holds(ops, table, holds)` holds recomputed values (a non-reentrant recompute's
or a reentrant rerun's) as the forward's Python locals held their twins. The recompute's place (at the
region's first unpacking backward node) is set when the backward graph is made (tracer/capture/policies.py).
A non-reentrant region's frame holds what its callable binds and receives until the region's backward
has run, read by the region or not.
"""
from __future__ import annotations

import collections

import torch

from tracer.capture.convert import OpDraft, input_values
from tracer.capture.storages import StorageTable
from tracer.stepgraph import Phase, StorageRole, TensorValue


def eager_checkpoint_semantics(ops: list[OpDraft], table: StorageTable, remade_leaves: dict[int, int] | None = None,
                               *, cuda: bool = False) -> None:
    """What eager torch.utils.checkpoint keeps beyond what the partition needs, per checkpointed region:
    the CPU RNG state it saves at entry (preserve_rng_state=True), held in the checkpoint frame until the
    region's recompute and backward have run (it stands in for the states the partition saves per
    random op, run_and_save_rng_state's, which take no bytes); the state fork_rng stashes while the region
    recomputes; and, for selective checkpointing, every output of a MUST_SAVE op, cached from forward until
    the region's recompute has run. `remade_leaves`: storage id of a leaf made in forward -> the region
    whose code made it (`_remade_leaves`). `cuda`: a CUDA target, where the RNG states (the CPU generator's
    and each CUDA device's, both `torch.get_rng_state`-style CPU tensors) take no device memory: they are
    left out, as the process's other host memory is."""
    first_forward: dict[int, int] = {}
    recompute_start: dict[int, int] = {}
    recompute_end: dict[int, int] = {}
    first_backward = next((i for i, d in enumerate(ops) if d.phase is Phase.BACKWARD), len(ops) - 1)
    for i, d in enumerate(ops):
        region = d.checkpoint_region
        if region is None:
            continue
        if d.phase is Phase.FORWARD:
            first_forward.setdefault(region, i)
            if d.name.startswith("run_and_save_rng_state"):
                # the partition saves the RNG state per random op; eager saves one per region (below)
                table.update(d.outputs[0].storage_id, nbytes=0)
        elif d.recomputed:
            recompute_start.setdefault(region, i)
            recompute_end[region] = i
    # the checkpoint frame (and the RNG state in it) lives while any backward node of the region still holds
    # a saved tensor: until the region's last backward op (a forward op's backward shares its seq_nr)
    region_of_seq = {d.seq_nr: d.checkpoint_region for d in ops
                     if d.phase is Phase.FORWARD and d.checkpoint_region is not None and d.seq_nr is not None}
    backward_end: dict[int, int] = {}
    for i, d in enumerate(ops):
        if d.phase is Phase.BACKWARD and region_of_seq.get(d.seq_nr) is not None:
            backward_end[region_of_seq[d.seq_nr]] = i
    last_rerun_seq = _last_rerun_seq(ops)
    for i, d in enumerate(ops):
        if d.phase is Phase.FORWARD and d.must_save and not d.is_view:
            region = d.checkpoint_region
            reached = d.seq_nr is not None and d.seq_nr <= last_rerun_seq.get(region, -1)
            # the recompute pops the cached output when it reaches the op; one it stops before stays cached
            # in the checkpoint frame until the frame dies
            end = recompute_end.get(region, first_backward) if reached else \
                max(recompute_end.get(region, first_backward), backward_end.get(region, -1))
            for value in d.outputs:
                table.hold_until(value.storage_id, end)
    _hold_reentrant_values(ops, table, backward_end)
    # the frame dies when the region's recompute and backward have run
    frame_end = {region: max(recompute_end.get(region, first_backward), backward_end.get(region, -1))
                 for region in first_forward}
    _hold_frame_values(ops, table, frame_end)
    _release_unpacked_recomputes(ops, table)
    _remade_leaves(ops, table, remade_leaves or {}, recompute_end)
    if not cuda:
        _add_rng_states(ops, table, first_forward, recompute_start, recompute_end, frame_end)


def _add_rng_states(ops: list[OpDraft], table: StorageTable, first_forward: dict[int, int],
                    recompute_start: dict[int, int], recompute_end: dict[int, int], frame_end: dict[int, int]) -> None:
    """The CPU RNG state each region saves at entry and the copy fork_rng stashes while it recomputes (a
    CPU target's device memory)."""
    reentrant = {d.checkpoint_region for d in ops if d.rerun}
    rng_bytes = torch.get_rng_state().numel()
    for region, start in recompute_start.items():     # fork_rng copies the current state while recomputing
        sid = table.add(None, StorageRole.INTERMEDIATE, nbytes=rng_bytes, dtype="uint8", shape=(rng_bytes,),
                        name=f"RNG state stashed during recompute, region {region}")
        ops[start].outputs = ops[start].outputs + (TensorValue(sid, (rng_bytes,), "uint8"),)
        table.update(sid, held_until_op=recompute_end[region])
    for region, start in first_forward.items():
        sid = table.add(None, StorageRole.INTERMEDIATE, nbytes=rng_bytes, dtype="uint8", shape=(rng_bytes,),
                        name=f"checkpoint RNG state, region {region}")
        state = TensorValue(sid, (rng_bytes,), "uint8")
        ops[start].outputs = ops[start].outputs + (state,)
        if region in recompute_start:        # the recompute restores it: saved for backward
            rerun = ops[recompute_start[region]]
            rerun.kwargs = tuple(rerun.kwargs) + (("checkpoint_rng_state", state),)
        table.update(sid, held_until_op=frame_end[region])
        if region in reentrant:    # on CheckpointFunction's ctx: the autograd graph, which `loss` keeps alive
            table.update(sid, persistent=True)


def _hold_frame_values(ops: list[OpDraft], table: StorageTable, frame_end: dict[int, int]) -> None:
    """A non-reentrant region's checkpoint frame holds its callable (the tensors its functools.partial
    binds) and the arguments it was called with until the frame dies, when the region's recompute and
    backward have run (`frame_end`), whether or not the region reads them. capture/joint.py tags every op
    made from the node of such a tensor `frame_held`; the last of them makes the tensor, its output of the
    tensor's shape and dtype."""
    last: dict[str, int] = {}                   # origin node -> the last forward op made from it
    for i, d in enumerate(ops):
        for *_, origin in d.frame_held:
            last[origin] = i
    for origin, i in last.items():
        ends: dict[tuple, int] = {}              # (shape, dtype) -> the last end of the frames holding it
        for region, shape, dtype, entry_origin in ops[i].frame_held:
            if entry_origin == origin and region in frame_end:
                ends[(shape, dtype)] = max(ends.get((shape, dtype), -1), frame_end[region])
        for value in ops[i].outputs:
            end, storage = ends.get((value.shape, value.dtype)), table.get(value.storage_id)
            if end is not None and storage.role is StorageRole.INTERMEDIATE:
                table.hold_until(value.storage_id, end)


def _remade_leaves(ops: list[OpDraft], table: StorageTable, region_of_leaf: dict[int, int],
                   recompute_end: dict[int, int]) -> None:
    """A region whose code makes a leaf that requires grad (tracer/capture/forward_leaves.py) makes a fresh
    one when it recomputes: a local of the rerun frame, from the first recomputed op that reads the leaf
    until the recompute stops. (The graph's recompute reads the forward's leaf, which the autograd graph
    holds anyway.)"""
    for sid, region in region_of_leaf.items():
        first = next((i for i, d in enumerate(ops) if d.recomputed and d.checkpoint_region == region
                      and any(v.storage_id == sid for v in input_values(d))), None)
        if first is None or region not in recompute_end:
            continue
        leaf = table.get(sid)
        fresh = table.add(None, StorageRole.INTERMEDIATE, nbytes=leaf.nbytes, dtype=leaf.dtype, shape=leaf.shape,
                          name=f"{leaf.name}, made again by the recompute of region {region}")
        ops[first].outputs = ops[first].outputs + (TensorValue(fresh, leaf.shape, leaf.dtype),)
        table.update(fresh, held_until_op=recompute_end[region])


def recompute_local_holds(ops: list[OpDraft], table: StorageTable, holds: dict[int, int]) -> None:
    """A checkpointed region's recompute reruns the region's Python code, so a local that held a forward
    value inside the region holds its recomputed twin too: until the twin of the op where the forward let
    it go, or until the recompute stops (the early stop unwinds the frames; a reentrant rerun runs whole).
    A hold that outlasts the region (a value the region returns, such as an attention bias a layer passes on)
    held it to the region's end first, in the region's frames: its twin is held until the recompute stops."""
    forward_twin = _recomputed_twins(ops)        # forward op index -> its recomputed twin's index
    recompute_end: dict[int, int] = {}
    last_forward: dict[int, int] = {}
    for i, d in enumerate(ops):
        if d.recomputed and d.checkpoint_region is not None and (d.rerun or d.seq_nr is not None):
            recompute_end[d.checkpoint_region] = i
        if d.phase is Phase.FORWARD and d.seq_nr is not None and d.checkpoint_region is not None:
            last_forward[d.checkpoint_region] = i
    for f, r in forward_twin.items():
        region = ops[r].checkpoint_region
        for value, twin_value in zip(ops[f].outputs, ops[r].outputs):
            held = holds.get(value.storage_id)
            if held is None or held <= f or region not in last_forward or ops[r].is_view:
                continue
            until = next((forward_twin[j] for j in range(held, last_forward[region] + 1) if j in forward_twin),
                         recompute_end[region])
            until = min(until, recompute_end[region])
            table.hold_until(twin_value.storage_id, until)


def _recomputed_twins(ops: list[OpDraft]) -> dict[int, int]:
    """Forward op index -> the index of its recomputed twin. A non-reentrant recompute's op shares its
    forward op's seq_nr (matched by seq_nr, target and occurrence: a seq_nr's ops repeat in order); a
    reentrant rerun's op names the forward op it copies."""
    twins: dict[tuple, int] = {}
    seen: collections.Counter = collections.Counter()
    rerun_of: dict[str, int] = {}
    for i, d in enumerate(ops):
        if d.rerun:
            rerun_of.setdefault(d.rerun_of, i)
        elif d.recomputed and d.checkpoint_region is not None and d.seq_nr is not None:
            key = (d.seq_nr, d.target)
            twins[key + (seen[key],)] = i
            seen[key] += 1
    seen.clear()
    forward_twin: dict[int, int] = {}
    for i, d in enumerate(ops):
        if d.phase is not Phase.FORWARD or d.seq_nr is None:
            continue
        key = (d.seq_nr, d.target)
        twin = rerun_of.get(d.name) if d.checkpoint_region is not None and d.name in rerun_of \
            else twins.get(key + (seen[key],))
        if twin is not None:
            forward_twin[i] = twin
        seen[key] += 1
    return forward_twin


def _release_unpacked_recomputes(ops: list[OpDraft], table: StorageTable) -> None:
    """A value a non-reentrant region recomputes is held by the checkpoint frame only until a backward node
    unpacks it; from then on only that node's local holds it, which dies when the node's formula returns,
    before the engine reduces the node's gradients to their inputs' shapes (`sum_to`: a keepdim `sum` and
    its `view` at the node's end in the graph, such as a bias gradient's). So it is freed after the last
    formula op of the last node that reads it, not after that node's reductions."""
    last_use: dict[int, int] = {}
    for i, d in enumerate(ops):
        for value in d.outputs + tuple(input_values(d)):
            last_use[value.storage_id] = i
    formula_end: dict[int, int] = {}        # seq_nr -> its node's last op before the engine's reductions
    for i, d in enumerate(ops):
        if d.phase is Phase.BACKWARD and not d.recomputed and d.seq_nr is not None and not _engine_reduction(d):
            formula_end[d.seq_nr] = i
    for d in ops:
        if not d.recomputed or d.rerun or d.is_view:
            continue
        for value in d.outputs:
            entry = table.get(value.storage_id)
            if entry.role is not StorageRole.INTERMEDIATE or entry.released_after_op is not None:
                continue
            last = last_use[value.storage_id]
            if ops[last].recomputed:
                continue       # used up inside the recompute: never unpacked by a backward node
            held = entry.held_until_op if entry.held_until_op is not None else -1
            table.update(value.storage_id,
                         released_after_op=max(last, held, formula_end.get(ops[last].seq_nr, last)))


def _engine_reduction(d: OpDraft) -> bool:
    """An op of the autograd engine's `sum_to` after a node's formula: a keepdim sum, or a view of one."""
    if d.target == "aten.sum.dim_IntList":
        return dict(d.kwargs).get("keepdim", len(d.args) > 2 and d.args[2] is True) is True
    return d.is_view


def _last_rerun_seq(ops: list[OpDraft]) -> dict[int, int]:
    """Per checkpointed region, the forward sequence number where eager's recompute stops: the last op
    whose output the region's backward reads, recomputed or (a MUST_SAVE op, popped from the cache) kept."""
    read_by_backward = {v.storage_id for d in ops if d.phase is Phase.BACKWARD and not d.recomputed
                        for v in input_values(d)}
    last: dict[int, int] = {}
    for d in ops:
        if d.checkpoint_region is None or d.seq_nr is None:
            continue
        if d.recomputed or (d.phase is Phase.FORWARD and d.must_save
                            and any(v.storage_id in read_by_backward for v in d.outputs)):
            last[d.checkpoint_region] = max(last.get(d.checkpoint_region, -1), d.seq_nr)
    return last


def _hold_reentrant_values(ops: list[OpDraft], table: StorageTable, backward_end: dict[int, int]) -> None:
    """Reentrant checkpointing keeps its saved inputs (ctx.saved_tensors), the rerun's outputs (the
    `outputs` local of CheckpointFunction.backward) and the gradients it was called with (its `args`) until
    the region's backward has run, and the tensors its callable binds as a functools.partial
    (ctx.run_function) until the graph dies."""
    for d in ops:
        for value in d.outputs if d.partial_held else ():
            if table.get(value.storage_id).role is StorageRole.INTERMEDIATE:
                table.update(value.storage_id, persistent=True)
    produced_at: dict[int, int] = {}
    for i, d in enumerate(ops):
        for value in d.outputs:
            produced_at.setdefault(value.storage_id, i)
    rerun_start: dict[int, int] = {}
    for i, d in enumerate(ops):
        if d.rerun:
            rerun_start.setdefault(d.checkpoint_region, i)
    for region, d in _reentrant_ops(ops):
        if region not in backward_end:
            continue
        held = list(d.held_to_region_end)
        held += [v for v in input_values(d) if produced_at.get(v.storage_id, -1) < rerun_start[region]]
        for value in held:
            storage = table.get(value.storage_id)
            if storage.role is StorageRole.INTERMEDIATE:
                table.hold_until(value.storage_id, backward_end[region])


def _reentrant_ops(ops: list[OpDraft]):
    """(region, op) for each op of a reentrant region's rerun and of that region's backward (the nodes of
    its forward ops, by seq_nr). The backward runs on the rerun inside CheckpointFunction.backward, so what
    these ops read that was made before the rerun (the gradients passed in, the saved inputs) is held by that
    call's frame; values made since (the rerun's, the backward's, the engine's sums of gradients) are freed
    as usual."""
    reentrant = {d.checkpoint_region for d in ops if d.rerun}
    region_of_seq = {d.seq_nr: d.checkpoint_region for d in ops if d.phase is Phase.FORWARD
                     and d.checkpoint_region in reentrant and d.seq_nr is not None}
    for d in ops:
        if d.rerun:
            yield d.checkpoint_region, d
        elif d.phase is Phase.BACKWARD and not d.recomputed and d.seq_nr in region_of_seq:
            yield region_of_seq[d.seq_nr], d
