"""Megatron tensor (and sequence) parallelism: the memory of one tensor-parallel rank (placeholder)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TensorParallelSetup:
    tp: int                       # tensor-parallel ranks
    sp: bool = False              # Megatron sequence parallelism


def tensor_parallel_graph(graph, setup):
    raise NotImplementedError
