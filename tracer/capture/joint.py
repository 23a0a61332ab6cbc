"""Export the model and take its joint forward+backward ATen graph, all under fake tensors.

Path: build model and batch under `FakeTensorMode` on CPU (never `meta`,
never fake cuda) -> `torch.export.export(strict=False)` -> strip `_assert_tensor_metadata` nodes ->
`aot_export_joint_with_descriptors` on `ep.module()`, under `torch.autocast("cpu", bfloat16)` for bf16.
Nodes then carry `partitioner_tag`, `stack_trace`, `nn_module_stack` / `fwd_nn_module_stack`, and
placeholders/outputs carry AOT descriptors. Export drops two things that a fake run of the forward shows, so one is made first
(`ForwardObservations`): torch.utils.checkpoint calls (how each was written; export then tags each
call's nodes with an fx annotation and policies re-apply the checkpointing to the graph) and tensors
stored on module attributes (kept alive past the step). Data-dependent control flow
fails with a clear error naming the line.

A forward that replaces a registered buffer (a placeholder its first call fills) is, for a steady step,
traced again after one plain fake forward, so the step starts from the filled buffer as a steady step
does. Not modelled: in a first step (`--step first`), the replacing buffer is an intermediate of the
traced forward and the placeholder stays to the step's end (eager keeps the new buffer and drops the old).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import linecache
import warnings
import weakref
from typing import Any

import torch
from torch import nn

from tracer.capture.build import step_module
from tracer.capture.inplace import formula_writes_marked, is_inplace_call
from tracer.capture.meta import CHECKPOINT_KEY, FRAME_HELD_KEY, INPLACE_CALL_KEY, MODULE_CALL_ENTRIES, PARTIAL_HELD_KEY
from tracer.capture.python_lifetimes import PythonLifetimes, resolve_deaths, resolve_packs
from tracer.capture.model_input import ModelSource
from tracer.capture.precision import autocast_context
from tracer.capture.pylocals import ExecutedLines, UntracedCall, record_executed_lines
from tracer.capture.source import exception_location, loc_from_stack_trace, normalize_module_path
from tracer.errors import CaptureError, ModelRunError


@dataclasses.dataclass
class JointCapture:
    """Live torch objects of one capture; only `tracer.capture` ever sees this."""
    joint: torch.fx.GraphModule
    model: nn.Module                      # the user's model, with fake parameters
    batch: tuple                          # fake example batch
    fake_mode: Any
    param_by_fqn: dict[str, torch.Tensor]
    buffer_by_fqn: dict[str, torch.Tensor]
    exit_stack: contextlib.ExitStack
    seen: "ForwardObservations"
    path: str = "export-joint"            # the capture path, as the report names it
    fallback_notes: tuple[str, ...] = ()  # why the earlier rungs of the capture ladder failed
    build_notes: tuple[str, ...] = ()     # assumptions of the build and of how the loss is handed over
    loss_position: int | None = None      # forward returned a tuple or list: the loss's position in it
    python_backward_nodes: frozenset[int] = frozenset()   # seq_nrs of custom autograd Functions' nodes
    executed_lines: ExecutedLines = dataclasses.field(default_factory=ExecutedLines)   # model lines the trace ran
    # the forward's Python objects, observed dying (python_lifetimes.py); None: not observed on this path
    python_deaths: tuple | None = None
    forward_leaves: tuple = ()            # forward_leaves.ForwardLeaf: leaves the forward makes, lifted as inputs
    # every save autograd made in the forward (python_lifetimes.ResolvedPack); None: not observed on this path
    saved_packs: tuple | None = None
    foreign_saved_hooks: tuple[str, ...] = ()   # the user's saved-tensor hooks the capture does not run


@dataclasses.dataclass(frozen=True)
class KeptAttribute:
    """A tensor the forward stored on a module attribute (`self.cache = h`): it outlives the step."""
    module: str
    attribute: str
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    source: object                     # SourceLoc of the op that made it


@dataclasses.dataclass(frozen=True)
class ForwardObservations:
    """What one fake run of the user's forward shows that export does not keep."""
    checkpoint_calls: tuple["CheckpointCall", ...]   # torch.utils.checkpoint calls, in call order
    kept_attributes: tuple[KeptAttribute, ...]


_NOTHING_SEEN = ForwardObservations(checkpoint_calls=(), kept_attributes=())


def build_fake(source: ModelSource, batch: int, seq: int, precision: str, fake_mode):
    """The user's model and example batch under `fake_mode` (tracer/capture/build.py)."""
    from tracer.capture.build import build_fake as build
    return build(source, batch, seq, precision, fake_mode, where=exception_location)


