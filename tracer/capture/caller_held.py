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

Not modelled: a loop that keeps the tensors into the next step's forward (the previous step's copy would
be live while the new forward runs), and tensors the loop makes itself outside forward.
"""
from __future__ import annotations

import dataclasses

from tracer.stepgraph import Phase


@dataclasses.dataclass(frozen=True)
class KeptOutput:
    """A forward output the loop keeps: the user line that made its storage, its bytes and dtype."""
    label: str                        # how the model file named it ("logits", "output 0", "keep_alive 0")
    file: str | None
    line: int | None
    nbytes: int
    dtype: str


def observe_kept_outputs(source, options) -> tuple[KeptOutput, ...]:
    """One fake forward of the model, recording the line, bytes and dtype of each tensor `source.keep`
    picks from its outputs."""
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
                              nbytes=storage.nbytes(), dtype=str(t.dtype).removeprefix("torch.")))
    return tuple(out)


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
                        retain_graph: bool) -> list[str]:
    """Mark what the loop holds on the step's storages (before they are frozen); returns the notes."""
    from tracer.capture.convert import input_values
    from tracer.stepgraph import StorageRole

    last = len(ops) - 1
    notes = []
    found, missing = find_kept_storages(ops, table, kept)
    for sid, label in found.items():
        table.update(sid, held_until_op=last, caller_held=True)
    notes += missing
    if found:
        notes.append(f"the loop keeps {', '.join(found.values())} until the end of the step (the model file's "
                     "keep_outputs / keep_alive), not dropped as the loss is taken")
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
                table.hold_until(sid, last)
        notes.append("loss.backward(retain_graph=True): every tensor saved for backward is held until the end of "
                     "the step (retain_graph)")
    return notes

