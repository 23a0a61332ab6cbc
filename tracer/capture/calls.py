"""How long one Python-level torch call holds tensors in eager.

A torch call (`F.cross_entropy(logits.flatten(0, 1), y)`, `F.scaled_dot_product_attention(q, k, v)`) may run
several aten ops (a C++ composite kernel, or a Python function such as `F.cross_entropy`). The traced graph
frees each tensor at its last use; eager holds more:
  * the call's arguments: the caller's frame holds them until the call returns (a temporary argument such
    as `logits.flatten(0, 1)` included), so every storage the call reads that was made before it lives
    until the call's last op; so do the copies autocast makes of them when the call begins (its dtype
    casts), which it hands to the kernel as its arguments;
  * the math kernel of scaled dot-product attention (`_scaled_dot_product_attention_math`, attention.cpp)
    prepares its inputs into C++ locals (`query_acc`/`key_acc`/`value_acc` casts, the scaled `query`, the
    GQA-repeated `key_expanded`/`value_expanded`, a converted boolean or causal mask) that live until it
    returns; the graph frees the repeated key after the scaling that reads it. Measured on CPU (torch 2.13):
    the repeated key is freed after the output's bmm, while the attention scores it rebinds (`attn =
    attn.add(mask)`, `attn = _safe_softmax(attn)`) are freed as they are rebound. So every storage the
    kernel makes before its first matmul (`aten.bmm`) is held until its last op, except the temporaries of
    the matmul's expression, held until that matmul returns: the scaled key (`key.transpose(-2, -1) * scale`;
    measured in a checkpointed region's recompute, where bmm's copies of its operands are kept for backward
    but the scaled key is not) and those copies themselves (at::matmul's `expand` + `clone` of each operand;
    measured in a checkpointed region's forward, where nothing is kept for backward).

`call_holds(ops)` returns storage id -> index of the op until which a call holds it. Forward ops and
recomputed ones (a checkpointed region's recompute reruns its calls); the calls are those the capture
stamped (`OpDraft.torch_call`, from the nodes' `torch_fn`). Not modelled: the locals of other composite
kernels (each keeps its own; most are rebound or die with their full expression, as the graph has them), and
calls on capture paths that record no `torch_fn` per op.
"""
from __future__ import annotations

from collections.abc import Sequence

from tracer.capture.formulas import storage_ids
from tracer.stepgraph import Phase

_MATH_ATTENTION_CALLS = ("scaled_dot_product_attention_",)       # the torch_fn name, then a counter
_MATH_ATTENTION_MARK = "aten._safe_softmax.default"             # only the math kernel runs it
_MATMULS = ("aten.bmm.default", "aten.mm.default")


def call_holds(ops: Sequence) -> dict[int, int]:
    """ops: OpDrafts in execution order. Returns storage id -> index of the last op of the torch call
    that holds it."""
    made_at: dict[int, int] = {}
    for index, op in enumerate(ops):
        for value in op.outputs:
            made_at.setdefault(value.storage_id, index)
    holds: dict[int, int] = {}
    for start, end in _call_ranges(ops):
        first_matmul = _first_matmul(ops, start, end)
        temporaries = _matmul_temporaries(ops, start, first_matmul) if first_matmul is not None else set()
        for sid in _cast_arguments(ops, start, end, made_at):
            holds[sid] = max(holds.get(sid, -1), end - 1)               # autocast's copy of an argument
        for index in range(start, end):
            for sid in storage_ids((ops[index].args, ops[index].kwargs)):
                if made_at.get(sid, -1) < start:
                    holds[sid] = max(holds.get(sid, -1), end - 1)       # an argument of the call
            if first_matmul is not None and index < first_matmul and not ops[index].is_view:
                for value in ops[index].outputs:
                    until = first_matmul if value.storage_id in temporaries else end - 1
                    holds[value.storage_id] = max(holds.get(value.storage_id, -1), until)
    return holds


def _cast_arguments(ops: Sequence, start: int, end: int, made_at: dict[int, int]) -> set[int]:
    """The storages of the dtype casts a call begins with, of tensors made before it: autocast casts a call's
    arguments before its kernel runs and hands the copies to the kernel as its arguments, which live until
    the kernel returns (`F.cross_entropy` of fp16 logits under autocast: the fp32 copy is alive while
    `nll_loss` makes the loss, after `log_softmax` read it last)."""
    casts: set[int] = set()
    for index in range(start, end):
        op = ops[index]
        if op.is_view:
            continue
        if op.target != "aten._to_copy.default":
            break
        sources = [a for a in op.args[:1] if hasattr(a, "storage_id")]
        if not sources or made_at.get(sources[0].storage_id, -1) >= start:
            break
        casts.update(value.storage_id for value in op.outputs)
    return casts


# ops through which at::matmul passes an operand on to its bmm: views, and the copies of its batch expansion
_MATMUL_PLUMBING = ("aten.view.default", "aten.expand.default", "aten.clone.default", "aten._unsafe_view.default",
                    "aten.transpose.int", "aten.reshape.default")


def _matmul_temporaries(ops: Sequence, start: int, first_matmul: int) -> set[int]:
    """The storages of the first matmul's expression that are no C++ local of the kernel, so they live
    until that matmul returns: the copies at::matmul makes of its operands' batch expansion (`expand` then
    `clone`), and the scaled key (`key.transpose(-2, -1) * scale`). Each operand is followed back through
    the matmul's views and copies; the first operand's source is the kernel's local `query`, the second's
    the scaled key."""
    made: dict[int, int] = {}
    for index in range(start, first_matmul):
        for value in ops[index].outputs:
            made.setdefault(value.storage_id, index)
    operands = [a for a in ops[first_matmul].args if hasattr(a, "storage_id")]
    temporaries: set[int] = set()
    for position, operand in enumerate(operands[:2]):
        sid, seen = operand.storage_id, set()
        while sid in made and sid not in seen:
            seen.add(sid)
            producer = ops[made[sid]]
            if producer.target not in _MATMUL_PLUMBING:
                if position == 1:
                    temporaries.add(sid)
                break
            temporaries.add(sid)
            sources = [a for a in producer.args if hasattr(a, "storage_id")]
            if not sources:
                break
            sid = sources[0].storage_id
    return temporaries


def _call_ranges(ops: Sequence) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive ops of one torch call, in forward or in a checkpointed region's
    recompute (which reruns the region's Python code)."""
    ranges, index = [], 0
    while index < len(ops):
        call, kind = ops[index].torch_call, _kind(ops[index])
        if call is None or kind is None:
            index += 1
            continue
        end = index + 1
        while end < len(ops) and ops[end].torch_call == call and _kind(ops[end]) == kind:
            end += 1
        ranges.append((index, end))
        index = end
    return ranges


def _kind(op) -> str | None:
    """"forward", "recomputed", or None for an op no Python call ran (a backward formula's)."""
    if op.recomputed:
        return "recomputed"
    return "forward" if op.phase is Phase.FORWARD else None


def _first_matmul(ops: Sequence, start: int, end: int) -> int | None:
    """The index of the first matmul of a math attention call in [start, end), else None."""
    call = ops[start].torch_call or ""
    if not call.startswith(_MATH_ATTENTION_CALLS) or not any(
            ops[i].target == _MATH_ATTENTION_MARK for i in range(start, end)):
        return None
    return next((i for i in range(start, end) if ops[i].target in _MATMULS), None)
