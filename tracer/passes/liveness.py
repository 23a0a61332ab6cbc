"""Storage-level liveness: one interval per storage, then alloc/free events, then a running sum.

Conventions (eager semantics at op granularity):
  * A pre-existing storage is live from before the first op. Any other storage is allocated by the
    first op it appears in (normally as an output), while that op's inputs are still live.
  * A storage is freed after the op named by `released_after_op` when the capture observed its release,
    never if it is persistent (it outlives the step), otherwise after its last use (the last op that
    reads it or produces a value on it: views extend the life of their storage), or after
    `held_until_op` if a Python local holds it longer.
  * A storage marked `fused` (compiled code computes it inside its consumers' kernels) takes 0 bytes, and
    so does one in host memory (`host`, --offload) unless the host's memory is asked for.
  * Backward ops of one autograd Node (same `autograd_node`) run as one unit in eager: a storage made
    before the node and last used inside it (a saved tensor, the incoming gradient) is freed when the
    whole node has run, as the engine releases saved variables and input buffers after `apply`.
  * `live_during[i]` is live bytes while op i runs (its outputs allocated, nothing freed yet): the
    peak is the maximum of these. `live_after[i]` is after op i's frees.
Not modelled: kernel-internal scratch buffers (invisible to the dispatcher; see GROUND_TRUTH.md 2.1).
"""
from __future__ import annotations

import dataclasses

from tracer.stepgraph import StepGraph

BEFORE_STEP = -1


@dataclasses.dataclass(frozen=True)
class Interval:
    storage_id: int
    nbytes: int
    alloc_op: int | None          # BEFORE_STEP for pre-existing storages; None if never materialised
    free_op: int | None           # freed after this op; None = still live at the end of the step


@dataclasses.dataclass(frozen=True)
class Liveness:
    intervals: tuple[Interval, ...]          # indexed by storage id
    live_during: tuple[int, ...]             # bytes live while op i runs
    live_after: tuple[int, ...]              # bytes live after op i's frees
    start_bytes: int                         # live before the first op
    peak_bytes: int
    peak_op: int

    def live_storages_at(self, op_index: int) -> tuple[int, ...]:
        """Storage ids live while op `op_index` runs."""
        return tuple(iv.storage_id for iv in self.intervals
                     if iv.alloc_op is not None and iv.alloc_op <= op_index
                     and (iv.free_op is None or iv.free_op >= op_index))


def compute_liveness(graph: StepGraph, *, host: bool = False) -> Liveness:
    """The device's memory; `host`: the host memory of the storages an offload keeps there (`Storage.host`)."""
    first_use: dict[int, int] = {}
    last_use: dict[int, int] = {}
    for op in graph.ops:
        for value in op.outputs + op.input_values():
            first_use.setdefault(value.storage_id, op.index)
            last_use[value.storage_id] = op.index
    node_span = _autograd_node_spans(graph)
    for sid, last in last_use.items():
        span = node_span.get(last)
        if span is not None and first_use[sid] < span[0]:
            last_use[sid] = span[1]
    intervals = tuple(_interval(s, first_use.get(s.storage_id), last_use.get(s.storage_id), counted=s.host == host)
                      for s in graph.storages)
    n = len(graph.ops)
    alloc_at = [0] * n
    free_at = [0] * n
    start = 0
    for iv in intervals:
        if iv.alloc_op == BEFORE_STEP:
            start += iv.nbytes
        elif iv.alloc_op is not None:
            alloc_at[iv.alloc_op] += iv.nbytes
        if iv.free_op is not None and iv.alloc_op is not None:
            free_at[iv.free_op] += iv.nbytes
    during, after = [], []
    live = start
    for i in range(n):
        live += alloc_at[i]
        during.append(live)
        live -= free_at[i]
        after.append(live)
    peak_op = max(range(n), key=lambda i: (during[i], -i)) if n else 0
    return Liveness(intervals=intervals, live_during=tuple(during), live_after=tuple(after), start_bytes=start,
                    peak_bytes=during[peak_op] if n else start, peak_op=peak_op)


def _autograd_node_spans(graph: StepGraph) -> dict[int, tuple[int, int]]:
    """op index -> (first, last) op index of its autograd node run (backward ops only)."""
    spans: dict[int, tuple[int, int]] = {}
    run: list[int] = []
    for op in list(graph.ops) + [None]:
        node = None if op is None else op.autograd_node
        if run and (node is None or node != graph.ops[run[-1]].autograd_node):
            spans.update(dict.fromkeys(run, (run[0], run[-1])))
            run = []
        if node is not None:
            run.append(op.index)
    return spans


def _interval(storage, first: int | None, last: int | None, *, counted: bool = True) -> Interval:
    if storage.preexisting:
        alloc = BEFORE_STEP
    elif first is None:
        return Interval(storage.storage_id, storage.nbytes, alloc_op=None, free_op=None)  # never materialised
    else:
        alloc = first
    if storage.released_after_op is not None:
        free = max(storage.released_after_op, alloc)
    elif storage.persistent:
        free = None
    else:
        free = last if last is not None else alloc
        if storage.held_until_op is not None:
            free = max(free, storage.held_until_op)
    return Interval(storage.storage_id, storage.nbytes if counted and not storage.fused else 0, alloc_op=alloc,
                    free_op=free)


def intervals_by_op(intervals) -> tuple[dict[int, list[Interval]], dict[int, list[Interval]]]:
    """op index -> intervals allocated by it, and op index -> intervals freed after it (for event streams)."""
    allocs_at: dict[int, list[Interval]] = {}
    frees_at: dict[int, list[Interval]] = {}
    for iv in intervals:
        if iv.alloc_op != BEFORE_STEP:
            allocs_at.setdefault(iv.alloc_op, []).append(iv)
        if iv.free_op is not None:
            frees_at.setdefault(iv.free_op, []).append(iv)
    return allocs_at, frees_at
