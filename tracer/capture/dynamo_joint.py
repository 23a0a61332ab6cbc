"""Take the joint forward+backward ATen graph through torch.compile (dynamo + AOTAutograd), under fake tensors.

The capture ladder's rung after strict export, for models torch.export rejects: torch.compile with
AOTAutograd as its backend (`torch._dynamo.backends.common.aot_autograd`), which gives the same joint graph
with the user's lines on the models both can trace. Path: build model and batch under `FakeTensorMode` (`build_fake`) -> `torch.compile(fullgraph=True,
dynamic=False)` with an AOTAutograd backend whose `partition_fn` records the joint graph -> one call on the
fake batch (under `torch.autocast("cpu", bfloat16)` for bf16; under `cuda_capture` for a cuda target, which
gives the same ops as the export rung on llama-debug). Only the forward graph runs, on fake tensors; the
backward is never compiled or run.

Contract: returns the same `JointCapture` as `export_joint` (`path` "compile-joint"), with the same node
meta (`partitioner_tag`, `stack_trace`, `nn_module_stack` / `fwd_nn_module_stack`, `seq_nr`, `val`) and
the same descriptors:
  * the backend traces in the build fake mode (it swaps the TracingContext's fake mode while AOTAutograd
    runs), so the joint's `val`s, the model's parameters and the optimizer recording share one fake mode;
  * AOTAutograd sees dynamo's graph inputs, all `PlainAOTInput(idx)`. Dynamo passes the model's own
    parameter and buffer tensors as those inputs, so tensor identity maps each one to
    `ParamAOTInput(fqn)` / `BufferAOTInput(fqn)` (a tied tensor: its first name in
    `named_parameters(remove_duplicate=False)`); other inputs stay `PlainAOTInput`, numbered in graph
    order. Output descriptors (`GradAOTOutput(grad_of=...)`, mutations, tangents) are rewritten through
    the same map, so gradients are matched to parameters by descriptor, never by position;
  * dynamo returns the loss first, then tensors its side effects need (`self.cache = h`); those are
    detached before AOTAutograd, so only the loss is differentiated, as by eager `loss.backward()` (a graph
    whose first output is no scalar loss is refused). The model's tensor attributes are restored after
    the call; the fake forward's observations report kept attributes, as for export;
  * dynamo's own checkpoint tags (`recompute`, `ac_graph_id`) are dropped: the policies re-apply the
    checkpointing the fake forward observed, as they do for export (which drops it).

Limits: a graph break is an error (fullgraph), as is any Python dynamo cannot trace; dynamo's caches are
reset before and after the capture (`torch._dynamo.reset()`), which also drops code compiled earlier in
the calling process; a model that both checkpoints with a context_fn and needs this rung is simulated as
the policies say (full checkpointing), not as dynamo's selective tags would.
"""
from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from torch import nn

from tracer.capture.build import step_module
from tracer.capture.precision import autocast_context
from tracer.capture.joint import (JointCapture, _export_message, _observe_forward, AttributeSnapshot,
                                  build_fake)
from tracer.capture.model_input import ModelSource
from tracer.errors import CaptureError

CAPTURE_PATH = "compile-joint"


@dataclasses.dataclass
@dataclasses.dataclass
class _Recorded:
    """What the backend saw: dynamo's graph inputs and AOTAutograd's joint graph."""
    inputs: list = dataclasses.field(default_factory=list)
    joint: torch.fx.GraphModule | None = None


def dynamo_joint(source: ModelSource, batch: int, seq: int, precision: str, *,
                 target: str = "cpu") -> JointCapture:
    """Raises CaptureError (with `next_rung_may_work` set: the forward ran on fake tensors, dynamo could not
    trace it) naming the model and the user's line; ModelRunError when the forward itself fails."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer.capture.target import parse_target
    device = parse_target(target)
    fake_mode = FakeTensorMode()
    built = build_fake(source, batch, seq, precision, fake_mode)
    model, args = built.model, built.batch
    traced = step_module(built, source, precision)
    seen = _observe_forward(traced, args, fake_mode, source)
    recorded = _compile_once(traced, args, fake_mode, precision, device, source)
    params = dict(traced.named_parameters(remove_duplicate=False))
    buffers = dict(traced.named_buffers(remove_duplicate=False))
    _describe_inputs(recorded, params, buffers)
    _drop_checkpoint_tags(recorded.joint)
    return JointCapture(path=CAPTURE_PATH, joint=recorded.joint, model=model, batch=args, fake_mode=fake_mode,
                        param_by_fqn=params, buffer_by_fqn=buffers, exit_stack=contextlib.ExitStack(), seen=seen,
                        build_notes=built.notes + traced.notes(), loss_position=traced.loss_position)


def _compile_once(traced: nn.Module, args: tuple, fake_mode, precision: str, device, source: ModelSource) -> _Recorded:
    """One fresh torch.compile call on the fake batch; returns what the backend recorded. `device`: a
    `Target`; for cuda, `cuda_capture` picks CUDA's SDPA op and autocast lists while AOTAutograd traces."""
    from tracer.capture.eager_kernels import kernels_as_in_eager
    from tracer.capture.target import cuda_capture
    recorded = _Recorded()
    autocast = autocast_context(precision)
    compiled = torch.compile(traced, fullgraph=True, dynamic=False, backend=_backend(recorded, fake_mode))
    torch._dynamo.reset()                     # a cached graph of an earlier capture would skip the backend
    try:
        with torch._functorch.config.patch(enable_autograd_cache=False), _attributes_restored(traced), \
                cuda_capture(device, precision), fake_mode, autocast, kernels_as_in_eager(cpu=not device.is_cuda):
            compiled(*args)
    except Exception as exc:
        raise CaptureError(f"torch.compile (fullgraph) failed on {source.name}: {_compile_message(exc)}",
                           hint="see --verbose; graph breaks, data-dependent Python control flow and .item() "
                                "cannot be captured", next_rung_may_work=True) from exc
    finally:
        torch._dynamo.reset()                 # drop compiled code that holds the fake model
    if recorded.joint is None:
        raise CaptureError(f"torch.compile of {source.name} produced no joint forward+backward graph",
                           hint="the loss must require grad: does any parameter reach it?")
    if not _first_output_is_a_loss(recorded.joint):
        raise CaptureError(f"torch.compile's graph of {source.name} does not return the loss first",
                           hint="dynamo put a side effect's tensor before the loss; use torch.export instead")
    return recorded


