"""Saved-for-backward storages: those live when backward starts and read by some backward op.

Parameters are excluded (they are not activations); user inputs that backward reads (token ids,
targets) are included in `storage_ids` and reported apart as `input_bytes`, since eager autograd
saves them too but they existed before the step.
"""
from __future__ import annotations

import dataclasses

from tracer.passes.liveness import BEFORE_STEP, Liveness
from tracer.stepgraph import Phase, StepGraph, StorageRole


@dataclasses.dataclass(frozen=True)
class SavedTensors:
    storage_ids: frozenset[int]
    total_bytes: int                  # everything saved, inputs included (what saved_tensors_hooks sees)
    activation_bytes: int             # saved storages produced during the step
    input_bytes: int                  # saved storages that existed before the step (inputs, buffers)


def find_saved_tensors(graph: StepGraph, liveness: Liveness) -> SavedTensors:
    backward = [op for op in graph.ops if op.phase is Phase.BACKWARD]
    if not backward:
        return SavedTensors(frozenset(), 0, 0, 0)
    first_backward = backward[0].index
    read_in_backward = {v.storage_id for op in backward for v in op.input_values()}
    saved = set()
    for sid in read_in_backward:
        storage = graph.storage(sid)
        alloc = liveness.intervals[sid].alloc_op
        if storage.role in (StorageRole.PARAMETER, StorageRole.GRADIENT) or alloc is None or alloc >= first_backward:
            continue
        saved.add(sid)
    total = sum(graph.storage(s).nbytes for s in saved)
    before = sum(graph.storage(s).nbytes for s in saved if liveness.intervals[s].alloc_op == BEFORE_STEP)
    return SavedTensors(frozenset(saved), total, total - before, before)
