"""Tensors the training loop holds besides the model's own: what a model file declares about its loop.

    extra_resident_bytes = 2 * 1024**3          bytes resident on the device for the whole step that the model
    def extra_resident_bytes(batch, seq): ...   does not show: a frozen reference model (RLHF, distillation),
                                                a second model, a cache; an int or a function of the sizes
    keep_outputs = ("logits",)                  forward outputs the loop keeps until the end of the step
                                                (logged logits): mapping keys or attribute names, or positions
                                                in a returned tuple (`keep_outputs = (0,)` for nanoGPT)
    def keep_alive(outputs): return outputs.logits    the same as a function: the tensors to keep
    retain_graph = True                         the loop calls loss.backward(retain_graph=True): every tensor
                                                saved for backward stays until the end of the step

The step ends after the optimizer step and zero_grad; a kept tensor (and, with retain_graph, the graph the
loss holds) is dropped then, as a loop does that rebinds or deletes it before its next forward. The report's
bill shows the extra bytes and the kept outputs as `caller_held`.

How a kept output is found in the captured step: one more fake forward run of the model (`observe_kept_outputs`)
records, for each kept tensor, the user line of the op that made its storage, its bytes and dtype; the
step's storage is the output of the last forward op on that line with those bytes and dtype
(`find_kept_storages`), the rule tensors kept on module attributes follow. A kept output that no op matches
is a note, never a silent zero.

A forward that returns a tuple or list (nanoGPT's `logits, loss = model(X, Y)`) with no declaration: the loop
keeps every output but the loss, as that assignment binds them (`outputs_besides`); a mapping or a model
output object is dropped as the loss is taken (`loss = model(**batch).loss`, the Hugging Face Trainer).
`keep_outputs = ()` declares a loop that keeps nothing. In a steady step the previous step's kept outputs
are still bound while this step's forward runs (the loop rebinds its variables when forward returns):
each has a copy from the start of the step to the forward's last op.

A loop that zeroes the gradients after the forward, before backward (Lightning's closure:
tracer/capture/lightning_loop.py), holds the previous step's gradients through the forward and lets this
step's outlive it (`hold_previous_gradients`); a loop that takes one batch at a time under accumulation holds
each micro-batch's inputs from its turn to the next one's (`inputs_at_their_turn`).

Not modelled: with accumulation, the kept outputs of micro-batches before the last (each lives until the
next micro-batch's forward returns), and tensors the loop makes itself outside forward.
"""
from __future__ import annotations

import dataclasses

from tracer.capture.convert import input_values
from tracer.stepgraph import Phase, StorageRole


@dataclasses.dataclass(frozen=True)
class KeptOutput:
    """A forward output the loop keeps: the user line that made its storage, its bytes and dtype."""
    label: str                        # how the model file named it ("logits", "output 0", "keep_alive 0")
    file: str | None
    line: int | None
    nbytes: int
    dtype: str
    shape: tuple[int, ...] = ()
    declared: bool = True             # False: kept by the default loop (`logits, loss = model(x, y)`)
    loop: str = ""                    # with declared=False: the loop that keeps it, when not that default