@contextlib.contextmanager
def _attributes_restored(module: nn.Module):
    """The compiled call replays the forward's `self.cache = h`: leave the model's attributes as they were."""
    before = AttributeSnapshot(module)
    try:
        yield
    finally:
        before.restore()


def _first_output_is_a_loss(joint: torch.fx.GraphModule) -> bool:
    """`_detach_side_outputs` keeps dynamo's first output differentiable: it must be the scalar loss."""
    from torch._functorch._aot_autograd.descriptors import PlainAOTOutput

    output = next(iter(joint.graph.find_nodes(op="output")))
    for node, desc in zip(output.args[0], output.meta["desc"]):
        if desc == PlainAOTOutput(idx=0):
            val = node.meta.get("val")
            return isinstance(val, torch.Tensor) and val.dim() == 0 and val.is_floating_point()
    return False


def _backend(recorded: _Recorded, fake_mode):
    """A dynamo backend: AOTAutograd in the build fake mode, recording the joint graph it partitions."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.aot_autograd import make_boxed_func
    from torch._functorch.partitioners import default_partition
    from torch._guards import TracingContext

    def keep_graph(gm, example_inputs):
        return make_boxed_func(gm)

    def partition(joint, joint_inputs, **kwargs):
        recorded.joint = joint
        return default_partition(copy.deepcopy(joint), joint_inputs, **kwargs)   # partitioners touch meta

    aot = aot_autograd(fw_compiler=keep_graph, bw_compiler=keep_graph, partition_fn=partition)

    def backend(gm, example_inputs):
        recorded.inputs = list(example_inputs)
        _detach_side_outputs(gm)
        context = TracingContext.get()
        dynamo_mode, context.fake_mode = context.fake_mode, fake_mode
        try:
            return aot(gm, example_inputs)
        finally:
            context.fake_mode = dynamo_mode      # dynamo's guards read its own mode's shape env

    return backend


def _detach_side_outputs(gm: torch.fx.GraphModule) -> None:
    """Dynamo's graph returns the loss, then the tensors its side effects need (`self.cache = h`). Eager's
    loss.backward() never differentiates those; detached, they get no tangent and no backward ops."""
    output = next(iter(gm.graph.find_nodes(op="output")))
    values = list(output.args[0])
    with gm.graph.inserting_before(output):
        for i, value in enumerate(values[1:], start=1):
            if isinstance(value, torch.fx.Node):
                values[i] = gm.graph.call_function(torch.detach, (value,))
    output.args = (tuple(values),)
    gm.recompile()


def _describe_inputs(recorded: _Recorded, params: dict, buffers: dict) -> None:
    """Rewrite the joint's descriptors as aot_export_joint_with_descriptors would write them."""
    from torch._functorch._aot_autograd.descriptors import BufferAOTInput, ParamAOTInput, PlainAOTInput

    fqn_by_id: dict[int, tuple[type, str]] = {}
    for kind, named in ((BufferAOTInput, buffers), (ParamAOTInput, params)):
        for fqn, tensor in reversed(list(named.items())):    # a tied tensor keeps its first name
            fqn_by_id[id(tensor)] = (kind, fqn)
    renamed = {}
    batch_index = 0
    for node in recorded.joint.graph.find_nodes(op="placeholder"):
        desc = node.meta.get("desc")
        if not isinstance(desc, PlainAOTInput):
            continue
        owner = fqn_by_id.get(id(recorded.inputs[desc.idx]))
        if owner is None:
            renamed[desc], batch_index = PlainAOTInput(idx=batch_index), batch_index + 1
        else:
            renamed[desc] = owner[0](target=owner[1])
    for node in recorded.joint.graph.find_nodes(op="placeholder"):
        node.meta["desc"] = _renamed(node.meta.get("desc"), renamed)
    output = next(iter(recorded.joint.graph.find_nodes(op="output")))
    output.meta["desc"] = [_renamed(d, renamed) for d in output.meta["desc"]]


def _drop_checkpoint_tags(joint: torch.fx.GraphModule) -> None:
    """Dynamo tags torch.utils.checkpoint regions itself (`recompute`, `ac_graph_id`); the policies tag the
    regions the fake forward observed, as for export, so dynamo's tags would only collide with theirs."""
    for node in joint.graph.nodes:
        node.meta.pop("recompute", None)
        node.meta.pop("ac_graph_id", None)


def _renamed(desc, renamed: dict):
    """`desc` with every input descriptor inside it (grad_of, mutated_input, ...) replaced per `renamed`."""
    if desc in renamed:
        return renamed[desc]
    if not dataclasses.is_dataclass(desc):
        return desc
    fields = {f.name: _renamed(getattr(desc, f.name), renamed) for f in dataclasses.fields(desc)}
    return dataclasses.replace(desc, **fields)


def _compile_message(exc: BaseException) -> str:
    """Dynamo's own message names the user's frame ("from user code: File ..."); keep its first line."""
    inner = getattr(exc, "inner_exception", None)      # BackendCompilerFailed wraps the backend's error
    return _export_message(inner if inner is not None else exc)
