"""Gradient accumulation: `accumulate` micro-batches of forward + backward, then one optimizer step.

The step is simulated on the captured graph, as the training loop

    for micro_batch in micro_batches:          # all of them made before the step
        loss = model(*micro_batch)
        loss.backward()
    optimizer.step(); optimizer.zero_grad(...)

runs it. Micro-batch 1 is the captured forward + backward as a single step runs it (its backward creates
the gradients when they were set to None). Every later micro-batch is the same forward + backward
converted with the gradients already resident: each incoming gradient is added in place into `.grad`
(AccumulateGrad with grad mode off: `variable.grad += new_grad`) and then freed. Its activations,
temporaries and inputs are storages of its own; parameters, buffers and gradients are shared. The ops
carry their micro-batch (`OpNode.micro_batch`), so the report's phases read "forward (micro-batch 2)".

Lifetimes across micro-batches: `loss` of micro-batch k is released when the next forward's loss is bound
to the name (after micro-batch k+1's last forward op); the last one outlives the step. A tensor a
forward stores on a module attribute is released when the next micro-batch stores its own. Each
micro-batch's inputs exist before the step (they count in the memory before the step).

Not modelled: dividing the loss by `accumulate` (`(loss / n).backward()` adds a few 0-dim tensors), and
DDP's `no_sync()` / FSDP's gradient synchronisation between micro-batches (--shard is refused with
--accumulate). Other storages a micro-batch leaves alive past its backward (a reentrant checkpoint's RNG
state on the autograd graph) are kept to the end of the step and flagged in a note.
"""
from __future__ import annotations

import dataclasses

from tracer.capture.convert import GraphPart, OpDraft
from tracer.capture.splice import copy_storages, relocated_ops
from tracer.capture.storages import StorageTable
from tracer.errors import UsageError
from tracer.stepgraph import Phase, StorageRole

# Ops one simulated step may hold: every micro-batch is simulated op by op (about a minute and a half per
# million ops through the passes on a 2-core machine), so the work stays bounded whatever --accumulate says.
MAX_STEP_OPS = 1_000_000

KeptPairs = tuple[tuple[int | None, int], ...]   # per kept module attribute: (previous step's storage, new one)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """One micro-batch's forward + backward over its own storage table."""
    part: GraphPart
    table: StorageTable
    kept: KeptPairs
    notes: tuple[str, ...] = ()        # what the micro-batch's lifetimes assume, for the report


def chain_micro_batches(first: MicroBatch, later: MicroBatch, count: int, shared: dict[int, int]) -> tuple[list[OpDraft], tuple[str, ...]]:
    """The ops of `count` micro-batches over `first.table`: `first`, then `later` (converted with the
    gradients resident) copied `count - 1` times. `shared` maps `later.table`'s parameter, buffer and
    gradient storages to `first.table`'s. Returns the ops and the notes for the report. Raises UsageError
    when the step would hold more than `MAX_STEP_OPS` ops."""
    step_ops = len(first.part.ops) + (count - 1) * len(later.part.ops)
    if step_ops > MAX_STEP_OPS:
        raise UsageError(f"--accumulate {count} repeats the captured forward and backward ({len(later.part.ops):,} "
                         f"ops) {count:,} times: {step_ops:,} ops, over the {MAX_STEP_OPS:,} one simulated step may "
                         "hold", hint=f"pass --accumulate {max(2, MAX_STEP_OPS // max(1, len(later.part.ops)))} "
                                      "or fewer")
    table = first.table
    ops = [dataclasses.replace(d, micro_batch=1) for d in first.part.ops]
    loss_sid = first.part.loss_sid
    kept_sid = [new for _, new in first.kept]
    last_forward = max((i for i, d in enumerate(later.part.ops) if d.phase is Phase.FORWARD), default=0)
    for k in range(2, count + 1):
        offset = len(ops)
        sid_map = dict(shared)
        for (previous, _), held in zip(later.kept, kept_sid):
            if previous is not None:       # the previous micro-batch's tensor is released when this one's is stored
                sid_map[previous] = held
                table.update(held, persistent=False,
                             released_after_op=later.table.get(previous).released_after_op + offset)
        copy_storages(later.table, table, sid_map, ops_offset=offset)
        ops += relocated_ops(later.part.ops, sid_map, ops_offset=offset, suffix=f"_mb{k}", micro_batch=k)
        table.update(loss_sid, persistent=False, released_after_op=offset + last_forward)
        loss_sid = sid_map[later.part.loss_sid]
        kept_sid = [sid_map[new] for _, new in later.kept]
    return ops, _notes(later, shared, count)


def _notes(later: MicroBatch, shared: dict[int, int], count: int) -> tuple[str, ...]:
    notes = [f"gradient accumulation: {count} micro-batches of forward + backward, then one optimizer step; "
             "from micro-batch 2 on the gradients are resident and accumulated in place; the loss is not "
             "divided by the number of micro-batches"]
    kept = {new for _, new in later.kept} | {later.part.loss_sid}
    outliving = [sid for sid in range(len(later.table)) if sid not in shared and sid not in kept
                 and _outlives_its_micro_batch(later.table.get(sid))]
    if outliving:
        nbytes = sum(later.table.get(sid).nbytes for sid in outliving)
        notes.append(f"{len(outliving)} storages ({nbytes:,} B) of each micro-batch outlive its backward (e.g. a "
                     "reentrant checkpoint's RNG state): kept to the end of the step for every micro-batch")
    return tuple(notes)


def _outlives_its_micro_batch(entry) -> bool:
    return (entry.persistent and not entry.preexisting and not entry.fused and entry.nbytes > 0
            and entry.role is not StorageRole.GRADIENT)