def export_joint(source: ModelSource, batch: int, seq: int, precision: str, *, strict: bool = False,
                 target: str = "cpu", direct: bool = False, offload_activations: bool = False,
                 steady: bool = False) -> JointCapture:
    """`target` "cuda[:gpu]": the joint graph records the CUDA SDPA ops and autocast lists (capture/target.py).
    `direct`: trace the joint graph from the module itself, with tracer's own source metadata
    (`_SourceMetaMode`), instead of exporting first: one trace instead of two, and a separate fake run of
    the forward only where it keeps tensors on module attributes (`_observe_forward` says which). Models
    whose forward runs torch.utils.checkpoint are left to the export rungs (`_trace_directly`).
    `offload_activations` (direct only): the forward and loss are traced inside
    save_on_cpu(pin_memory=True), as --offload activations runs them."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer.capture.target import parse_target
    device = parse_target(target)
    fake_mode = FakeTensorMode()
    built = build_fake(source, batch, seq, precision, fake_mode)
    model, args = built.model, built.batch
    traced = step_module(built, source, precision)
    stack = contextlib.ExitStack()
    if direct:
        rebound: list[tuple[str, str]] = []
        with record_executed_lines(_is_user_file, traced) as executed, _buffer_rebinding_noted(rebound):
            jd, kept_tensors = _trace_directly(stack, traced, args, precision, device, source, offload_activations)
        if rebound and steady:
            # the forward replaces a registered buffer (a placeholder filled on the first call: ConViT's
            # rel_indices): a steady step starts from the replaced one, so one plain fake forward makes it
            # and the step is traced again
            stack.close()
            stack = contextlib.ExitStack()
            _warm_up_forward(traced, args, fake_mode, precision)
            with record_executed_lines(_is_user_file, traced) as executed:
                jd, kept_tensors = _trace_directly(stack, traced, args, precision, device, source,
                                                   offload_activations)
        # a forward that keeps tensors on module attributes runs once more, plainly, to say which and where
        seen, leaves = _observe_forward(traced, args, fake_mode, source) if kept_tensors else _NOTHING_SEEN, ()
    else:
        with record_executed_lines(_is_user_file) as executed:
            seen = _observe_forward(traced, args, fake_mode, source)
        module, leaves = _export_module(traced, args, source, strict, tag_checkpoints=bool(seen.checkpoint_calls),
                                        fake_mode=fake_mode)
        try:
            jd, _ = _aot_joint(stack, module, args, precision, device, source_meta=False)
        except Exception as exc:
            stack.close()
            raise CaptureError(f"building the joint forward+backward graph of {source.name} failed: "
                               f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                               hint="see --verbose") from exc
    params = dict(traced.named_parameters(remove_duplicate=False))
    buffers = dict(traced.named_buffers(remove_duplicate=False))
    path = "aot-joint" if direct else ("export-joint (strict)" if strict else "export-joint")
    return JointCapture(joint=jd.graph_module, model=model, batch=args, fake_mode=fake_mode,
                        param_by_fqn=params, buffer_by_fqn=buffers, exit_stack=stack, seen=seen, path=path,
                        build_notes=built.notes + traced.notes(), loss_position=traced.loss_position,
                        python_backward_nodes=getattr(jd, "python_backward_nodes", frozenset()),
                        executed_lines=executed, python_deaths=getattr(jd, "python_deaths", None),
                        forward_leaves=leaves, saved_packs=getattr(jd, "saved_packs", None),
                        foreign_saved_hooks=getattr(jd, "foreign_saved_hooks", ()))


def _trace_directly(stack: contextlib.ExitStack, traced: nn.Module, args: tuple, precision: str, device,
                    source: ModelSource, offload_activations: bool = False):
    """(joint graph, how many tensors the forward stored on module attributes): the joint graph traced from
    the module itself, for a forward that runs no torch.utils.checkpoint, makes no leaf that requires grad
    and returns a scalar loss. Anything else raises a quiet CaptureError, and the export rungs, which
    observe the forward first, take the model (and give its errors with the user's line)."""
    from tracer.capture.forward_leaves import ForwardLeafRecorder
    names = {id(m): normalize_module_path(path) for path, m in traced.named_modules()}
    calls: list[CheckpointCall] = []
    leaves = ForwardLeafRecorder()
    try:
        with _record_checkpoints(names, calls), leaves:
            jd, kept_tensors = _aot_joint(stack, traced, args, precision, device, source_meta=True,
                                          offload_activations=offload_activations)
    except Exception as exc:
        stack.close()
        if isinstance(exc, ModelRunError):      # the model's own failure, found while tracing
            raise
        routing_error = _routing_error(exc)
        if routing_error is not None:
            raise routing_error from exc
        if calls:           # reentrant checkpointing refuses AOT's autograd.grad: the export rungs take it
            raise CaptureError(f"{source.name}: the forward checkpoints: it is exported, which observes the "
                               "forward first", next_rung_may_work=True, quiet=True) from exc
        function = _failing_custom_backward(exc)
        if function is not None:
            # export traces a custom Function's forward as plain ops, and AOT derives a backward of its own:
            # not the Function's (which may save less, or write .grad itself by a nested backward())
            raise CaptureError(f"{exception_location(exc)}: the backward of the custom autograd Function {function} cannot be "
                               f"traced into a joint graph ({type(exc).__name__}: "
                               f"{str(exc).splitlines()[0] if str(exc) else ''}), and the export rungs would "
                               f"replace it by the backward of its forward's ops",
                               hint="--capture auto or dispatch runs the step op by op") from exc
        raise CaptureError(f"{exception_location(exc)}: tracing the joint forward+backward graph of {source.name} from the "
                           f"module failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                           hint="see --verbose", next_rung_may_work=True, direct=True) from exc
    if calls or leaves.tensors or not _returns_scalar_loss(jd.graph_module):
        stack.close()
        raise CaptureError(f"{source.name}: the forward checkpoints, makes a leaf that requires grad or returns "
                           "no scalar loss: it is exported, which observes the forward first (and lifts the leaf "
                           "as an input)", next_rung_may_work=True, quiet=True)
    return jd, kept_tensors


@contextlib.contextmanager
def _buffer_rebinding_noted(rebound: list):
    """Within, every registered buffer a module assignment replaces (`self.buf = new`) is added to `rebound`
    as (module class, buffer name)."""
    from torch.nn.modules.module import register_module_buffer_registration_hook

    def hook(module, name, tensor):
        if name in module._buffers and module._buffers[name] is not tensor:
            rebound.append((type(module).__name__, name))

    handle = register_module_buffer_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()


def _warm_up_forward(traced: nn.Module, args: tuple, fake_mode, precision: str) -> None:
    """One plain forward on the fake tensors, without autograd: what a steady step finds its forward left."""
    from tracer.capture.precision import autocast_context
    with fake_mode, torch.no_grad(), autocast_context(precision):
        traced(*args)


def _failing_custom_backward(exc: BaseException) -> str | None:
    """The name of the custom autograd Function whose backward `exc` was raised in (a frame whose `ctx` is an
    autograd node of a Python Function), or None where it was raised elsewhere."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            ctx = tb.tb_frame.f_locals.get("ctx") if tb.tb_frame.f_code.co_name == "backward" else None
            if isinstance(ctx, torch.autograd.function.BackwardCFunction):
                return getattr(getattr(ctx, "_forward_cls", None), "__qualname__", type(ctx).__name__)
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__
    return None


def _returns_scalar_loss(joint: torch.fx.GraphModule) -> bool:
    from tracer.capture.meta import loss_output_index
    output = next(iter(joint.graph.find_nodes(op="output")))
    node = output.args[0][loss_output_index(output.meta.get("desc") or [])]
    val = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
    return isinstance(val, torch.Tensor) and val.numel() == 1 and val.is_floating_point()


def _export_module(traced: nn.Module, args: tuple, source: ModelSource, strict: bool, *,
                   tag_checkpoints: bool = False, fake_mode=None) -> tuple[torch.fx.GraphModule, tuple]:
    """The exported module, and the leaves its forward makes (non-strict: lifted as parameters of the
    module, tracer/capture/forward_leaves.py; strict export runs the forward in Dynamo, which no torch
    function mode sees)."""
    from tracer.capture.forward_leaves import ForwardLeafRecorder, lift_forward_leaves
    tagging = _tag_checkpoint_regions() if tag_checkpoints and not strict else contextlib.nullcontext()
    recorder = ForwardLeafRecorder()
    try:
        with _keep_user_frames(), warnings.catch_warnings(), tagging, \
                recorder if not strict else contextlib.nullcontext():
            # tensors assigned to module attributes are reported by tracer itself (ForwardObservations)
            warnings.filterwarnings("ignore", message="The tensor attributes")
            ep = torch.export.export(traced, args, strict=strict)
    except Exception as exc:
        # the forward itself ran: another export mode may still work
        raise CaptureError(f"torch.export{' (strict)' if strict else ''} failed on {source.name}: "
                           f"{_export_message(exc)}", next_rung_may_work=True,
                           hint="see --verbose; data-dependent Python control flow and .item() cannot be exported") from exc
    gm = ep.module()
    _strip_export_asserts(gm)
    return gm, lift_forward_leaves(gm, recorder.tensors, fake_mode)


def _aot_joint(stack: contextlib.ExitStack, module: nn.Module, args: tuple, precision: str, device, *,
               source_meta: bool, offload_activations: bool = False):
    from torch._functorch.aot_autograd import aot_export_joint_with_descriptors
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    from tracer.capture.eager_kernels import kernels_as_in_eager, unused_forward_ops_kept
    from tracer.capture.target import cuda_capture
    autocast = autocast_context(precision)
    meta = _SourceMetaMode(module) if source_meta else contextlib.nullcontext()
    custom = (_CustomFunctionNodes(meta.lifetimes.saving, meta.lifetimes.watching) if source_meta
              else _CustomFunctionNodes())
    _format_frames.cache_clear()            # a model file may have been rewritten since the last capture
    linecache.checkcache()
    tied = _tied_parameters_once(module) if source_meta else contextlib.nullcontext()
    unpacking = meta.lifetimes.unpacking() if source_meta else contextlib.nullcontext()
    attributes = AttributeSnapshot(module)
    try:
        # a lazy graph module: tracer reads the graph and never runs it, so no Python code is generated
        with autocast, cuda_capture(device, precision), meta, tied, _use_lazy_graph_module(True), \
                kernels_as_in_eager(cpu=not device.is_cuda), unused_forward_ops_kept(), custom, formula_writes_marked(), \
                unpacking, (torch.autograd.graph.save_on_cpu(pin_memory=True) if offload_activations
                            else contextlib.nullcontext()):
            jd = aot_export_joint_with_descriptors(stack, module, args)
        jd.python_backward_nodes = frozenset(custom.seq_nrs)
        jd.python_deaths = resolve_deaths(meta.lifetimes.take_deaths(), jd.graph_module) if source_meta else None
        jd.saved_packs = resolve_packs(meta.lifetimes.take_packs(), jd.graph_module) if source_meta else None
        jd.foreign_saved_hooks = tuple(sorted(meta.lifetimes.foreign_hooks)) if source_meta else ()
    finally:
        kept_tensors = attributes.restore()     # the trace re-runs `self.cache = h`: leave the model as it was
    return jd, kept_tensors


class _CustomFunctionNodes:
    """While the joint graph is traced: the sequence numbers of the autograd nodes whose backward is Python
    code, whose temporaries die as Python lets go of them, not with a C++ formula's expression
    (capture/formulas.py): the nodes custom `torch.autograd.Function`s create, and those whose backward runs
    Python code marked by `python_backward_code`. `Function.apply` is wrapped for the trace only; `saving` is
    the context a Function's call runs in (PythonLifetimes.saving: what `ctx.save_for_backward` saves is seen
    as eager saves it), `watching` the one a Python backward runs in."""
    active: "_CustomFunctionNodes | None" = None      # the one of the trace now running

    def __init__(self, saving=contextlib.nullcontext, watching=contextlib.nullcontext):
        self.seq_nrs: set[int] = set()
        self._apply = None
        self._backward_apply = None
        self._saving = saving
        self._watching = watching

    def __enter__(self):
        _CustomFunctionNodes.active = self
        function = torch.autograd.function.Function
        self._apply = function.__dict__["apply"]
        original, seq_nrs, saving = self._apply.__func__, self.seq_nrs, self._saving
        # the Python backward runs under `watching` (PythonLifetimes.watching: its locals' lifetimes)
        backward = torch.autograd.function.BackwardCFunction
        self._backward_apply = backward.__dict__["apply"]
        original_backward, watching = self._backward_apply, self._watching

        def backward_apply(node, *args):
            with watching():
                return original_backward(node, *args)

        backward.apply = backward_apply

        def apply(cls, *args, **kwargs):
            with saving():
                out = original(cls, *args, **kwargs)
            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                node = getattr(t, "grad_fn", None) if isinstance(t, torch.Tensor) else None
                if node is not None:
                    seq_nrs.add(node._sequence_nr())
            return out

        function.apply = classmethod(apply)
        return self

    def __exit__(self, *exc):
        torch.autograd.function.Function.apply = self._apply
        torch.autograd.function.BackwardCFunction.apply = self._backward_apply
        _CustomFunctionNodes.active = None


@contextlib.contextmanager
def subclass_op_handler(op):
    """Around a tensor subclass's Python handler of `op` in the forward (a DTensor's context-parallel ring):
    the nodes the joint trace makes meanwhile get `meta[SUBCLASS_OP_KEY]` (the op's name), and the last
    maker of each of the op's outputs `meta[SUBCLASS_OUTPUT_KEY]`: torch's selective checkpointing decides
    on the op (its dispatch mode sees the subclass's op; the handler runs below it), so the policies decide
    those nodes as the op (capture/policies.py). Yields `outputs(result)`, to be called with what the
    handler returns. Nothing outside a trace or in backward."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode
    from torch.utils._pytree import tree_leaves

    from tracer.capture.meta import SUBCLASS_OP_KEY, SUBCLASS_OUTPUT_KEY, target_name
    from tracer.capture.python_lifetimes import functional_storage_key
    from tracer.capture.storages import flat_tensors, memory_parts, storage_key
    graph = getattr(getattr(get_proxy_mode(), "tracer", None), "graph", None)
    if graph is None or torch._C._current_autograd_node() is not None:
        yield lambda result: None
        return
    before = set(graph.nodes)
    keys: set[int] = set()

    def outputs(result):
        # a DTensor's local tensor is, in the trace, a functional tensor over the fake one the nodes' values hold
        keys.update(functional_storage_key(part) for t in tree_leaves(result) if isinstance(t, torch.Tensor)
                    for part in memory_parts(t))

    yield outputs
    makers: dict[int, torch.fx.Node] = {}
    for node in graph.nodes:
        if node in before:
            continue
        node.meta[SUBCLASS_OP_KEY] = target_name(op)
        for value in flat_tensors(node.meta.get("val")):
            if storage_key(value) in keys:
                makers[storage_key(value)] = node
    for node in makers.values():
        node.meta[SUBCLASS_OUTPUT_KEY] = True


@contextlib.contextmanager
def python_backward_code():
    """Around Python code that a built-in autograd node's backward runs (a tensor subclass's handler of the
    node's backward op: a DTensor runs the context-parallel ring there): while the joint graph is traced,
    the node counts as Python code (its temporaries die as Python lets go of them, not with a C++ formula's
    expression) and the code's torch calls are watched like a custom Function's backward. Nothing outside
    a trace or outside backward."""
    nodes = _CustomFunctionNodes.active
    node = torch._C._current_autograd_node()
    if nodes is None or node is None:
        yield
        return
    nodes.seq_nrs.add(node._sequence_nr())
    with nodes._watching():
        yield


@contextlib.contextmanager
def _tied_parameters_once(module: nn.Module):
    """AOT lifts every name of a tied parameter (`lm_head.weight is embed.weight`) as an input of its own,
    so each use gets a gradient of its own; export lifts the tensor once and autograd sums the uses, as
    eager does. Lift each tensor once, and bind its other names to the same input when AOT
    reparametrizes the module."""
    from torch.nn.utils import stateless
    reparametrize = stateless._reparametrize_module
    names_of: dict[int, list[str]] = {}
    slots: set[tuple[int, str]] = set()        # (owner module, attribute): a shared module is one slot
    for name, p in nn.Module.named_parameters(module, remove_duplicate=False):
        owner_path, _, attr = name.rpartition(".")
        slot = (id(module.get_submodule(owner_path)), attr)
        if slot not in slots:
            slots.add(slot)
            names_of.setdefault(id(p), []).append(name)
    first_name = {names[0]: names[1:] for names in names_of.values() if len(names) > 1}

    def named_parameters(prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return nn.Module.named_parameters(module, prefix, recurse, remove_duplicate=True)

    def reparametrize_tied(mod, parameters_and_buffers, *args, **kwargs):
        if mod is module:
            parameters_and_buffers = dict(parameters_and_buffers)
            for name, others in first_name.items():
                if name in parameters_and_buffers:
                    parameters_and_buffers.update((other, parameters_and_buffers[name]) for other in others)
        return reparametrize(mod, parameters_and_buffers, *args, **kwargs)

    module.named_parameters = named_parameters
    stateless._reparametrize_module = reparametrize_tied
    try:
        yield
    finally:
        del module.named_parameters
        stateless._reparametrize_module = reparametrize


class _SourceMetaMode(torch.overrides.TorchFunctionMode):
    """While the joint graph is traced from the module itself: sets fx's current node meta to the user's
    stack (`stack_trace`, user frames only, outer to inner) and the module path (`nn_module_stack`) for
    every torch call of the forward, as export's interpreter does; the autograd nodes keep that stack
    (anomaly mode), so backward nodes get it too."""

    def __init__(self, root: nn.Module):
        super().__init__()
        self._root = root
        self._modules: list[tuple[str, tuple[str, str]]] = []
        self._handles: list = []
        self._preserve = None
        self._calls = 0
        self.lifetimes = PythonLifetimes()

    def __enter__(self):
        import torch.fx.traceback as fx_traceback
        for path, m in self._root.named_modules(remove_duplicate=False):
            entry = (path or "L__self__", (path, f"{type(m).__module__}.{type(m).__qualname__}"))
            self._handles.append(m.register_forward_pre_hook(lambda *_, e=entry: self._enter_module(e)))
            self._handles.append(m.register_forward_hook(lambda *_: self._exit_module(), always_call=True))
        self._preserve = fx_traceback.preserve_node_meta()
        self._preserve.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self.lifetimes.close()
        self._preserve.__exit__(*exc)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _enter_module(self, entry) -> None:     # hooks return None: a value would replace args/outputs
        self._modules.append(entry)

    def _exit_module(self) -> None:
        self._modules.pop()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        import torch.fx.traceback as fx_traceback
        # the executed-lines trace is paused for the whole handling of a C function (tracer's own bookkeeping
        # and torch's dispatch under it), so only model code and Python torch functions pay trace events
        with UntracedCall(func):
            meta = fx_traceback.current_meta
            saved = {key: meta[key] for key in _SOURCE_META if key in meta}
            meta["stack_trace"] = _user_stack_trace()
            self._calls += 1             # which aten ops one call ran (a C++ composite's locals: capture/calls.py)
            meta["torch_fn"] = (f"{getattr(func, '__name__', 'call')}_{self._calls}", _qualified_name(func))
            inplace = is_inplace_call(func, kwargs)
            if args and inplace and torch.is_grad_enabled():
                _refuse_inplace_on_parameter(self._root, func, args[0], meta["stack_trace"])
            meta["nn_module_stack"] = dict(self._modules)
            try:
                # capture/inplace.py: the nodes of an in-place call are marked (fx copies `custom` onto them)
                with fx_traceback.annotate({INPLACE_CALL_KEY: True}) if inplace else contextlib.nullcontext(), \
                        self.lifetimes.saving():
                    out = func(*args, **(kwargs or {}))
                self.lifetimes.watch(args, out, inplace)
                return out
            finally:
                for key in _SOURCE_META:
                    meta.pop(key, None)
                meta.update(saved)


_SOURCE_META = ("stack_trace", "nn_module_stack", "torch_fn")


def _qualified_name(func) -> str:
    return f"{getattr(func, '__module__', None) or ''}.{getattr(func, '__qualname__', getattr(func, '__name__', ''))}"


def _refuse_inplace_on_parameter(root: nn.Module, func, tensor, stack_trace: str) -> None:
    """Eager autograd refuses an in-place op, with grad enabled, on a leaf that requires grad or on a view
    of one ("a [view of a] leaf Variable that requires grad is being used in an in-place operation"). The
    direct trace does not: AOT's parameters are not leaves and functionalization turns the op into a
    copy, so the step would be predicted as if it ran. The parameters are found by identity (the trace
    swaps them into the module), so under torch.no_grad() (EMA, weight renormalisation) nothing is refused."""
    if not isinstance(tensor, torch.Tensor):
        return
    target = tensor._base if tensor._base is not None else tensor
    if not target.requires_grad:
        return
    name = next((n for n, p in root.named_parameters(remove_duplicate=False) if p is target), None)
    if name is None:
        return
    loc = loc_from_stack_trace(stack_trace)
    where = f"{loc.file}:{loc.line}" if loc else "model"
    what = "a view of the parameter" if tensor is not target else "the parameter"
    op = getattr(func, "__name__", str(func))
    raise ModelRunError(f"{where}: forward runs {op} in place on {what} {normalize_module_path(name)} with grad "
                        "enabled, which eager PyTorch refuses (a leaf Variable that requires grad is being used in "
                        "an in-place operation)",
                        hint="run it under torch.no_grad(), or use an out-of-place op such as w = w * 2")


def _user_stack_trace() -> str:
    """The Python stack's user frames, outer to inner, in the format of fx's `stack_trace`."""
    import sys
    frames = []
    frame = sys._getframe(2)
    while frame is not None:
        code = frame.f_code
        if _is_user_file(code.co_filename):
            # by file name, not code object: equal code objects of two files compare equal
            frames.append((code.co_filename, frame.f_lineno, code.co_name))
        frame = frame.f_back
    return _format_frames(tuple(frames))


@functools.lru_cache(maxsize=4096)
def _format_frames(frames: tuple) -> str:
    return "".join(f'  File "{file}", line {line}, in {function}\n'
                   f'    {linecache.getline(file, line).strip()}\n' for file, line, function in reversed(frames))


@functools.lru_cache(maxsize=None)
def _is_user_file(path: str) -> bool:
    from tracer.capture.source import is_user_file
    return is_user_file(path)


def _observe_forward(module: nn.Module, args: tuple, fake_mode, source: ModelSource) -> ForwardObservations:
    """Run forward once under fake tensors: user errors point at the user's line, not at export; and the
    run shows what export drops (torch.utils.checkpoint regions, tensors kept on module attributes). The
    lines that made kept tensors take a second run, made only when there are any."""
    names = {id(m): normalize_module_path(path) for path, m in module.named_modules()}
    calls: list[CheckpointCall] = []
    changed = _run_forward(module, args, fake_mode, source, _record_checkpoints(names, calls))
    if changed:
        producer_line = _ProducerLines()
        changed = _run_forward(module, args, fake_mode, source, producer_line)
    kept = []
    for m, label, t in changed:
        storage = t.untyped_storage()
        kept.append(KeptAttribute(module=normalize_module_path(names.get(id(m), "")), attribute=label,
                                  nbytes=storage.nbytes(), shape=tuple(t.shape), dtype=t.dtype,
                                  source=producer_line.lines.get(storage._cdata)))
    return ForwardObservations(tuple(calls), tuple(kept))


def _run_forward(module: nn.Module, args: tuple, fake_mode, source: ModelSource, context) -> list:
    """One fake forward under `context`; returns (module, label, tensor) for each tensor it stored on
    a module attribute (`attribute_tensors`), and leaves the model as it was."""
    before = AttributeSnapshot(module)
    try:
        with fake_mode, context:           # a dispatch-mode context must sit above the fake mode
            out = module(*args)
    except Exception as exc:
        routing_error = _routing_error(exc)
        if routing_error is not None:
            raise routing_error from exc
        if "DataDependent" in type(exc).__name__:
            raise CaptureError(f"{exception_location(exc)}: forward reads a tensor's value ({exc})",
                               hint="tracing uses fake tensors without data: replace Python branches on tensor "
                                    "values, .item() and .tolist() with tensor ops such as torch.where") from exc
        raise ModelRunError(f"{exception_location(exc)}: forward raised {type(exc).__name__}: {exc}",
                            hint=source.failure_hint
                            or "fix the model's forward (it runs on fake tensors with the example batch)") from exc
    if not (isinstance(out, torch.Tensor) and out.numel() == 1 and out.is_floating_point()):
        got = type(out).__name__ if not isinstance(out, torch.Tensor) else f"a tensor of shape {tuple(out.shape)}"
        raise ModelRunError(f"forward of {source.name} returned {got}, not a scalar loss",
                            hint="return the loss from forward, or define loss_fn(output, target) in the model file")
    changed = [(m, label, t) for m, _, label, t in before.changed()]
    before.restore()                       # leave the model as it was
    return changed


_MODULE_INTERNALS = frozenset(vars(nn.Module()))     # _parameters, _buffers, _modules, the hook dicts, ...


def attribute_tensors(m: nn.Module):
    """(attribute, label, tensor) for each tensor a module holds besides its parameters and buffers: a plain
    attribute (`self.cache = h`: label `cache`), or an element of a list, tuple or dict attribute
    (`self.pyramid = [a, b]`: `pyramid[0]`, `pyramid[1]`; torchvision's RAFT keeps its correlation pyramid
    so)."""
    for attr, value in vars(m).items():
        if attr in _MODULE_INTERNALS or attr in m._parameters or attr in m._buffers:
            continue
        if isinstance(value, torch.Tensor):
            yield attr, attr, value
            continue
        items = (enumerate(value) if isinstance(value, (list, tuple))
                 else value.items() if isinstance(value, dict) else ())
        for key, element in items:
            if isinstance(element, torch.Tensor) and not isinstance(element, nn.Parameter):
                yield attr, f"{attr}[{key!r}]", element


class AttributeSnapshot:
    """The tensors every module of `module` holds on attributes (`attribute_tensors`), taken before a run
    of the forward, so that what the run stored can be listed (`changed`) and undone (`restore`): a
    container attribute gets its object and its contents back."""

    def __init__(self, module: nn.Module):
        self._modules = list(module.modules())
        self._tensors = {id(m): {label: t for _, label, t in attribute_tensors(m)} for m in self._modules}
        self._objects = {id(m): {attr: (value, _contents(value)) for attr, value in vars(m).items()
                                 if attr not in _MODULE_INTERNALS} for m in self._modules}

    def changed(self) -> list[tuple[nn.Module, str, str, torch.Tensor]]:
        """(module, attribute, label, tensor) for each tensor held now that was not held under its label."""
        return [(m, attr, label, t) for m in self._modules for attr, label, t in list(attribute_tensors(m))
                if self._tensors[id(m)].get(label) is not t]

    def restore(self) -> int:
        """Puts back every attribute whose tensors changed; returns how many tensors had changed."""
        changed = self.changed()
        for m, attr in {(m, attr): None for m, attr, _, _ in changed}:
            value, contents = self._objects[id(m)].get(attr, (None, None))
            if isinstance(value, list):
                value[:] = contents
            elif isinstance(value, dict):
                value.clear()
                value.update(contents)
            setattr(m, attr, value)
        return len(changed)


def _contents(value):
    """A shallow copy of a list's or dict's contents (a forward may append to a list it keeps)."""
    return list(value) if isinstance(value, list) else dict(value) if isinstance(value, dict) else None


class _ProducerLines(torch.utils._python_dispatch.TorchDispatchMode):
    """storage key -> the user line of the op that returned it (during the fake forward)."""

    def __init__(self):
        super().__init__()
        self.lines: dict[int, object] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from tracer.capture.source import loc_from_python_stack
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if storage._cdata not in self.lines:          # a new storage: remember who made it
                    self.lines[storage._cdata] = loc_from_python_stack()
                    weakref.finalize(storage, self.lines.pop, storage._cdata, None)
        return out


@dataclasses.dataclass(frozen=True)
class CheckpointCall:
    """One torch.utils.checkpoint call of the forward, in call order: what it checkpoints and how it was
    written. The export trace tags the nodes of call `index` with `meta["custom"][CHECKPOINT_KEY]`."""
    index: int
    written: str                   # "module" | "partial" (functools.partial of a module's forward/__call__)
                                   # | "method" (a bound method of a module) | "function"
    target: str                    # the module path, or the function's qualified name
    module: str | None             # the module whose code runs, when there is one
    reentrant: bool
    policy: str                    # "full" | "selective <policy function>" | what an unknown context_fn is
    policy_fn: Any = None          # the user's selective policy: (ctx, op, *args, **kwargs) -> CheckpointPolicy
    source: object = None          # SourceLoc of the line that called checkpoint

    def describe(self) -> str:
        """One line: how the region was written, e.g. `functools.partial of BertLayer.forward on
        bert.encoder.layer.0 (called at modeling_layers.py:123), non-reentrant, full`."""
        what = {"module": f"module {self.target}", "partial": f"functools.partial of {self.target}",
                "method": f"method {self.target}", "function": f"function {self.target}"}[self.written]
        if self.written in ("partial", "method") and self.module is not None:
            what += f" on {self.module or '(the model)'}"
        where = f" (called at {self.source.short()})" if self.source is not None else ""
        return f"{what}{where}, {'reentrant' if self.reentrant else 'non-reentrant'}, {self.policy}"




def _checkpointed_callable(fn, names: dict[int, str]) -> tuple[str, str, str | None]:
    """(written, target, module path) of the callable handed to checkpoint, in one line each."""
    written = None
    while isinstance(fn, functools.partial):
        written = "partial"
        inner = fn.func
        if not hasattr(inner, "__self__") and fn.args and isinstance(fn.args[0], nn.Module):
            owner = fn.args[0]         # partial(Layer.forward, layer, **kwargs): transformers' layers
            return written, f"{type(owner).__qualname__}.{getattr(inner, '__name__', 'forward')}", names.get(id(owner))
        fn = inner
    if isinstance(fn, nn.Module):
        return written or "module", names.get(id(fn), type(fn).__qualname__) or "(the model)", names.get(id(fn))
    owner = getattr(fn, "__self__", None)
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    if isinstance(owner, nn.Module):
        method = getattr(fn, "__name__", "")
        if written:
            return written, f"{type(owner).__qualname__}.{method}", names.get(id(owner))
        if method in MODULE_CALL_ENTRIES:
            return "module", names.get(id(owner)) or "(the model)", names.get(id(owner))
        return "method", name, names.get(id(owner))
    return written or "function", name, None


def _selective_policy(context_fn) -> tuple[str, Any]:
    """("full", None) without a context_fn; ("selective <name>", policy function) for
    create_selective_checkpoint_contexts; otherwise a description (simulated as full)."""
    import torch.utils.checkpoint as ckpt
    if context_fn is None or context_fn is ckpt.noop_context_fn:
        return "full", None
    try:
        forward_context, _ = context_fn()
    except Exception as exc:   # noqa: BLE001 - the user's context_fn; the note says what happened
        return f"context_fn raised {type(exc).__name__} (simulated as full)", None
    policy_fn = getattr(forward_context, "policy_fn", None)
    if policy_fn is None:
        return f"context_fn {getattr(context_fn, '__qualname__', type(context_fn).__name__)} (simulated as full)", None
    name = getattr(policy_fn, "__qualname__", type(policy_fn).__name__)
    return f"selective, policy {name}", policy_fn


@contextlib.contextmanager
def _record_checkpoints(names: dict[int, str], calls: list[CheckpointCall]):
    """Record every torch.utils.checkpoint call (both implementations) of a forward run, which runs them
    as torch does."""
    import torch.utils.checkpoint as ckpt
    from tracer.capture.source import loc_from_python_stack

    def record(fn, reentrant: bool, context_fn=None) -> None:
        written, target, module = _checkpointed_callable(fn, names)
        policy, policy_fn = _selective_policy(context_fn)
        calls.append(CheckpointCall(index=len(calls), written=written, target=target,
                                    module=None if module is None else normalize_module_path(module),
                                    reentrant=reentrant, policy=policy, policy_fn=policy_fn,
                                    source=loc_from_python_stack()))

    real_generator, real_function = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction

    def generator(fn, preserve_rng_state=True, context_fn=ckpt.noop_context_fn, *a, **k):
        record(fn, False, context_fn)
        return real_generator(fn, preserve_rng_state, context_fn, *a, **k)

    class Reentrant:
        @staticmethod
        def apply(function, preserve, *args):
            record(function, True)
            return real_function.apply(function, preserve, *args)

    ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = generator, Reentrant
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = real_generator, real_function


@contextlib.contextmanager
def _tag_checkpoint_regions():
    """While export traces the forward: run each checkpointed callable as plain code (export would drop
    the checkpoint anyway, and an autograd.Function under no_grad hides its ops from the gradient), with
    its nodes tagged `meta["custom"][CHECKPOINT_KEY] = call index` (fx annotations, kept by export and by
    the joint graph)."""
    import torch.fx.traceback as fx_traceback
    import torch.utils.checkpoint as ckpt
    counter = iter(range(1 << 30))

    def generator(fn, preserve_rng_state=True, context_fn=ckpt.noop_context_fn, *a, **k):
        region = next(counter)
        _mark_frame_held(region, (fn, a, k))
        with fx_traceback.annotate({CHECKPOINT_KEY: region}):
            yield

    class Reentrant:
        @staticmethod
        def apply(function, preserve, *args):
            # no input requiring grad: CheckpointFunction's outputs do not either, so nothing in the region
            # gets a gradient (torch warns "None of the inputs have requires_grad=True")
            grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
            with fx_traceback.annotate({CHECKPOINT_KEY: next(counter)}), torch.set_grad_enabled(grad):
                return _partial_held_marked(function)(*args)

    real_generator, real_function = ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction
    ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = generator, Reentrant
    try:
        with fx_traceback.preserve_node_meta():
            yield
    finally:
        ckpt._checkpoint_without_reentrant_generator, ckpt.CheckpointFunction = real_generator, real_function




def _mark_frame_held(region: int, call) -> None:
    """Tag the nodes that made the tensors a non-reentrant region's checkpoint frame holds (`call`: its
    callable, whose functools.partial layers bind tensors, and the arguments it is called with) with
    `meta["custom"][FRAME_HELD_KEY]` += ((region, shape, dtype, node name),): eager keeps them until the region's backward has run,
    also those the region never reads (transformers binds `position_ids` for layers that ignore it)."""
    from torch.fx.experimental.proxy_tensor import get_proxy_mode, get_proxy_slot
    from torch.utils._pytree import tree_leaves

    from tracer.capture.storages import dtype_name
    mode = get_proxy_mode()
    if mode is None:
        return
    fn, *rest = call
    bound = []
    while isinstance(fn, functools.partial):
        bound += [fn.args, fn.keywords]
        fn = fn.func
    for t in tree_leaves((bound, rest)):
        slot = get_proxy_slot(t, mode.tracer, None) if isinstance(t, torch.Tensor) else None
        node = getattr(getattr(slot, "proxy", None), "node", None)
        if node is not None:
            # the node becomes one or more aten ops (dropout: bernoulli, div, mul): the last one made from it
            # (`node.name`) makes the tensor, its output of the tensor's shape and dtype (a layer norm's mean
            # and rstd are not held)
            held = (region, tuple(int(d) for d in t.shape), dtype_name(t.dtype), node.name)
            custom = node.meta.get("custom") or {}          # a new dict: annotate shares one among its nodes
            node.meta["custom"] = {**custom, FRAME_HELD_KEY: tuple(custom.get(FRAME_HELD_KEY, ())) + (held,)}


def _partial_held_marked(function):
    """`function` with the tensors its functools.partial layers bind (transformers' masks and rotary
    embeddings) passed through views whose nodes are tagged `meta["custom"][PARTIAL_HELD_KEY]`: reentrant
    checkpointing keeps the callable on its autograd node, so those tensors live until the graph dies."""
    import torch.fx.traceback as fx_traceback
    from torch.utils._pytree import tree_map_only
    if not isinstance(function, functools.partial):
        return function
    with fx_traceback.annotate({PARTIAL_HELD_KEY: True}):
        args, keywords = tree_map_only(torch.Tensor, lambda t: t.view_as(t), (function.args, function.keywords))
    return functools.partial(_partial_held_marked(function.func), *args, **keywords)


class _UserFrameAnchors(set):
    """Stands in for fx's stack-trace anchor set: every frame in a user file counts as an anchor."""

    def __contains__(self, item) -> bool:
        from tracer.capture.source import is_user_file
        return super().__contains__(item) or is_user_file(item[0])


@contextlib.contextmanager
def _keep_user_frames():
    """Non-strict export keeps only `forward` frames in stack traces; keep helper functions' frames too,
    so a line inside `apply_rope()` is attributed to that line, not to the forward that called it."""
    import torch.fx.proxy as fx_proxy
    saved = fx_proxy._STACK_TRACE_ANCHORS
    fx_proxy._STACK_TRACE_ANCHORS = _UserFrameAnchors(saved)
    try:
        yield
    finally:
        fx_proxy._STACK_TRACE_ANCHORS = saved


def _strip_export_asserts(gm: torch.fx.GraphModule) -> None:
    target = torch.ops.aten._assert_tensor_metadata.default
    for sub in gm.modules():
        if isinstance(sub, torch.fx.GraphModule):
            for node in list(sub.graph.find_nodes(op="call_function", target=target)):
                sub.graph.erase_node(node)
            sub.recompile()


def _routing_error(exc: BaseException):
    """The RoutingError (a data-dependent size no capture path can give) behind `exc`, if any: tracing
    machinery may wrap the exceptions raised inside it."""
    from tracer.capture.routing import RoutingError
    seen = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, RoutingError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None




def _export_message(exc: BaseException) -> str:
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    loc = None
    for line in text.splitlines():
        if 'File "' in line:
            loc = loc_from_stack_trace(line.strip() + "\n    ")
    where = f" at {loc.file}:{loc.line}" if loc else ""
    return f"{type(exc).__name__}: {first}{where}"
