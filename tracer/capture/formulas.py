"""How long the temporaries of an eager backward formula live.

Eager autograd computes each input's gradient with a C++ formula (derivatives.yaml, FunctionsManual.cpp),
one full expression: `div`'s `other` gradient is `-grad * ((self / other) / other)`. C++ destroys the
temporaries of a full expression when the whole expression is done, not at their last use, so
`self / other`, its quotient by `other` and `-grad` are all live when the product is allocated. The
traced graph has the same ops and would free each at its last use. Measured on a real CUDA snapshot
(CS336 medium, bf16 autocast, context 512): the hand-written softmax's division backward allocates four
attention-sized fp32 tensors in a row, then frees three; the graph's last-use rule frees the first
before the third is allocated.

`expression_holds(ops)` finds, within each backward autograd node (the backward ops sharing one
`seq_nr`), the formula results: fresh storages that leave the node (read by an op of another node, or
reduced to the input's shape by the node's trailing sums before they leave, or read by nothing: a
final gradient). The storages the node made since its previous result are held until that result's op.
Forward ops re-run in backward (checkpointing) are Python-level ops and are left alone, and so are the
nodes of custom autograd Functions (their backward is Python code, e.g. BLOOM's GeLU; the capture records
their sequence numbers as `Function.apply` creates them), whose temporaries die at their last use.

Not modelled: the order of evaluation inside one expression (the graph's order is the formula's own);
custom autograd Functions that the trace does not reach through `Function.apply`; and
in-place ops inside a formula (`maximum`'s backward ends in `masked_fill_`), which the functionalized
graph records as out-of-place ops with a new output (an over-prediction of one tensor at that op).
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from tracer.stepgraph import Phase, TensorValue

_REDUCTIONS = ("aten.sum.dim_IntList", "aten.sum.default")   # validate_outputs' sum_to_size


def expression_holds(ops: Sequence, python_nodes: frozenset[int] = frozenset()) -> dict[int, int]:
    """ops: OpDrafts in execution order; python_nodes: the sequence numbers of autograd nodes whose backward
    is Python code (custom Functions). Returns storage id -> index of the op until which a backward
    formula's full expression holds it."""
    readers: dict[int, list[int]] = defaultdict(list)
    for index, op in enumerate(ops):
        for sid in storage_ids((op.args, op.kwargs)):
            readers[sid].append(index)
    holds: dict[int, int] = {}
    for start, end in _backward_nodes(ops):
        if ops[start].seq_nr in python_nodes:
            continue                                     # a custom Function's Python backward
        pending: list[int] = []
        for index in range(start, end):
            op = ops[index]
            made = [] if op.is_view else [v.storage_id for v in op.outputs]
            if any(_leaves_node(sid, index, start, end, ops, readers) for sid in made):
                for sid in pending:
                    holds[sid] = max(holds.get(sid, -1), index)
                pending = []
            else:
                pending += made
    return holds


def _backward_nodes(ops: Sequence) -> list[tuple[int, int]]:
    """[start, end) ranges of consecutive eager backward ops with one autograd sequence number."""
    ranges, index = [], 0
    while index < len(ops):
        op = ops[index]
        if op.phase is not Phase.BACKWARD or op.seq_nr is None or op.recomputed:
            index += 1
            continue
        end = index + 1
        while end < len(ops) and ops[end].phase is Phase.BACKWARD and ops[end].seq_nr == op.seq_nr \
                and not ops[end].recomputed:
            end += 1
        ranges.append((index, end))
        index = end
    return ranges


def _leaves_node(sid: int, made_at: int, start: int, end: int, ops: Sequence, readers) -> bool:
    later = [r for r in readers.get(sid, ()) if r > made_at]
    if not later:
        return True                                      # read by nothing: a gradient the step keeps
    for reader in later:
        if not start <= reader < end:
            return True
        if ops[reader].target in _REDUCTIONS and not ops[reader].is_view and all(
                _leaves_node(out.storage_id, reader, start, end, ops, readers) for out in ops[reader].outputs):
            return True
    return False


def storage_ids(value) -> list[int]:
    if isinstance(value, TensorValue):
        return [value.storage_id]
    if isinstance(value, (tuple, list)):
        return [sid for item in value for sid in storage_ids(item)]
    return []
