"""Saved-for-backward storages: those live when backward starts and read by some backward op (other than
one that reads only metadata, `METADATA_READERS`), and those made in the forward that autograd holds into
backward without any backward op reading them (`Storage.held_until_op` in backward: a custom Function's
`ctx.save_for_backward` of a tensor its backward never uses, as the capture saw it).

Parameters, gradients and optimizer state are excluded (they are not activations); user inputs that backward reads (token ids,
targets) are included in `storage_ids` and reported apart as `input_bytes`, since eager autograd
saves them too but they existed before the step.
"""
from __future__ import annotations

import dataclasses

from tracer.passes.liveness import BEFORE_STEP, Liveness
from tracer.stepgraph import Phase, StepGraph, StorageRole

# ops that read only their input's shape, dtype and device: autograd keeps sizes for them, never the tensor
# (the `ones_like(loss)` that seeds backward in a step run op by op reads the loss so)
METADATA_READERS: frozenset[str] = frozenset({
    "aten.empty_like", "aten.zeros_like", "aten.ones_like", "aten.full_like", "aten.new_empty",
    "aten.new_empty_strided", "aten.new_zeros", "aten.new_ones", "aten.new_full"})


# what backward may read but is billed as itself, never as saved: the weights, their gradients, and the
# optimizer's state (the GradScaler's scale, which the loop's `scaler.scale(loss)` multiplies in after the
# model's forward has returned)
_NOT_SAVED = frozenset({StorageRole.PARAMETER, StorageRole.GRADIENT, StorageRole.OPTIMIZER_STATE})


@dataclasses.dataclass(frozen=True)
class SavedTensors:
    storage_ids: frozenset[int]
    total_bytes: int                  # everything saved, inputs included (what saved_tensors_hooks sees)
    activation_bytes: int             # saved storages produced during the step
    input_bytes: int                  # saved storages that existed before the step (inputs, buffers)


def find_saved_tensors(graph: StepGraph, liveness: Liveness) -> SavedTensors:
    """Under gradient accumulation each micro-batch's backward reads what its own forward saved: the
    storages of every micro-batch count (a storage is saved when made before its reader's backward began)."""
    backward = [op for op in graph.ops if op.phase is Phase.BACKWARD]
    if not backward:
        return SavedTensors(frozenset(), 0, 0, 0)
    first_backward: dict[int | None, int] = {}
    for op in backward:
        first_backward.setdefault(op.micro_batch, op.index)
    saved = set()
    for op in backward:
        for value in _read_values(op):
            storage = graph.storage(value.storage_id)
            alloc = liveness.intervals[value.storage_id].alloc_op
            if storage.role in _NOT_SAVED or alloc is None \
                    or alloc >= first_backward[op.micro_batch]:
                continue
            saved.add(value.storage_id)
    saved |= _held_into_backward(graph, liveness, first_backward)
    total = sum(graph.storage(s).nbytes for s in saved)
    before = sum(graph.storage(s).nbytes for s in saved if liveness.intervals[s].alloc_op == BEFORE_STEP)
    return SavedTensors(frozenset(saved), total, total - before, before)


def _read_values(op) -> tuple:
    """The values `op` reads as data: a metadata reader reads only its `eager_saved` keyword (what eager
    autograd saves for the node although its formula reads only a shape: capture's `_eager_saved_for_shape`)."""
    if op.target.rsplit(".", 1)[0] not in METADATA_READERS:
        return op.input_values()
    return tuple(v for name, held in op.kwargs if name == "eager_saved" for v in held)


def _held_into_backward(graph: StepGraph, liveness: Liveness, first_backward: dict[int | None, int]) -> set[int]:
    """Storages made before backward that are held into it (not by the training loop, not for good)."""
    start = min(first_backward.values())
    held = set()
    for storage in graph.storages:
        alloc = liveness.intervals[storage.storage_id].alloc_op
        if (storage.held_until_op is not None and storage.held_until_op >= start and alloc is not None
                and alloc != BEFORE_STEP and alloc < start and not storage.caller_held and not storage.persistent
                and storage.role not in _NOT_SAVED):
            held.add(storage.storage_id)
    return held
