"""Host memory of a step whose optimizer is offloaded (--offload): the storages marked `Storage.host`.

`host_memory(graph)` -> HostMemory, or None when nothing is on the host. The host's peak comes from the
same liveness sweep as the device's, over the host storages only: the optimizer state, the host copies
of the parameters and the gradient buffers (held all step long), and the optimizer step's temporaries.
Not modelled: the host's own allocator (pinned-memory rounding), the Python process and the dataset.
"""
from __future__ import annotations

import dataclasses

from tracer.passes.liveness import BEFORE_STEP, compute_liveness
from tracer.stepgraph import StepGraph, StorageRole

_KINDS = {StorageRole.OPTIMIZER_STATE: "optimizer_state", StorageRole.PARAMETER: "parameter",
          StorageRole.GRADIENT: "gradient"}


@dataclasses.dataclass(frozen=True)
class HostMemory:
    peak_bytes: int
    start_bytes: int                    # held before the step
    resident_bytes: dict[str, int]      # held before the step, by kind: optimizer_state, parameter, gradient


def host_memory(graph: StepGraph) -> HostMemory | None:
    if not any(s.host for s in graph.storages):
        return None
    liveness = compute_liveness(graph, host=True)
    resident = dict.fromkeys(_KINDS.values(), 0)
    for storage, interval in zip(graph.storages, liveness.intervals):
        if storage.host and interval.alloc_op == BEFORE_STEP and storage.role in _KINDS:
            resident[_KINDS[storage.role]] += interval.nbytes
    return HostMemory(peak_bytes=liveness.peak_bytes, start_bytes=liveness.start_bytes, resident_bytes=resident)
