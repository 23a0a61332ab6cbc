"""Pipeline parallelism: the step of one pipeline stage, as torch.distributed.pipelining runs it.

    pipeline_stage_graph(graph, setup, rank) -> StepGraph      what one rank holds, op by op
    busiest_stage_graph(graph, setup) -> StepGraph             the rank with the largest peak, every rank's in a note
    rank_actions(setup, rank)                                  the (stage, forward or backward, micro-batch) a rank runs

`graph` is the step captured with `microbatches` micro-batches of gradient accumulation (each op carries its
micro-batch, the gradients accumulate from the second on). The model's repeated blocks are split into
`stages` contiguous runs of (nearly) equal length, as a manual split does (torchtitan's); what runs before
the first block (the embedding) is the first stage's, what runs after the last (the final norm, the head and
the loss) the last stage's, and code outside any block between two (a residual sum, in backward the sum of
a gradient's contributions) the stage of the block before it in its pass. A stage's rank runs its own ops
of each micro-batch in the schedule's order:

* `gpipe` (ScheduleGPipe): every forward, then every backward;
* `1f1b` (Schedule1F1B): `min(microbatches, stages - stage)` forwards, then one backward and one forward in
  turn, then the remaining backwards;
* `interleaved-1f1b` (ScheduleInterleaved1F1B): each rank holds `stages_per_rank` stages, rank r the stages
  r, r + ranks, r + 2 ranks, ... of `ranks * stages_per_rank`; the rank runs torch's order for it
  (`interleaved_actions`: a warm-up of forwards that walks its stages a round of micro-batches at a time,
  then one forward and one backward in turn, then the remaining backwards, the latest stage's first);

then the optimizer step over its own parameters (a foreach op keeps the stage's elements of its lists).

What the pipelining runtime holds, from its source (torch/distributed/pipelining/stage.py):
* a stage after the first receives each micro-batch's input activations into a buffer of its own, made once
  and kept across steps; a stage before the last receives each micro-batch's output gradients likewise;
* a stage keeps each micro-batch's output (`fwd_cache`) until that micro-batch's backward has run, and the
  send that hands it on may keep it longer: GPipe keeps every forward send until its last backward, 1F1B the
  send of its last warmup forward but one until its one-forward-one-backward loop ends, and the interleaved
  runtime (`_PipelineScheduleRuntime`) every send until its loop ends;
* the gradient of a received input is held by the send that hands it on until the schedule replaces that
  send: after the stage's next backward (1F1B), or until every backward has run (GPipe, interleaved);
* the schedule's loss per micro-batch is computed on the last stage (the ops after the last block).
Everything else is the captured step's own lifetimes, in the stage's order.

With `return_outputs` (torch's default for `step()`), the last stage keeps every micro-batch's output in
`output_chunks` until the next step clears them as it starts, and concatenates them into the returned output
after the last backward (a loop that does not keep it drops it at once); without, each output is let go after
its backward.

Not modelled: zero-bubble schedules (a backward split into its input and weight halves), a tensor that every
stage computes for itself (a rotary table made before the first block is taken as received), and
send/receive staging buffers of the communication backend (none on gloo for CPU tensors). Per-stage FLOPs
stay the whole step's.
"""
from __future__ import annotations

import bisect
import dataclasses
import math

from tracer.choices import PIPELINE_SCHEDULES
from tracer.errors import UsageError
from tracer.passes.blocks import block_of, repeated_blocks
from tracer.stepgraph import OpNode, Phase, StepGraph, StorageRole, TensorValue


@dataclasses.dataclass(frozen=True)
class PipelineSetup:
    stages: int                    # pipeline ranks (one stage each, or stages_per_rank with interleaved-1f1b)
    microbatches: int              # micro-batches per step (the capture's accumulation)
    schedule: str = "1f1b"
    return_outputs: bool = True    # step(..., return_outputs=True), torch's default: the last stage keeps outputs
    stages_per_rank: int = 1       # interleaved-1f1b: the model is cut into stages * stages_per_rank stages

    @property
    def stage_count(self) -> int:
        return self.stages * self.stages_per_rank

    def rank_stages(self, rank: int) -> tuple[int, ...]:
        """The stages rank `rank` holds: rank, rank + ranks, ... (torch's interleaved placement)."""
        return tuple(rank + k * self.stages for k in range(self.stages_per_rank))


