"""Capture one training step (forward, loss, backward, optimizer step, zero_grad) as a `StepGraph`.

This package is the only code that touches torch.export, fx and fake tensors. `capture_step` builds the
model under FakeTensorMode (no real memory), exports it, takes the joint forward+backward graph,
converts it to ops over storages, then records the optimizer step on fake tensors.
"""
from __future__ import annotations

import dataclasses

from tracer.capture.convert import OpDraft, Schedule, convert_step
from tracer.capture.joint import export_joint
from tracer.capture.model_input import ModelSource, load_model_source
from tracer.capture.pylocals import local_holds
from tracer.capture.optimizer import OPTIMIZERS, capture_optimizer_step
from tracer.capture.storages import StorageTable
from tracer.stepgraph import OpNode, Phase, StepConfig, StepGraph

PRECISIONS = ("fp32", "bf16", "bf16-pure")
__all__ = ["CaptureOptions", "capture_step", "load_model_source", "ModelSource", "OPTIMIZERS", "PRECISIONS"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    batch: int = 2
    seq: int = 1024
    precision: str = "fp32"          # fp32 | bf16 (autocast around forward+loss) | bf16-pure (bf16 params)
    optimizer: str = "adamw"         # used when the model file defines no make_optimizer
    foreach: bool = True
    step: str = "steady"             # steady (optimizer state exists) | first (state created lazily)
    zero_grad_set_to_none: bool = True


def capture_step(source: ModelSource, options: CaptureOptions) -> StepGraph:
    cap = export_joint(source, options.batch, options.seq, options.precision)
    try:
        table = StorageTable()
        steady = options.step == "steady"
        grads_preexisting = steady and not options.zero_grad_set_to_none
        part = convert_step(cap, table, Schedule(joint=cap.joint), grads_preexisting=grads_preexisting)
        opt_ops = capture_optimizer_step(
            cap.model, part.grad_sid_by_param, table, cap.fake_mode,
            make_optimizer=source.make_optimizer, optimizer_name=options.optimizer, foreach=options.foreach,
            steady=steady, set_to_none=options.zero_grad_set_to_none, grads_preexisting=grads_preexisting,
            ops_offset=len(part.ops))
        last_backward = max((i for i, d in enumerate(part.ops) if d.phase is Phase.BACKWARD), default=None)
        if last_backward is not None:
            # torch.autograd.backward holds the seed gradient (ones_like(loss)) until backward returns
            table.update(part.seed_sid, released_after_op=last_backward)
        forward = [(i, d.frames, tuple(v.storage_id for v in d.outputs))
                   for i, d in enumerate(part.ops) if d.phase is Phase.FORWARD and d.frames]
        for sid, op_index in local_holds(forward).items():
            table.update(sid, held_until_op=op_index)
        ops = tuple(_freeze(i, d) for i, d in enumerate(part.ops + opt_ops))
        config = StepConfig(model=source.name, batch=options.batch, seq=options.seq, precision=options.precision,
                            optimizer="custom" if source.make_optimizer else options.optimizer, step=options.step,
                            zero_grad_set_to_none=options.zero_grad_set_to_none, capture_path="export-joint")
        n_params = sum(p.numel() for p in cap.model.parameters())
        return StepGraph(config=config, ops=ops, storages=table.freeze(), parameter_count=n_params,
                         loss_storage_id=part.loss_sid)
    finally:
        cap.exit_stack.close()


def _freeze(index: int, d: OpDraft) -> OpNode:
    return OpNode(index=index, name=d.name, target=d.target, phase=d.phase, args=d.args, kwargs=d.kwargs,
                  outputs=d.outputs, source=d.source, module=d.module, is_view=d.is_view,
                  autograd_node=d.seq_nr if d.phase is Phase.BACKWARD else None)
