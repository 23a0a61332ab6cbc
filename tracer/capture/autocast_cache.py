"""Autocast's weight-cast cache, as eager PyTorch runs it.

Under `torch.autocast` an op on the autocast lists casts its floating-point arguments to the autocast dtype.
When the argument is a float32 leaf that requires grad (a trainable parameter itself, not a view of one) and
the target is the autocast dtype, ATen's `cached_cast` (aten/src/ATen/autocast_mode.cpp) keeps the copy in a
thread-local cache, keyed by the parameter, until the outermost autocast region exits: `torch.autocast`'s
`__exit__` calls `torch.clear_autocast_cache()` when the nesting count drops to zero. Grad mode does not
matter, so the copies made by a reentrant checkpoint's forward (run under `no_grad`) and by a non-reentrant
one (whose saved-tensor hooks drop everything else) are all alive when the forward ends: on a checkpointed
model the forward ends holding one low-precision copy of every trainable weight an autocast op read.

Regions here (one micro-batch of a converted, non-compiled step):
* the forward and the loss (the tool's `--precision bf16|fp16` autocast wraps exactly these): a cast's copy
  is held until the last forward op;
* each checkpointed region's recompute in backward: torch.utils.checkpoint re-enters autocast with the
  state it saved, outside any other autocast region (backward runs outside it), so its casts are held until
  the region's last recomputed op (a non-reentrant recompute that stops early exits autocast there).
Copies that autograd saves live on after the cache lets go; that is the saved-tensor rule, not this one.

Compiled code (a whole compiled step, or a compiled block's own graphs) is traced with the cache off and
frees its casts where Inductor's plan does: nothing here applies to it.

Eligible: a `_to_copy` float32 -> the autocast dtype made by an autocast op, not by the model's own
`.to(...)`/`.half()`/`.type_as(...)` call, which is never cached (told apart by the Python call export
records for the op; on capture paths that record none, every such cast is taken as autocast's), of a leaf
that requires grad: a trainable parameter itself (a graph input, not a view of one), or, in a reentrant
checkpoint's rerun, the region's input itself, which CheckpointFunction reruns as a detached leaf with the
input's requires_grad (two layers of a block reading it share one low-precision copy there). Frozen
parameters (LoRA's base weights), buffers and batch tensors are never cached.

A later cast of the same parameter inside one region returns the cached copy (`reuse_cached_casts`): the
joint graph, traced with the cache off, casts a shared weight (a block called twice, ALBERT's layers) once
per call; the later casts become views of the first copy, which then lives as long as any reader needs it.

Not modelled: autocast regions the model's own code opens inside its forward (their cache lives until that
block exits, not the forward's end); the backward of a shared copy, which eager runs as one cast-back node
(the calls' low-precision gradients summed in its input buffer, then cast once) and the joint graph as one
cast back per call summed in float32: the report says so in a note when it happens.
"""
from __future__ import annotations

import dataclasses

from tracer.capture.convert import OpDraft, input_values
from tracer.capture.splice import remap
from tracer.capture.storages import StorageTable
from tracer.stepgraph import Phase, StorageRole

# Python calls whose `_to_copy` is the model's own cast (torch_fn names them "<call>_<counter>")
_EXPLICIT_CAST_CALLS = frozenset({"to", "type", "type_as", "half", "bfloat16", "float", "double", "_to_copy"})


def autocast_cache_holds(ops: list[OpDraft], table: StorageTable, autocast_dtype: str | None,
                         requiring_grad: frozenset[int]) -> dict[int, int]:
    """storage id of a cached cast copy -> the last op of the autocast region that cached it.
    `requiring_grad`: the storages whose forward values require grad."""
    if autocast_dtype is None:
        return {}
    region_end = _region_ends(ops)
    return {ops[i].outputs[0].storage_id: region_end[region]
            for i, region, _ in _cached_casts(ops, table, autocast_dtype, requiring_grad)}