def observe_kept_outputs(source, options, *, declared: bool = True, loop: str = "") -> tuple[KeptOutput, ...]:
    """One fake forward of the model, recording the line, bytes and dtype of each tensor `source.keep`
    picks from its outputs (`declared`: the model file named them, else the default loop keeps them)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer.capture.build import StepModule
    from tracer.capture.joint import _ProducerLines, build_fake
    from tracer.capture.precision import autocast_context

    fake_mode = FakeTensorMode()
    built = build_fake(source, options.batch, options.seq, options.precision, fake_mode)
    step = StepModule(built.model, batch_keys=built.batch_keys, loss_fn=source.loss_fn,
                      loss_index=source.loss_index, keep=source.keep)
    lines = _ProducerLines()
    with fake_mode, lines, autocast_context(options.precision):
        step(*built.batch)
    out = []
    for label, t in step.kept:
        storage = t.untyped_storage()
        loc = lines.lines.get(storage._cdata)
        out.append(KeptOutput(label=label, file=loc.file if loc else None, line=loc.line if loc else None,
                              nbytes=storage.nbytes(), dtype=str(t.dtype).removeprefix("torch."),
                              shape=tuple(int(d) for d in t.shape), declared=declared, loop=loop))
    return tuple(out)


def outputs_besides(loss_position: int | None, loss_index: int | None = None):
    """The default loop's keep function for a forward that returns a tuple or list: every tensor but the
    loss, as `logits, loss = model(X, Y)` binds them. `loss_position` None: the loss is found in each
    output as the step takes it (the model file's `loss_index`, else the only 0-dim floating tensor)."""
    import torch

    from tracer.capture.build import sequence_loss_position

    def keep(out):
        if not isinstance(out, (tuple, list)):
            return ()
        position = loss_position if loss_position is not None else sequence_loss_position(out, loss_index)
        return tuple((f"output {i}", t) for i, t in enumerate(out)
                     if i != position and isinstance(t, torch.Tensor))
    return keep


def find_kept_storages(ops, table, kept: tuple[KeptOutput, ...]) -> tuple[dict[int, str], list[str]]:
    """{storage id: label} of the kept outputs among `ops` (captured ops in step order: the last forward op
    on the kept tensor's line with an output of its bytes and dtype), and a note for each one not found."""
    found, missing = {}, []
    for k in kept:
        sid = None
        for d in ops:
            if d.phase is not Phase.FORWARD or d.source is None or (d.source.file, d.source.line) != (k.file, k.line):
                continue
            sid = next((v.storage_id for v in d.outputs
                        if v.dtype == k.dtype and table.get(v.storage_id).nbytes == k.nbytes), sid)
        if sid is None:
            missing.append(f"the loop keeps {k.label} ({k.nbytes:,} B), but no op of the captured step made it "
                           f"({k.file}:{k.line}): it is not held")
        else:
            found[sid] = k.label
    return found, missing


def hold_caller_tensors(ops, table, *, kept: tuple[KeptOutput, ...], extra_resident_bytes: int,
                        retain_graph: bool, steady: bool = False, accumulate: int = 1) -> list[str]:
    """Mark what the loop holds on the step's storages (before they are frozen); returns the notes.
    `steady`: the previous step's kept outputs are still bound to the loop's variables while this step's
    forward runs (a loop rebinds them when the forward returns), so each has a copy held from the start of
    the step until the forward's last op."""
    last = len(ops) - 1
    notes = []
    found, missing = find_kept_storages(ops, table, kept)
    by_label = {k.label: k for k in kept}
    forward_end = max((i for i, d in enumerate(ops) if d.phase is Phase.FORWARD), default=-1)
    for sid, label in found.items():
        entry = table.get(sid)
        _hold_to_the_end(table, sid, last)
        table.update(sid, caller_held=True)
        if steady and forward_end >= 0:
            table.add(None, StorageRole.INTERMEDIATE, nbytes=entry.nbytes, dtype=entry.dtype,
                      shape=by_label[label].shape or entry.shape, preexisting=True, caller_held=True,
                      name=f"{label} of the previous step (the loop's variable)", released_after_op=forward_end)
    notes += missing
    if found:
        declared = all(by_label[label].declared for label in found.values())
        loops = {by_label[label].loop for label in found.values()} - {""}
        how = ("the model file's keep_outputs / keep_alive" if declared else ", ".join(sorted(loops)) if loops else
               "as `logits, loss = model(x, y)` binds a returned tuple; keep_outputs = () in the model file "
               "if the loop drops them")
        previous = ("; the previous step's are held until this step's forward returns (the loop rebinds its "
                    "variables then)" if steady else "")
        notes.append(f"the loop keeps {', '.join(found.values())} until the end of the step ({how}){previous}"
                     + (f"; with {accumulate} micro-batches, the last one's" if accumulate > 1 else ""))
    if extra_resident_bytes:
        table.add(None, StorageRole.INTERMEDIATE, nbytes=extra_resident_bytes, dtype="uint8",
                  shape=(extra_resident_bytes,), preexisting=True, persistent=True, caller_held=True,
                  name="extra_resident_bytes (model file)")
        notes.append(f"the loop holds {extra_resident_bytes:,} B besides the model for the whole step "
                     "(extra_resident_bytes)")
    if retain_graph:
        made_in_forward = {v.storage_id for d in ops if d.phase is Phase.FORWARD for v in d.outputs}
        saved = {v.storage_id for d in ops if d.phase is Phase.BACKWARD
                 for v in input_values(d) if v.storage_id in made_in_forward}
        for sid in saved:
            if table.get(sid).role is StorageRole.INTERMEDIATE:
                _hold_to_the_end(table, sid, last)
        notes.append("loss.backward(retain_graph=True): every tensor saved for backward is held until the end of "
                     "the step (retain_graph)")
    return notes


def _hold_to_the_end(table, sid: int, last: int) -> None:
    """Storage `sid` is held through op `last`: a release the step observed (run op by op) moves there, a
    captured graph's storage is held until it."""
    entry = table.get(sid)
    if entry.released_after_op is not None:
        table.update(sid, released_after_op=max(entry.released_after_op, last))
    else:
        table.hold_until(sid, last)


def inputs_at_their_turn(ops, table) -> None:
    """Under accumulation, each micro-batch's inputs as a loop that takes one batch at a time holds them:
    from their first use (not before the step) from micro-batch 2 on, and until the micro-batch's last op,
    when the loop binds the next batch; the last micro-batch's outlive the step."""
    last_of = {}
    first_of: dict[int, int] = {}
    for i, op in enumerate(ops):
        if op.micro_batch is not None:
            last_of[op.micro_batch] = i
            for value in (*op.outputs, *input_values(op)):
                first_of.setdefault(value.storage_id, op.micro_batch)
    if len(last_of) < 2:
        return
    final = max(last_of)
    for sid, micro_batch in first_of.items():
        entry = table.get(sid)
        if entry.role is not StorageRole.INPUT or not entry.preexisting:
            continue
        table.update(sid, preexisting=micro_batch == 1, persistent=micro_batch == final,
                     released_after_op=None if micro_batch == final else last_of[micro_batch])


def hold_previous_gradients(ops, table, *, steady: bool) -> tuple[str, ...]:
    """Lightning's order on the step's storages (before they are frozen): the gradients zero_grad released at
    the end of the step outlive it, and in a steady step the previous step's, of the same sizes, are held
    from the start of the step to the end of the first micro-batch's forward. Returns the report's note."""
    forward_end = max((i for i, d in enumerate(ops) if d.phase is Phase.FORWARD and d.micro_batch in (None, 1)),
                      default=-1)
    released = [sid for sid in range(len(table)) if table.get(sid).role is StorageRole.GRADIENT
                and not table.get(sid).preexisting and table.get(sid).released_after_op is not None
                and ops[table.get(sid).released_after_op].phase is Phase.OPTIMIZER]
    for sid in released:
        entry = table.get(sid)
        table.update(sid, released_after_op=None, persistent=True)
        if steady and forward_end >= 0:
            table.add(None, StorageRole.GRADIENT, nbytes=entry.nbytes, dtype=entry.dtype, shape=entry.shape,
                      preexisting=True, released_after_op=forward_end,
                      name=f"{entry.name or f'gradient {sid}'} of the previous step")
    held = sum(table.get(sid).nbytes for sid in released)
    return (f"Lightning's loop (training_step of the LightningModule): zero_grad runs after the forward, before "
            f"backward, so the previous step's gradients ({held:,} B) are held through the forward"
            + ("" if steady else " (none in a first step)") + " and this step's outlive it",)
