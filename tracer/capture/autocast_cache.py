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

The backward of a shared copy is eager's one cast-back node (`sum_gradients_in_autocast_dtype`): the calls'
low-precision gradients are summed in its input buffer, then cast once; the joint graph's one cast back per
call summed in float32 is rewritten to that, and a backward of another shape is left as traced with a note.

Not modelled: autocast regions the model's own code opens inside its forward (their cache lives until that
block exits, not the forward's end).
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
    and every later op reads that copy; the second copy's storage is left with no bytes and no op. The
    calls' gradients then meet in the shared copy's one cast-back, as eager runs it
    (`sum_gradients_in_autocast_dtype`). Returns a note naming the leaves whose backward could not be
    rewritten that way (their backward peak is approximate), or ()."""
    if autocast_dtype is None:
        return ()
    first_copy: dict[tuple, int] = {}
    casts_of: dict[tuple, list[int]] = {}          # shared leaf -> its cast ops, in order
    renamed = _Renames()
    cached = {i: (region, leaf) for i, region, leaf in _cached_casts(ops, table, autocast_dtype, requiring_grad)}
    for i, d in enumerate(ops):
        if renamed:
            d = ops[i] = _remapped(d, renamed)
        if i not in cached:
            continue
        key = cached[i]
        copy = d.outputs[0].storage_id
        casts_of.setdefault(key, []).append(i)
        if key not in first_copy:
            first_copy[key] = copy
            continue
        renamed[copy] = first_copy[key]
        table.update(copy, nbytes=0)
        ops[i] = dataclasses.replace(_remapped(d, renamed), is_view=True)
    shared = {key: casts for key, casts in casts_of.items() if len(casts) > 1}
    if not shared:
        return ()
    names = {key: _leaf_name(ops[casts[0]], table) for key, casts in shared.items()}
    left = sum_gradients_in_autocast_dtype(ops, table, shared)
    exact = _listed(names[key] for key in shared if key not in left)
    approximate = _listed(names[key] for key in left)
    notes = []
    if exact:
        notes.append(f"autocast cast cache: {exact} read by more than one call in an autocast region share one "
                     f"{autocast_dtype} copy, and its calls' gradients are summed in {autocast_dtype} before one "
                     "cast back, as eager does")
    if approximate:
        notes.append(f"autocast cast cache: {approximate} read by more than one call in an autocast region share "
                     f"one {autocast_dtype} copy (as eager does), but the backward's cast-backs of its calls' "
                     "gradients do not have the shape this tool rewrites: they are summed in float32 after each "
                     f"call's cast back, where eager sums them in {autocast_dtype} before one cast (backward peak "
                     "approximate by up to one such gradient)")
    return tuple(notes)


def _leaf_name(cast: OpDraft, table: StorageTable) -> str:
    leaf = table.get(input_values(cast)[0].storage_id)
    return leaf.name if leaf.role is StorageRole.PARAMETER and leaf.name else \
        "a reentrant region's input" if cast.rerun else "a leaf"


def _listed(names) -> str:
    names = list(dict.fromkeys(names))
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def sum_gradients_in_autocast_dtype(ops: list[OpDraft], table: StorageTable,
                                    shared: dict[tuple, list[int]]) -> list[tuple]:
    """In place: eager's one cast-back node of a shared copy. Its calls' low-precision gradients gather in the
    node's input buffer (the first one held, each later one added into it in place, as autograd's InputBuffer
    does with a gradient it owns alone) and are cast back to float32 once, when the last arrives. The joint
    graph, traced with the cache off, casts each call's gradient back (B_k: b_k -> g_k) and sums the float32
    results with the leaf's other gradients. Rewritten: the first B_k holds b_1, each later one adds into b_1,
    the last adds then casts b_1 (g_n, now the sum of all calls); every sum that took an earlier g_k passes
    its other operand through (or, when that operand is g_n, the last cast writes the sum's storage; a sum of
    two earlier g_k is already in b_1). `shared`: leaf key -> its cast ops (first, then the reused ones).
    Returns the keys whose backward does not have this shape, left as traced."""
    by_seq_nr = {d.name: d.seq_nr for d in ops if d.phase is Phase.FORWARD and not d.recomputed}
    renames, inserts, left = _Renames(), [], []
    for key, casts in shared.items():
        plan = _cast_back_plan(ops, table, casts, by_seq_nr)
        if plan is None:
            left.append(key)
            continue
        backs, sums = plan
        held = input_values(ops[backs[0]])[0]                    # b_1: the input buffer
        last = backs[-1]
        for k, i in enumerate(backs):
            d, incoming = ops[i], input_values(ops[i])[0]
            if i == last:
                inserts.append((i, _add_into(d, held, incoming)))
                ops[i] = dataclasses.replace(d, args=(held,) + tuple(d.args[1:]))
                continue
            renames[d.outputs[0].storage_id] = held.storage_id
            ops[i] = dataclasses.replace(d, outputs=(held,), is_view=True) if k == 0 else _add_into(d, held, incoming)
        for a, kind, other in sums:
            d, out = ops[a], ops[a].outputs[0]
            if kind == "into_last":                  # the last cast writes the sum's storage
                renames[ops[last].outputs[0].storage_id] = out.storage_id
                ops[last] = dataclasses.replace(ops[last], outputs=(out,))
                ops[a] = dataclasses.replace(d, args=(out,), kwargs=(), is_view=True)
                continue
            table.update(out.storage_id, nbytes=0)
            if kind == "merge":                      # two calls' gradients: already summed in b_1
                renames[out.storage_id] = held.storage_id
                ops[a] = dataclasses.replace(d, args=(), kwargs=(), outputs=(), is_view=True)
            else:                                    # the sum is its other operand
                renames[out.storage_id] = other.storage_id
                ops[a] = dataclasses.replace(d, args=(other,), kwargs=(), outputs=(other,), is_view=True)
    if renames:
        resolved = _Renames({sid: _resolve(renames, sid) for sid in renames})
        for i, d in enumerate(ops):
            ops[i] = _remapped(d, resolved)
    for i, op in sorted(inserts, key=lambda item: item[0], reverse=True):
        ops.insert(i, op)
    return left


def _cast_back_plan(ops, table, casts, by_seq_nr):
    """(the cast-backs B_k in op order, [(sum op index, "merge" | "into_last" | "pass", its other operand)]),
    or None when the backward does not have that shape: one float32 `_to_copy` per call in the call's
    autograd node, and every earlier call's float32 gradient (and every sum of two of them) read only by
    out-of-place `add`s of two same-shaped float32 gradients."""
    seq_nrs = {by_seq_nr.get(ops[i].rerun_of) if ops[i].rerun else ops[i].seq_nr for i in casts}
    if None in seq_nrs or len(seq_nrs) != len(casts):
        return None
    backs = sorted(i for i, d in enumerate(ops) if d.phase is Phase.BACKWARD and d.seq_nr in seq_nrs and not d.recomputed
                   and d.target == "aten._to_copy.default")
    if len(backs) != len(casts) or any(not _is_cast_back(ops[i]) for i in backs):
        return None
    last_out = ops[backs[-1]].outputs[0].storage_id
    tainted = {ops[i].outputs[0].storage_id for i in backs[:-1]}     # float32 sums of earlier calls only
    sums = []
    for a in range(backs[0] + 1, len(ops)):
        d = ops[a]
        read = [v for v in input_values(d) if v.storage_id in tainted]
        if not read:
            continue
        if not _is_gradient_sum(d):
            return None
        out = d.outputs[0].storage_id
        others = [v for v in input_values(d) if v.storage_id not in tainted]
        if not others:
            tainted.add(out)
            sums.append((a, "merge", None))
        elif others[0].storage_id == last_out:
            sums.append((a, "into_last", None))
        elif table.get(out).role is StorageRole.INTERMEDIATE:
            sums.append((a, "pass", others[0]))
        else:
            return None
    return backs, sums


def _is_cast_back(d: OpDraft) -> bool:
    values = input_values(d)
    return len(d.outputs) == 1 and d.outputs[0].dtype == "float32" and len(values) == 1 \
        and values[0].dtype != "float32" and values[0].shape == d.outputs[0].shape


def _is_gradient_sum(d: OpDraft) -> bool:
    values = input_values(d)
    return d.target == "aten.add.Tensor" and len(values) == 2 and len(d.outputs) == 1 and not d.is_view \
        and len({v.storage_id for v in values}) == 2 and all(v.shape == d.outputs[0].shape and v.dtype == "float32"
                                                              for v in values) \
        and dict(d.kwargs).get("alpha", 1) == 1


def _add_into(d: OpDraft, held, incoming) -> OpDraft:
    """The input buffer's in-place accumulation of `incoming` into `held`, run in node `d`."""
    return dataclasses.replace(d, name=f"{d.name}_accumulate", target="aten.add_.Tensor", args=(held, incoming),
                               kwargs=(), outputs=(held,), is_view=True)


def _resolve(renamed: dict[int, int], sid: int) -> int:
    """Where a chain of renames ends (a pass-through's operand may itself be passed through)."""
    while sid in renamed and renamed[sid] != sid:
        sid = renamed[sid]
    return sid


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