def reuse_cached_casts(ops: list[OpDraft], table: StorageTable, autocast_dtype: str | None,
                       requiring_grad: frozenset[int]) -> tuple[str, ...]:
    """In place: a cached cast of a leaf already cast in the same region becomes a view of the first copy,
    and every later op reads that copy; the second copy's storage is left with no bytes and no op.
    Returns a note naming the leaves whose copy was reused (their backward is approximate), or ()."""
    if autocast_dtype is None:
        return ()
    first_copy: dict[tuple, int] = {}
    shared: dict[str, None] = {}
    renamed = _Renames()
    cached = {i: (region, leaf) for i, region, leaf in _cached_casts(ops, table, autocast_dtype, requiring_grad)}
    for i, d in enumerate(ops):
        if renamed:
            d = ops[i] = _remapped(d, renamed)
        if i not in cached:
            continue
        key = cached[i]
        copy = d.outputs[0].storage_id
        if key not in first_copy:
            first_copy[key] = copy
            continue
        renamed[copy] = first_copy[key]
        table.update(copy, nbytes=0)
        ops[i] = dataclasses.replace(_remapped(d, renamed), is_view=True)
        leaf = table.get(input_values(d)[0].storage_id)
        shared.setdefault(leaf.name if leaf.role is StorageRole.PARAMETER and leaf.name else
                          "a reentrant region's input" if d.rerun else "a leaf", None)
    if not shared:
        return ()
    names = ", ".join(list(shared)[:4]) + (f" and {len(shared) - 4} more" if len(shared) > 4 else "")
    return (f"autocast cast cache: {names} read by more than one call in an autocast region share one "
            f"{autocast_dtype} copy (as eager does); the backward sums their gradients in float32 after each "
            "call's cast back, where eager sums them in the autocast dtype before one cast (backward peak "
            "approximate by up to one such gradient)",)


class _Renames(dict):
    def __missing__(self, sid: int) -> int:
        return sid


def _remapped(d: OpDraft, renamed: dict[int, int]) -> OpDraft:
    return dataclasses.replace(d, args=remap(d.args, renamed), kwargs=remap(d.kwargs, renamed),
                               outputs=remap(d.outputs, renamed),
                               held_to_region_end=remap(d.held_to_region_end, renamed))


def _region_of(d: OpDraft):
    """The autocast region an op runs in: the forward ("forward"), a recompute (its checkpoint region), or
    None (backward, outside autocast, or compiled code, which casts without the cache)."""
    if d.compiled_region:
        return None
    if d.phase is Phase.FORWARD and not d.recomputed:
        return "forward"
    if d.recomputed:
        return ("recompute", d.checkpoint_region)
    return None


def _region_ends(ops: list[OpDraft]) -> dict:
    ends: dict = {}
    for i, d in enumerate(ops):
        region = _region_of(d)
        if region is not None:
            ends[region] = i
    return ends


def _cached_casts(ops: list[OpDraft], table: StorageTable, autocast_dtype: str, requiring_grad: frozenset[int]):
    """(op index, its autocast region, the storage of the leaf it casts) for every cast autocast caches. A
    reentrant region's input is rerun as `detach()` with its requires_grad: a leaf requiring grad when the
    forward value did (not a batch tensor, not a buffer)."""
    made_in_rerun: dict = {}          # a reentrant rerun's region -> storages its ops made so far (views too)
    forward_call = {d.name: d.torch_call for d in ops if d.phase is Phase.FORWARD and not d.recomputed}
    for i, d in enumerate(ops):
        region = _region_of(d)
        call = forward_call.get(d.rerun_of) if d.rerun else d.torch_call     # a rerun runs its forward's call
        if region is not None and _is_autocast_copy(d, autocast_dtype, call):
            leaf = input_values(d)[0].storage_id
            if _casts_trainable_parameter(d, table) or \
                    (d.rerun and leaf not in made_in_rerun.get(region, ()) and leaf in requiring_grad
                     and table.get(leaf).role is StorageRole.INTERMEDIATE):
                yield i, region, leaf
        if d.rerun:
            made_in_rerun.setdefault(region, set()).update(v.storage_id for v in d.outputs)


def _is_autocast_copy(d: OpDraft, autocast_dtype: str, torch_call: str | None) -> bool:
    """A float32 -> autocast-dtype `_to_copy` made by an autocast op (not by the model's own cast call)."""
    if d.target != "aten._to_copy.default" or len(d.outputs) != 1 or d.outputs[0].dtype != autocast_dtype:
        return False
    values = input_values(d)
    if not values or values[0].dtype != "float32":
        return False
    return (torch_call or "").rsplit("_", 1)[0] not in _EXPLICIT_CAST_CALLS


def _casts_trainable_parameter(d: OpDraft, table: StorageTable) -> bool:
    entry = table.get(input_values(d)[0].storage_id)
    return d.casts_graph_input and entry.role is StorageRole.PARAMETER and not entry.frozen

