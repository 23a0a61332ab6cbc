"""Host memory of a step with offloading (--offload, save_on_cpu): the storages marked `Storage.host`.

`host_memory(graph)` -> HostMemory, or None when nothing is on the host. The host's peak comes from the
same liveness sweep as the device's, over the host storages only: the optimizer state, the host copies
of the parameters and the gradient buffers (held all step long), the optimizer step's temporaries, and
the saved tensors' copies of activation offloading (each from its save until its node runs in backward).
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
    saved_bytes: int = 0                # saved tensors copied to the host during the step (activation offloading)


def host_memory(graph: StepGraph) -> HostMemory | None:
    if not any(s.host for s in graph.storages):
        return None
    liveness = compute_liveness(graph, host=True)
    resident = dict.fromkeys(_KINDS.values(), 0)
    saved = 0
    for storage, interval in zip(graph.storages, liveness.intervals):
        if storage.host and interval.alloc_op == BEFORE_STEP and storage.role in _KINDS:
            resident[_KINDS[storage.role]] += interval.nbytes
        elif storage.host and storage.role is StorageRole.INTERMEDIATE and interval.alloc_op is not None:
            saved += interval.nbytes
    return HostMemory(peak_bytes=liveness.peak_bytes, start_bytes=liveness.start_bytes, resident_bytes=resident,
                      saved_bytes=saved)
