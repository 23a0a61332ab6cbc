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

An in-place op inside a formula (`maximum`'s backward ends in `masked_fill_` on its `where` result;
capture/inplace.py's `formula_writes_marked`) writes into the storage an earlier op made: that storage is
the formula's result at the node's last write into it, not where it was allocated, so the temporaries
made before the write (`self == other`, `grad / 2`) are held until the write.

A formula written as several C++ statements (a FunctionsManual.cpp function) frees each statement's
temporaries at its `;`, and only its named locals live to the function's return. `STATEMENT_ENDS` names,
per forward op, the ops inside its backward that end a statement: `linalg_solve_triangular_backward`'s
`gA_tmp = -gB_tmp.matmul(X.mH());` frees the matmul's result once `neg` has made the named `gA_tmp`, so
it is not live when `tril` makes gA (one A-sized gradient over the peak otherwise: OLMo-Hybrid's gated
delta rule). At such an op the storages the node made since its previous result (or statement end),
other than the op's own outputs, are held until that op and no longer; those outputs (the named local)
are held on, to the next result.

Not modelled: the order of evaluation inside one expression (the graph's order is the formula's own);
and custom autograd Functions that the trace does not reach through `Function.apply`.
"""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from tracer.stepgraph import Phase, TensorValue

_REDUCTIONS = ("aten.sum.dim_IntList", "aten.sum.default")   # validate_outputs' sum_to_size

# forward op -> the backward ops that end a statement of its multi-statement C++ formula (FunctionsManual.cpp)
STATEMENT_ENDS: dict[str, frozenset[str]] = {
    # linalg_solve_triangular_backward: `const Tensor gA_tmp = left ? -gB_tmp.matmul(X.mH()) : -X.mH().matmul(gB_tmp);`
    "aten.linalg_solve_triangular.default": frozenset({"aten.neg.default"}),
    # triangular_solve_backward: `grad_a = transpose ? -x.conj().matmul(grad_b.mT()) : -grad_b.matmul(x.mH());`
    "aten.triangular_solve.default": frozenset({"aten.neg.default"}),
}


def expression_holds(ops: Sequence, python_nodes: frozenset[int] = frozenset()) -> dict[int, int]:
    """ops: OpDrafts in execution order; python_nodes: the sequence numbers of autograd nodes whose backward
    is Python code (custom Functions). Returns storage id -> index of the op until which a backward
    formula's full expression holds it."""
    readers: dict[int, list[int]] = defaultdict(list)
    for index, op in enumerate(ops):
        for sid in storage_ids((op.args, op.kwargs)):
            readers[sid].append(index)
    forward_targets: dict[int, set[str]] = defaultdict(set)      # seq_nr -> the forward ops that made the node
    for op in ops:
        if op.phase is Phase.FORWARD and op.seq_nr is not None:
            forward_targets[op.seq_nr].add(op.target)
    holds: dict[int, int] = {}
    for start, end in _backward_nodes(ops):
        if ops[start].seq_nr in python_nodes:
            continue                                     # a custom Function's Python backward
        statement_ends = frozenset().union(*(STATEMENT_ENDS.get(t, ()) for t in forward_targets[ops[start].seq_nr]))
        last_write: dict[int, int] = {}      # storage id -> the node's last op that makes or writes into it
        for index in range(start, end):
            last_write.update((sid, index) for sid in _made_or_written(ops[index]))
        pending: list[int] = []
        for index in range(start, end):
            op = ops[index]
            # a storage that a later op of the node writes in place is the formula's result only there
            made = [sid for sid in _made_or_written(op) if last_write[sid] == index]
            if any(_leaves_node(sid, index, start, end, ops, readers) for sid in made):
                for sid in pending:
                    holds[sid] = max(holds.get(sid, -1), index)
                pending = []
            elif op.target in statement_ends:
                for sid in pending:                      # the statement's temporaries die at its `;`
                    holds[sid] = max(holds.get(sid, -1), index)
                pending = made
            else:
                pending += made
    return holds


def _made_or_written(op) -> list[int]:
    """The storages `op` allocates, or (an in-place write: `masked_fill_` in a formula) writes into."""
    return [v.storage_id for v in op.outputs] if op.writes_in_place or not op.is_view else []


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