def rank_actions(setup: PipelineSetup, rank: int) -> tuple[tuple[int, Phase, int], ...]:
    """(stage, phase, micro-batch from 1) of the forwards and backwards rank `rank` runs, in its order."""
    if setup.schedule == "interleaved-1f1b":
        return interleaved_actions(rank, setup.stages, setup.stages_per_rank, setup.microbatches)
    if setup.stages_per_rank != 1:
        raise UsageError(f"{setup.schedule} runs one stage per rank, not {setup.stages_per_rank}",
                         hint="--pp-schedule interleaved-1f1b holds several stages on each rank")
    return tuple((rank, phase, m) for phase, m in
                 schedule_actions(setup.schedule, rank, setup.stages, setup.microbatches))


def interleaved_actions(rank: int, ranks: int, per_rank: int, microbatches: int) -> tuple[tuple[int, Phase, int], ...]:
    """ScheduleInterleaved1F1B's order for one rank (torch's `_calculate_single_rank_operations`): micro-batches
    go in rounds of `microbatches // max(1, microbatches // ranks)`; the warm-up runs
    `(per_rank - 1) * round + 2 * (ranks - 1 - rank)` forwards (at most all of them), a round on each of the
    rank's stages in turn; then a forward and a backward in turn, backwards walking the stages from the
    latest; then the remaining backwards. Raises UsageError where the micro-batches do not fill whole
    rounds, as torch does."""
    rounds = max(1, microbatches // ranks)
    if microbatches % rounds:
        raise UsageError(f"interleaved-1f1b: {microbatches} micro-batches are not a multiple of the schedule's "
                         f"{rounds} rounds", hint=f"pick --microbatches from {ranks}, {2 * ranks}, ... or at most {ranks}")
    per_round = microbatches // rounds
    total = per_rank * microbatches
    warmup = min((per_rank - 1) * per_round + 2 * (ranks - 1 - rank), total)
    steady = total - warmup

    def forward_stage(step: int) -> int:
        return (step // per_round) % per_rank * ranks + rank

    def backward_stage(step: int) -> int:
        return (per_rank - 1 - ((step - warmup) // per_round) % per_rank) * ranks + rank

    forwards: dict[int, int] = {}
    backwards: dict[int, int] = {}
    actions = []

    def run(stage: int, phase: Phase, counts: dict[int, int]) -> None:
        counts[stage] = counts.get(stage, 0) + 1
        actions.append((stage, phase, counts[stage]))

    for step in range(warmup + steady + warmup):
        if step < warmup + steady:
            run(forward_stage(step), Phase.FORWARD, forwards)
        if step >= warmup:
            run(backward_stage(step), Phase.BACKWARD, backwards)
    return tuple(actions)


def schedule_actions(schedule: str, stage: int, stages: int, microbatches: int) -> tuple[tuple[Phase, int], ...]:
    """(phase, micro-batch from 1) of the forwards and backwards stage `stage` runs, in its order."""
    if schedule == "gpipe":
        return (tuple((Phase.FORWARD, m) for m in range(1, microbatches + 1))
                + tuple((Phase.BACKWARD, m) for m in range(1, microbatches + 1)))
    if schedule != "1f1b":
        raise UsageError(f"unknown pipeline schedule {schedule!r}", hint=f"valid: {', '.join(PIPELINE_SCHEDULES)}")
    warmup = min(microbatches, stages - stage)
    actions = [(Phase.FORWARD, m) for m in range(1, warmup + 1)]
    forward, backward = warmup + 1, 1
    while True:
        actions.append((Phase.BACKWARD, backward))
        backward += 1
        if forward > microbatches:
            break
        actions.append((Phase.FORWARD, forward))
        forward += 1
    actions += [(Phase.BACKWARD, m) for m in range(backward, microbatches + 1)]
    return tuple(actions)


def busiest_stage_graph(graph: StepGraph, setup: PipelineSetup) -> StepGraph:
    """The step of the rank whose peak is the largest (the first of equals): the one that decides whether
    the pipeline fits; a note gives every rank's peak."""
    from tracer.passes.liveness import compute_liveness
    graphs = [pipeline_stage_graph(graph, setup, rank) for rank in range(setup.stages)]
    peaks = [compute_liveness(g).peak_bytes for g in graphs]
    busiest = peaks.index(max(peaks))
    unit = "stage" if setup.stages_per_rank == 1 else "rank"
    note = (f"pipeline {unit}s' peaks: " + ", ".join(f"{unit} {i + 1} {p:,} B" for i, p in enumerate(peaks))
            + f"; this report is {unit} {busiest + 1}'s")
    chosen = graphs[busiest]
    return dataclasses.replace(chosen, config=dataclasses.replace(chosen.config,
                                                                   notes=chosen.config.notes + (note,)))


def op_stages(graph: StepGraph, stages: int) -> list[int | None]:
    """The stage of every forward and backward op (None for the optimizer's). Raises UsageError when the
    model has fewer repeated blocks than stages."""
    blocks = repeated_blocks(graph)
    if len(blocks) < stages:
        raise UsageError(f"{stages} pipeline stages: the model has {len(blocks)} repeated blocks to split into "
                         f"{stages} stages", hint="pick a --pp (times --pp-local-stages) no larger than the number "
                                              "of blocks")
    block_stage = {block: i * stages // len(blocks) for i, block in enumerate(blocks)}
    last = stages - 1
    before: set[str] = set()              # modules that run before the first block (the embedding)
    out: list[int | None] = []
    segment, current, seen_block = None, 0, False
    for op in graph.ops:
        if op.phase is Phase.OPTIMIZER:
            out.append(None)
            continue
        if (op.phase, op.micro_batch) != segment:         # a micro-batch's forward or backward begins
            segment, current = (op.phase, op.micro_batch), 0 if op.phase is Phase.FORWARD else last
            seen_block = False
        block = block_of(op.module, blocks)
        if block:
            seen_block, current = True, block_stage[block]
        elif op.phase is Phase.FORWARD and not seen_block:
            before.add(op.module)
        elif op.phase is Phase.BACKWARD and op.module and op.module in before:
            out.append(0)
            continue
        # code between blocks (a residual sum, a gradient's accumulation) runs on the stage of the block before
        # it in its pass; after the last block (norm, head, loss) that is the last stage
        out.append(current)
    return out


def pipeline_stage_graph(graph: StepGraph, setup: PipelineSetup, rank: int) -> StepGraph:
    """`graph` as pipeline rank `rank` runs it (module docstring)."""
    stages = op_stages(graph, setup.stage_count)
    local = setup.rank_stages(rank)
    owner = _owners(graph, stages)
    kept: list[OpNode] = []
    kept_stages: list[int | None] = []
    for stage, phase, micro_batch in rank_actions(setup, rank):
        run = [op for op, s in zip(graph.ops, stages) if s == stage and op.phase is phase
               and (op.micro_batch or 1) == micro_batch]
        kept += run
        kept_stages += [stage] * len(run)
    optimizer = [narrowed for op in graph.ops if op.phase is Phase.OPTIMIZER
                 for narrowed in [_narrowed(op, owner, local)] if narrowed is not None]
    kept += optimizer
    kept_stages += [None] * len(optimizer)
    new_index = {op.index: i for i, op in enumerate(kept)}
    ops = tuple(dataclasses.replace(op, index=i) for i, op in enumerate(kept))
    outputs: list[int] = []
    last = setup.stage_count - 1
    storages = _stage_storages(graph, stages, local, last if last in local else None, ops, kept_stages, new_index,
                               setup.schedule, setup.return_outputs, outputs)
    if setup.return_outputs and outputs:
        ops, storages = _outputs_returned(ops, storages, outputs)
    note_outputs = "" if last not in local else (
        ", returning the outputs (return_outputs=True)" if setup.return_outputs else ", return_outputs=False")
    parameters = sum(math.prod(s.shape) for s in storages if s.role is StorageRole.PARAMETER and s.nbytes)
    if setup.stages_per_rank == 1:
        who = f"the rank of stage {rank + 1} of {setup.stages}"
    else:
        who = (f"rank {rank + 1} of {setup.stages}, holding stages {', '.join(str(s + 1) for s in local)} of "
               f"{setup.stage_count}")
    note = (f"pipeline parallel: {who} ({setup.schedule}, {setup.microbatches} micro-batches of batch "
            f"{graph.config.batch}) as torch.distributed.pipelining runs it{note_outputs}; {parameters:,} of "
            f"{graph.parameter_count:,} parameters")
    config = dataclasses.replace(graph.config, notes=graph.config.notes + (note,))
    loss = graph.loss_storage_id if last in local else None
    return dataclasses.replace(graph, config=config, ops=ops, storages=storages, parameter_count=parameters,
                               loss_storage_id=loss)


def _outputs_returned(ops: tuple, storages: tuple, outputs: list[int]) -> tuple[tuple, tuple]:
    """`step()` returning the last stage's outputs: the previous step's, one per micro-batch, are held until
    this step clears them as it starts (here, through its first op), and after the last backward the
    schedule concatenates this step's into the returned output (`_merge_outputs`), which a loop that does not
    keep it drops at once."""
    storages = list(storages)
    chunks = [storages[sid] for sid in outputs]
    for chunk in chunks:
        storages.append(dataclasses.replace(chunk, storage_id=len(storages), preexisting=True, persistent=False,
                                            released_after_op=0, held_until_op=None,
                                            name="an output of the previous step (step's return_outputs)"))
    first = chunks[0]
    merged_shape = (sum(c.shape[0] for c in chunks),) + tuple(first.shape[1:]) if first.shape else ()
    merged = dataclasses.replace(first, storage_id=len(storages), nbytes=sum(c.nbytes for c in chunks),
                                 shape=merged_shape, preexisting=False, persistent=False, released_after_op=None,
                                 held_until_op=None, name="the step's returned output (_merge_outputs)")
    storages.append(merged)
    at = max(op.index for op in ops if op.phase is Phase.BACKWARD) + 1
    last_backward = ops[at - 1]
    merge = OpNode(index=at, name="pipeline_merge_outputs", target="aten.cat.default", phase=Phase.BACKWARD,
                   args=(tuple(TensorValue(c.storage_id, c.shape, c.dtype) for c in chunks),), kwargs=(),
                   outputs=(TensorValue(merged.storage_id, merged.shape, merged.dtype),), source=None, module="",
                   micro_batch=last_backward.micro_batch)
    moved = tuple(dataclasses.replace(op, index=op.index + 1) for op in ops[at:])
    shifted = tuple(dataclasses.replace(s, **{key: getattr(s, key) + 1 for key in ("released_after_op", "held_until_op")
                                               if getattr(s, key) is not None and getattr(s, key) >= at})
                    for s in storages)
    return ops[:at] + (merge,) + moved, shifted


def _output_sends_held_until(ops, kept_stages, schedule: str, backward_end: dict, last_backward: int) -> dict:
    """(stage, micro-batch) -> the op through which the schedule's send of its forward output keeps the output
    alive. GPipe waits for every forward send after the last forward and keeps them to the end of its loop,
    as the interleaved runtime keeps every send; 1F1B keeps the send of its last warmup forward but one (its
    `send_work`) until the one-forward-one-backward loop ends, after the backward that follows the last
    forward."""
    if schedule != "1f1b":
        return dict.fromkeys(backward_end, last_backward)
    actions = list(dict.fromkeys((op.phase, stage, op.micro_batch or 1) for op, stage in zip(ops, kept_stages)
                                 if op.phase is not Phase.OPTIMIZER))
    warmup = next((i for i, (phase, _, _) in enumerate(actions) if phase is Phase.BACKWARD), len(actions))
    if warmup < 2:
        return {}
    last_forward = max(i for i, (phase, _, _) in enumerate(actions) if phase is Phase.FORWARD)
    loop_end = next(((s, m) for phase, s, m in actions[last_forward + 1:] if phase is Phase.BACKWARD), None)
    _, stage, held = actions[warmup - 2]
    return {(stage, held): backward_end[loop_end]} if loop_end is not None else {}


def _owners(graph: StepGraph, stages: list[int | None]) -> dict[int, int]:
    """The stage each parameter, gradient and optimizer-state storage belongs to: a parameter to the stage
    that first reads it, a gradient to the stage that makes it, optimizer state to its parameter's (by the
    name the capture gives it), and what the optimizer makes to the stage of the parameter, gradient or
    state beside it in the same op (position by position in a foreach op's lists)."""
    owner: dict[int, int] = {}
    for op, stage in zip(graph.ops, stages):
        if stage is None:
            continue
        for value in op.input_values():
            if graph.storage(value.storage_id).role is StorageRole.PARAMETER:
                owner.setdefault(value.storage_id, stage)
        for value in op.outputs:
            if graph.storage(value.storage_id).role is StorageRole.GRADIENT:
                owner.setdefault(value.storage_id, stage)
    by_name = {graph.storage(sid).name: stage for sid, stage in owner.items()
               if graph.storage(sid).role is StorageRole.PARAMETER and graph.storage(sid).name}
    for storage in graph.storages:        # state named after its parameter ("layers.0.up.weight.exp_avg")
        if storage.role is StorageRole.OPTIMIZER_STATE and "." in storage.name:
            parameter = storage.name.rsplit(".", 1)[0]
            if parameter in by_name:
                owner.setdefault(storage.storage_id, by_name[parameter])
    optimizer_ops = [op for op in graph.ops if op.phase is Phase.OPTIMIZER]
    for _ in range(3):                    # state read beside a parameter, then what is made from the state
        for op in optimizer_ops:
            for group in _positions(op):
                known = {owner[v.storage_id] for v in group if v.storage_id in owner}
                if len(known) == 1:
                    for value in group:
                        owner.setdefault(value.storage_id, next(iter(known)))
    return owner


def _positions(op: OpNode) -> list[tuple[TensorValue, ...]]:
    """The values of `op` that belong together: position i of every list argument and of the outputs for a
    foreach op (lists of one length), else all of its values."""
    lists = [a for a in op.args if isinstance(a, tuple) and a and all(isinstance(v, TensorValue) for v in a)]
    if lists and all(len(a) == len(lists[0]) for a in lists):
        outputs = op.outputs if len(op.outputs) == len(lists[0]) else ()
        scalars = tuple(a for a in op.args if isinstance(a, TensorValue))
        return [tuple(a[i] for a in lists) + ((outputs[i],) if outputs else ()) + scalars
                for i in range(len(lists[0]))]
    return [tuple(op.input_values()) + tuple(op.outputs)]


def _narrowed(op: OpNode, owner: dict[int, int], local: tuple[int, ...]) -> OpNode | None:
    """The optimizer op as the rank of stages `local` runs it: only its own elements of a foreach op's lists;
    None when it touches nothing of theirs."""
    groups = _positions(op)
    mine = [i for i, group in enumerate(groups) if any(owner.get(v.storage_id) in local for v in group)]
    if not mine:
        return None
    lists = [a for a in op.args if isinstance(a, tuple) and a and all(isinstance(v, TensorValue) for v in a)]
    if len(groups) == 1 or not lists:
        return op
    args = tuple(tuple(a[i] for i in mine) if any(a is l for l in lists) else a for a in op.args)
    outputs = tuple(op.outputs[i] for i in mine) if len(op.outputs) == len(groups) else op.outputs
    return dataclasses.replace(op, args=args, outputs=outputs)


def _stage_storages(graph: StepGraph, stages, local: tuple[int, ...], last: int | None, ops, kept_stages,
                    new_index: dict[int, int], schedule: str, return_outputs: bool, outputs: list):
    """The storages as the rank of stages `local` holds them (`last`: the model's last stage where the rank
    holds it): the other ranks' take no memory; received buffers exist before the step and stay; what the
    runtime holds is held (module docstring); op indices moved."""
    used = {v.storage_id for op in ops for v in (*op.outputs, *op.input_values())}
    producer: dict[int, int] = {}
    readers: dict[int, set] = {}
    read_by_root_forward: set[int] = set()         # what the loss function (code outside any module) reads
    for op, s in zip(graph.ops, stages):
        for value in op.outputs:
            producer.setdefault(value.storage_id, op.index)
        for value in op.input_values():
            readers.setdefault(value.storage_id, set()).add((op.phase, s))
            if op.phase is Phase.FORWARD and not op.module:
                read_by_root_forward.add(value.storage_id)
    backward_end: dict[tuple[int, int], int] = {}        # (stage, micro-batch) -> its backward's last op
    for i, (op, s) in enumerate(zip(ops, kept_stages)):
        if op.phase is Phase.BACKWARD:
            backward_end[(s, op.micro_batch or 1)] = i
    old_kept = sorted(new_index)
    order = [key for key, _ in sorted(backward_end.items(), key=lambda item: item[1])]
    last_backward = max(backward_end.values(), default=len(ops) - 1)
    send_held_until = {key: (backward_end[order[i + 1]] if schedule == "1f1b" and i + 1 < len(order) else last_backward)
                       for i, key in enumerate(order)}
    output_send_held_until = _output_sends_held_until(ops, kept_stages, schedule, backward_end, last_backward)

    def moved(old: int | None) -> int | None:
        if old is None:
            return None
        at = bisect.bisect_right(old_kept, old) - 1
        return new_index[old_kept[at]] if at >= 0 else 0

    out = []
    for storage in graph.storages:
        sid = storage.storage_id
        if sid not in used:
            out.append(dataclasses.replace(storage, nbytes=0, preexisting=False, persistent=False,
                                           released_after_op=None, held_until_op=None))
            continue
        fields = dict(released_after_op=moved(storage.released_after_op), held_until_op=moved(storage.held_until_op))
        made_by = producer.get(sid)
        made_by_stage = stages[made_by] if made_by is not None else None
        made_op = graph.ops[made_by] if made_by is not None else None
        key = (made_by_stage, made_op.micro_batch or 1) if made_op is not None else None
        read_by = readers.get(sid, set())
        if made_by is not None and made_by_stage is not None and made_by_stage not in local:
            # received from a neighbour: a buffer of its own for every micro-batch, made once, kept across steps
            fields.update(preexisting=True, persistent=True, released_after_op=None, held_until_op=None)
        elif made_by_stage is not None and made_by_stage == last and made_op.phase is Phase.FORWARD \
                and made_op.module and sid in read_by_root_forward:
            # the last stage's output, read by the schedule's loss function: kept for its backward, or with
            # return_outputs in `output_chunks` until the next step clears them
            outputs.append(sid)
            if return_outputs:
                fields.update(persistent=True, released_after_op=None)
            else:
                fields.update(held_until_op=max(fields["held_until_op"] or 0, backward_end.get(key, 0)))
        elif made_by_stage is not None and any(s not in (made_by_stage, None) for _, s in read_by):
            if made_op.phase is Phase.BACKWARD:
                # the gradient of a received input: the send that hands it on holds it until the schedule
                # replaces that send, after the stage's next backward (1F1B), or until the schedule ends
                until = send_held_until.get(key, len(ops) - 1)
                fields.update(held_until_op=max(fields["held_until_op"] or 0, until))
            else:
                # the stage's output: kept for its backward, and as long as the send that hands it on lives
                until = max(backward_end.get(key, 0), output_send_held_until.get(key, 0))
                fields.update(held_until_op=max(fields["held_until_op"] or 0, until))
        out.append(dataclasses.replace(storage, **fields))
    return tuple(out)
