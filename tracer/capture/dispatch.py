"""The last rung of the capture ladder: run the whole step eagerly on fake tensors under `StepRecorder`.

When no graph can be exported (data-dependent Python control flow, ops export cannot trace), the step
still runs op by op on fake tensors: forward+loss, `loss.backward()`, `optimizer.step()`, `zero_grad()`,
after an untracked warm-up step for steady state. Frees are observed (exact eager lifetimes, Python
locals included). Backward ops are attributed to the forward line and module that created their
autograd node (stamped on the node by a TorchFunctionMode during forward). For a CUDA target the run takes
CUDA's kernel choices where Python or the dispatcher makes them on the device (target.py: the SDPA op,
bf16 autocast's lists, dropout's fused kernel, the optimizer's foreach default); a custom op's CPU Python
kernel is still traced (bitsandbytes' 4-bit matmul dequantizes its weight there, as its CUDA kernel does
for all but small calls). Values read from tensors
(`.item()`, `if t.sum() > 0:`) read as 0 / False, and every such read is reported with its line; a truth
value an `assert` statement reads is the one that lets it pass (the step predicted passes its assertions).
A model's own torch.utils.checkpoint runs for real: the ops its recompute (or a reentrant region's rerun)
runs inside backward are marked recomputed, at the model line and module they run from
(`checkpoint_rerun_site`: a block's method or a plain function the region runs outside any module's
forward takes the innermost module whose method is running); the nodes a reentrant region's rerun makes
are stamped as forward's are (`_RerunNodes`), so the backward it runs over them has forward's lines and
modules. The CPU RNG state each region saves (a real CPU tensor, made outside the dispatcher: device
memory on a CPU target only) is recorded through a fake stand-in of its size (`_rng_states_recorded`).
What this path cannot do: recompute policies (compiled, selective, full) need a graph.

It is also the eager-only analysis's first try (`vouched`): the run is kept, as `VOUCHED_PATH`, only where
`graph_rung_features` finds nothing the op-by-op run and the joint graph are not held equal on
(benchmarks/capture_parity.py compares the two on every fixture); else the caller captures the graph.
Autograd does not check the version of a tensor saved-tensor hooks hold, so the run's own hooks check it:
a saved tensor written in place stops the step as eager's backward stops it. Lines are the model's: the
frames of the code that called the capture (a user's script calling `tracer.analyze`) are left out.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import warnings
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from tracer.capture.build import model_held_tensors, step_module
from tracer.capture.convert import input_values
from tracer.capture.eager_kernels import kernels_as_in_eager
from tracer.capture.lightning_loop import optimizer_factory
from tracer.capture.joint import attribute_tensors, build_fake
from tracer.capture.source import exception_location
from tracer.capture.precision import autocast_context, make_grad_scaler
from tracer.capture.pylocals import assertion_note
from tracer.capture.model_input import ModelSource
from tracer.capture.optimizer import (NotAnOptimizer, as_optimizer, make_standard_optimizer, no_gradient_error,
                                      not_an_optimizer_error, optimizer_held_tensors, optimizer_notes,
                                      simulated_if_bitsandbytes)
from tracer.capture.recorder import StepRecorder
from tracer.capture.source import loc_from_python_stack, loc_of_frames, normalize_module_path
from tracer.capture.storages import StorageTable
from tracer.errors import ModelRunError
from tracer.stepgraph import Phase, SourceLoc, StorageRole

CAPTURE_PATH = "dispatch (fake tensors, no graph)"
# the eager-only command's step run op by op where it stands for the joint graph's (`graph_rung_features`)
VOUCHED_PATH = "op by op (the joint graph's eager step)"


class _ModuleStack:
    """The current module path during forward, from global module hooks."""

    def __init__(self, names: dict[int, str]):
        self.names, self.stack = names, []

    def __enter__(self):
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        # the exit hook runs when a forward raises too: torch.utils.checkpoint stops a recompute by raising
        # inside a module once it has what backward needs, and the stack must not keep that module
        self.handles = [register_module_forward_pre_hook(self._enter),
                        register_module_forward_hook(self._exit, always_call=True)]
        return self

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()

    def _enter(self, module, args):
        self.stack.append(self.names.get(id(module), self.stack[-1] if self.stack else ""))

    def _exit(self, module, args, out):
        if self.stack:
            self.stack.pop()

    @property
    def current(self) -> str:
        return normalize_module_path(self.stack[-1]) if self.stack else ""


class _NodeStamper(TorchFunctionMode):
    """Stamps the caller's line and module on every autograd node a torch call creates (for backward ops)."""

    def __init__(self, modules: _ModuleStack):
        super().__init__()
        self.modules = modules

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        site = None                       # read from the Python stack once a node needs it (most calls: none)
        stack = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:
            node = stack.pop()
            if node is None or "tracer_site" in node.metadata or type(node).__name__ == "AccumulateGrad":
                continue
            if site is None:
                site = (loc_from_python_stack(), self.modules.current)
            node.metadata["tracer_site"] = site
            stack.extend(fn for fn, _ in node.next_functions)
        return out


class _RerunNodes:
    """Stamps the autograd nodes a checkpointed region's rerun makes inside backward (no torch-function mode
    sees them: the mode that stamps forward's nodes is off inside the backward call) with the line and
    module of the op that made each, so that the backward a reentrant region runs over them has the lines
    and modules forward's backward has. An op's outputs get their node after the recorder has returned
    them (autograd reads their device, a `prim` op, before it sets the node): they are held through weak
    references, which keep nothing alive, and stamped once the node is there (`stamp()`), at the latest by
    the next op that is not a `prim` one."""

    def __init__(self):
        self.pending: list[tuple[weakref.ref, tuple]] = []

    def on_op(self, draft, out) -> None:
        if draft.target.startswith("prim."):
            return
        self.stamp()
        self.pending.clear()           # outputs without a node by now get none (no gradient)
        if draft.recomputed and draft.phase is Phase.BACKWARD:
            self.pending += [(weakref.ref(t), (draft.source, draft.module)) for t in tree_leaves(out)
                             if isinstance(t, torch.Tensor)]

    def stamp(self) -> None:
        """Stamps the pending outputs' nodes that exist; keeps the outputs still waiting for one."""
        waiting = []
        for ref, site in self.pending:
            t = ref()
            if t is None:
                continue
            if t.grad_fn is None:
                waiting.append((ref, site))
            elif "tracer_site" not in t.grad_fn.metadata:
                t.grad_fn.metadata["tracer_site"] = site
        self.pending = waiting


_CHECKPOINT_FILE = os.path.join(os.path.dirname(torch.__file__), "utils", "checkpoint.py")


def checkpoint_rerun_site(module_names: dict[int, str]) -> tuple[SourceLoc | None, str] | None:
    """The model line and module a backward op runs from when torch.utils.checkpoint is running a region's
    forward again (its non-reentrant recompute, or a reentrant region's rerun), or None for any other
    backward op (a backward formula, the reentrant region's inner backward call, which runs no model code).
    The line is the innermost model frame inside the outermost of checkpoint.py's frames (a selective
    region's caching mode runs in checkpoint.py too, inside the model's frames); the module is the innermost
    of those frames' `self` that is one of the model's modules (`module_names`: id -> path), for the ops a
    region runs outside any module's forward (a block's method it checkpoints: forward ran them inside the
    block's forward, which the rerun does not enter); "" when none is."""
    frames, frame, outermost = [], sys._getframe(2), None
    while frame is not None:
        if frame.f_code.co_filename == _CHECKPOINT_FILE:
            outermost = len(frames)
        frames.append(frame)
        frame = frame.f_back
    if outermost is None:
        return None
    inside = frames[:outermost]                       # inner to outer
    loc = loc_of_frames(inside[::-1])
    if loc is None:
        return None                                   # checkpoint.py itself (a reentrant region's backward call)
    module = next((module_names[id(f.f_locals["self"])] for f in inside
                   if "self" in f.f_code.co_varnames[:1] and id(f.f_locals.get("self")) in module_names), "")
    return loc, normalize_module_path(module)


def capture_step_dispatch(source: ModelSource, options, *, chosen: bool = False, warm_up_step: bool = False,
                          vouched: bool = False) -> tuple:
    """Returns (ops, StorageTable, (parameter count, frozen parameter count), notes, the loss's position in a
    returned tuple, the built model). `chosen`: the step runs
    op by op by choice (a second-order step, a quantized base, --capture dispatch), not because no graph
    could be captured. `vouched`: the step stands for the joint graph's eager step (the eager-only
    command's first try): raises GraphRungNeeded when it used something the two are not known to equal on
    (`graph_rung_features`).

    A steady step needs what the step before it leaves behind. The optimizer's state is made by priming:
    one optimizer step on fake gradients of every parameter that requires one, without running the model.
    The recorded step then shows whether the model's own steps leave anything more (`_primed_step_is_steady`):
    when its backward reaches other parameters, when something it makes outlives it, or when it changes a
    module's attributes, it is recorded again after a whole warm-up step (`warm_up_step`), as it is from the
    start for a loop that differentiates its gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracer.capture.target import cuda_capture, cuda_eager_kernels, cuda_optimizer_defaults, parse_target

    target = parse_target(options.target)
    fake_mode = FakeTensorMode()
    built = build_fake(source, options.batch, options.seq, options.precision, fake_mode)
    model, batch, step = built.model, built.batch, step_module(built, source)
    autocast = lambda: autocast_context(options.precision)        # noqa: E731
    scaler = make_grad_scaler(options.precision)       # the dispatch run scales the loss as a loop does
    make_optimizer = optimizer_factory(model, source.make_optimizer)
    with fake_mode, cuda_optimizer_defaults(target):
        made = (make_optimizer(model.parameters()) if make_optimizer is not None
                else make_standard_optimizer(options.optimizer, model.parameters(), foreach=options.foreach))
    if make_optimizer is None:
        opt = simulated_if_bitsandbytes(made)
    else:
        try:
            opt = as_optimizer(made)
        except NotAnOptimizer:
            raise not_an_optimizer_error(made) from None
    steady = options.step == "steady"
    prime = steady and not warm_up_step and not source.create_graph
    table = StorageTable()
    # a module reachable under two names takes the last, as the graph rungs' module hooks name it
    names = {id(m): path for path, m in model.named_modules(remove_duplicate=False)}
    phase = {"now": Phase.FORWARD}
    last_backward_site = [(None, "")]

    reruns = _RerunNodes()
    parameter_ids = {id(p) for p in model.parameters()}
    seen: set[str] = set()                  # what the run used that `graph_rung_features` names

    def site():
        if reruns.pending:
            reruns.stamp()
        node = torch._C._current_autograd_node()
        if node is not None and phase["now"] is not Phase.OPTIMIZER:   # a second-order step's autograd.grad
            # runs backward nodes inside the optimizer phase: they are the step's, at its line
            rerun = checkpoint_rerun_site(names)
            if rerun is not None:          # torch.utils.checkpoint running the region's forward again
                loc, module = rerun
                return Phase.BACKWARD, loc, modules.current or module, True
            stamped = node.metadata.get("tracer_site")
            if stamped is not None:
                last_backward_site[0] = stamped
            elif type(node).__name__ == "AccumulateGrad":
                # a parameter's gradient accumulation (a copy of a gradient in another layout) runs as soon
                # as the node that made the gradient has run: that node's line and module
                stamped = last_backward_site[0]
                if id(node.variable) not in parameter_ids:
                    seen.add("a leaf tensor made in forward that requires grad")
            loc, module = stamped or (None, "")
            return Phase.BACKWARD, loc, module
        if phase["now"] is Phase.FORWARD:
            return Phase.FORWARD, loc_from_python_stack(), modules.current
        return phase["now"], loc_from_python_stack(), ""

    if vouched and _has_rnn(model):
        raise GraphRungNeeded(("an RNN module",))       # before the model runs: its state is as it was built
    # the other features show as the step runs; it runs to its end, whatever it meets (a model's own state,
    # a selective checkpoint policy's count of matmuls, is then that of a whole step, as in a training loop)
    modules = _ModuleStack(names)

    # a custom op's CPU Python kernel is traced for either target: bitsandbytes' 4-bit matmul dequantizes
    # its weight there, as its CUDA kernel does for all but small calls (a size bitsandbytes picks per GPU)
    recorder = StepRecorder(table, 0, site=site, read_scalars_as_zero=True, kernel_device="cpu",
                            opaque_raw_kernels=True, cpu_scratch=not target.is_cuda, on_op=reruns.on_op)
    gradients = []                          # (parameter name, storage id) of the recorded step's gradients
    reached: set[int] = set()               # ids of the parameters the recorded backward reaches
    packed: set[int] = set()                # storage ids autograd saved in the recorded forward

    def run_step(record: bool):
        with contextlib.ExitStack() as stack:
            stack.enter_context(fake_mode)
            log = stack.enter_context(cuda_capture(target, options.precision, cast_cache=True))
            stack.enter_context(cuda_eager_kernels(target))
            # the graph rungs' fake kernels as eager's: those the C++ dispatcher reaches here (strides, norm
            # statistics, collectives' waits, oneDNN's RNN workspace); the Python kernels are inert here
            stack.enter_context(kernels_as_in_eager(cpu=not target.is_cuda))
            stack.enter_context(cuda_optimizer_defaults(target))    # read when step() runs, too
            if record:
                stack.enter_context(recorder)
                if not target.is_cuda:
                    stack.enter_context(_rng_states_recorded(table, packed))
            phase["now"] = Phase.FORWARD
            # --offload activations: the loop's save_on_cpu runs for real on the fake tensors (a CPU view:
            # with pin_memory=True every save is copied, activation_offload.py's model of a CPU target)
            offloaded = (torch.autograd.graph.save_on_cpu(pin_memory=True) if options.offload == "activations"
                         else contextlib.nullcontext())
            noted = _saved_storages_noted(table, packed) if record else contextlib.nullcontext()
            with modules, _NodeStamper(modules), autocast(), noted, offloaded, _saved_tensor_hooks_seen(seen):
                loss = step(*batch)
            log.clear_casts()                  # autocast's exit frees its cached casts
            if not (isinstance(loss, torch.Tensor) and loss.requires_grad):
                raise no_gradient_error()
            # the loop's scaling of the loss is a forward op, as on the graph rungs: backward begins with its
            # own ops, and what it reads of the loss and the scale is no tensor autograd saved
            scaled = scaler.scale(loss) if scaler is not None else loss
            phase["now"] = Phase.BACKWARD
            if record and prime:
                reached.update(_parameters_reached(loss))
            # a checkpointed region's recompute runs its modules' forward: their paths, as in forward
            with warnings.catch_warnings(), modules:   # the cycle it warns of is broken by zero_grad(set_to_none=True)
                warnings.filterwarnings("ignore", message="Using backward.. with create_graph=True")
                scaled.backward(create_graph=source.create_graph)
            del scaled
            if record:               # zero_grad(set_to_none=True) drops them before the step ends
                gradients.extend((fqn, table.lookup(p.grad)) for fqn, p in model.named_parameters()
                                 if p.grad is not None)
            phase["now"] = Phase.OPTIMIZER
            if opt is not None and scaler is not None:
                scaler.step(opt)                       # its inf check reads 0: the step is taken
                scaler.update()
                opt.zero_grad(set_to_none=options.zero_grad_set_to_none)
            elif opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=options.zero_grad_set_to_none)
            else:
                model.zero_grad(set_to_none=options.zero_grad_set_to_none)
            return loss

    try:
        if prime:
            with StepRecorder(StorageTable(), 0, read_scalars_as_zero=True):   # only reads scalars as 0
                primed = _prime_optimizer(model, opt, scaler, options.zero_grad_set_to_none, fake_mode, target)
            attributes_before = _module_attributes(model)
        elif steady:
            with StepRecorder(StorageTable(), 0, read_scalars_as_zero=True):   # warm-up: only reads scalars as 0
                run_step(record=False)
        _register_preexisting(recorder, model, batch, opt)
        if scaler is not None and steady:
            for tensor, name in ((scaler._scale, "GradScaler scale"), (scaler._growth_tracker, "GradScaler growth tracker")):
                recorder.add_existing(tensor, StorageRole.OPTIMIZER_STATE, name=name)
        loss = run_step(record=True)
        recorder.stop_tracking()
    except (ModelRunError, GraphRungNeeded):
        raise
    except Exception as exc:
        from tracer.capture.joint import _routing_error
        if _routing_error(exc) is not None:
            raise _routing_error(exc) from exc
        raise ModelRunError(f"{exception_location(exc, source.name)}: running the step op by op on fake tensors failed too: "
                            f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                            hint=(source.failure_hint or "for transformers models try use_cache=False, "
                                  "attn_implementation='sdpa' or a static rope_type") + "; --verbose shows the full "
                                 "traceback") from exc
    loss_sid = table.lookup(loss)
    del loss
    if prime and not _primed_step_is_steady(recorder, table, loss_sid, primed, reached,
                                            attributes_before, _module_attributes(model)):
        del model, opt, recorder, table, built, batch, step
        return capture_step_dispatch(source, options, chosen=chosen, warm_up_step=True, vouched=vouched)
    if loss_sid is not None:
        table.update(loss_sid, persistent=True, name="loss")
    for sid in recorder.created:
        if table.get(sid).released_after_op is None:
            table.update(sid, persistent=True)
    _saved_and_held_into_backward(recorder.ops, table, packed)
    for fqn, sid in gradients:
        if sid is not None and table.get(sid).role is StorageRole.INTERMEDIATE:
            table.update(sid, role=StorageRole.GRADIENT, name=f"{fqn}.grad")
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    for value, name in optimizer_held_tensors(opt, names):
        if table.lookup(value) is not None:
            table.update(table.lookup(value), role=StorageRole.OPTIMIZER_STATE, name=name)
    if vouched:
        features = graph_rung_features(recorder, table, model, seen) + (
            ("a data-dependent size or value",) if _routing_decided() else ())
        if features:
            raise GraphRungNeeded(features)
    notes = list(built.notes + step.notes() + optimizer_notes(opt))
    if not vouched:
        notes += [("" if chosen else "no graph could be captured; ") + "the step ran op by op on fake "
                  f"tensors ({CAPTURE_PATH}): eager memory and attribution only, no recompute policies"]
    notes += [f"a value read from a tensor at {loc.short() if loc else 'an unknown line'} was taken as 0 / False "
              "(fake tensors have no data)" for loc in dict.fromkeys(recorder.scalar_reads)]
    notes += [assertion_note(loc.short()) for loc in dict.fromkeys(recorder.asserted_reads)]
    return recorder.ops, table, parameter_counts(model), tuple(notes), step.loss_position, model


class GraphRungNeeded(Exception):
    """The step run op by op used something it is not known to equal the joint graph's step on."""

    def __init__(self, features: tuple[str, ...]):
        super().__init__("; ".join(features))
        self.features = features


def graph_rung_features(recorder: StepRecorder, table: StorageTable, model, seen: set[str]) -> tuple[str, ...]:
    """What the recorded step used that the op-by-op run and the joint graph's eager step are not held equal
    on (benchmarks/capture_parity.py compares the two on every fixture): a checkpointed region's recompute,
    a value read from a tensor (the graph rung drops the ops only Python reads), a tensor subclass (float8
    training), a custom op's kernel, an RNN module (a CUDA target's cuDNN kernel), a collective, saved-tensor
    hooks of the model's own (save_on_cpu), a leaf made in forward that requires grad, or a forward write
    into a parameter's own storage (`weight.data.clamp_()`). Empty: the two are the same step."""
    features = set(seen) | _recorder_features(recorder)
    for op in recorder.ops:
        features |= _op_features(op, table)
    if _has_rnn(model):
        features.add("an RNN module")
    if _unread_scalar_results(recorder.ops):
        features.add("values read from tensors")
    return tuple(sorted(features))


def _has_rnn(model) -> bool:
    return any(isinstance(m, torch.nn.RNNBase) for m in model.modules())


def _recorder_features(recorder: StepRecorder) -> set[str]:
    features = set()
    if recorder.scalar_reads or recorder.asserted_reads or recorder.model_constant_reads:
        features.add("values read from tensors")
    if recorder.subclass_ops:
        features.add("a tensor subclass")
    if recorder.traced_kernels or recorder.opaque_kernels:
        features.add("a custom op's kernel")
    return features


def _op_features(op, table: StorageTable) -> set[str]:
    """What one recorded op is that the two paths are not held equal on; a forward truth value (a 0-dim
    bool: `mask.all()`) is taken for a value read (the joint graph leaves out one that no op reads)."""
    if op.recomputed or op.rerun_of is not None:
        return {"a checkpointed region"}
    if op.target.startswith(("c10d.", "_c10d_functional.")):
        return {"a collective"}
    if op.phase is Phase.FORWARD:
        if _writes_a_parameter(op, table):
            return {"a forward write into a parameter"}
        if op.outputs and all(v.shape == () and v.dtype == "bool" for v in op.outputs) and not op.is_view:
            return {"values read from tensors"}
    return set()


def _routing_decided() -> bool:
    """The routing assumption of the capture decided a size or answered a value read."""
    from tracer.capture.routing import active_routing
    state = active_routing()
    return state is not None and state.decided_anything


def _unread_scalar_results(ops) -> bool:
    """A forward op whose outputs are new 0-dim tensors that no later op reads: a value Python reads (or
    drops), which the joint graph leaves out with its op."""
    read: set[int] = set()
    for op in ops:
        read.update(value.storage_id for value in input_values(op))
    return any(op.phase is Phase.FORWARD and not op.is_view and op.outputs
               and all(value.shape == () and value.storage_id not in read for value in op.outputs)
               for op in ops)


def _writes_a_parameter(op, table: StorageTable) -> bool:
    """An in-place aten op (`clamp_`) whose output is a parameter's storage."""
    parts = op.target.split(".")
    if len(parts) < 2 or not parts[1].endswith("_"):
        return False
    return any(table.get(value.storage_id).role is StorageRole.PARAMETER for value in op.outputs)


@contextlib.contextmanager
def _saved_tensor_hooks_seen(seen: set[str]):
    """Adds to `seen` when the model's code enters saved-tensor hooks of its own (save_on_cpu, a
    non-reentrant checkpoint's) while active."""
    hooks = torch.autograd.graph.saved_tensors_hooks
    original = hooks.__enter__

    def enter(self):
        seen.add("saved-tensor hooks")
        return original(self)

    hooks.__enter__ = enter
    try:
        yield
    finally:
        hooks.__enter__ = original


@contextlib.contextmanager
def _rng_states_recorded(table: StorageTable, packed: set[int]):
    """`torch.get_rng_state()` makes a real CPU tensor outside the dispatcher (torch.utils.checkpoint saves
    one at a region's entry and fork_rng stashes one while it recomputes): on a CPU target, device memory.
    For the duration each one returned has a fake stand-in of its size, made through the recorder where it
    is made and dropped when the real state dies, so the step holds its bytes exactly as long. The state a
    region saves in forward, which its recompute restores, is saved for backward (added to `packed`)."""
    import torch.utils.checkpoint as checkpoint_module
    real = torch.get_rng_state
    stand_ins: dict[int, torch.Tensor] = {}

    def get_rng_state() -> torch.Tensor:
        state = real()
        stand_in = stand_ins[id(state)] = torch.empty(state.shape, dtype=state.dtype)
        weakref.finalize(state, stand_ins.pop, id(state), None)
        sid = table.lookup(stand_in)
        if (sid is not None and sys._getframe(1).f_code.co_filename == checkpoint_module.__file__
                and torch._C._current_autograd_node() is None):
            packed.add(sid)
        return state

    torch.get_rng_state = get_rng_state
    try:
        yield
    finally:
        torch.get_rng_state = real


def _prime_optimizer(model, opt, scaler, set_to_none: bool, fake_mode, target) -> frozenset[int]:
    """The state a step leaves in the optimizer, made without running the model: a fake gradient for every
    parameter that requires one, the optimizer step the loop takes (through the GradScaler under fp16) and
    zero_grad. Returns the ids of the parameters given a gradient."""
    from tracer.capture.optimizer import set_fake_grads
    from tracer.capture.target import cuda_optimizer_defaults

    params = [p for p in model.parameters() if p.requires_grad]
    with fake_mode, cuda_optimizer_defaults(target):
        set_fake_grads(params)
        if opt is None:
            model.zero_grad(set_to_none=set_to_none)
            return frozenset(id(p) for p in params)
        if scaler is not None:
            scaler.scale(torch.zeros(()))           # its scale and growth tracker are made by the first scale()
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=set_to_none)
    return frozenset(id(p) for p in params)


def _parameters_reached(loss: torch.Tensor) -> set[int]:
    """Ids of the leaf tensors the autograd graph of `loss` accumulates gradients into."""
    seen, stack, leaves = set(), [loss.grad_fn], set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.add(id(variable))
        stack.extend(fn for fn, _ in node.next_functions)
    return leaves


def _module_attributes(model) -> list[tuple]:
    """Each module's class and attributes: numbers, strings and flags by value, other objects by identity
    (a flag set or a tensor cached at the first call shows here)."""
    plain = (bool, int, float, str, type(None))
    return [(type(m), tuple((k, v if isinstance(v, plain) else id(v)) for k, v in vars(m).items()))
            for m in model.modules()]


def _primed_step_is_steady(recorder: StepRecorder, table: StorageTable, loss_sid, primed: frozenset[int],
                           reached: set[int], attributes_before: list, attributes_after: list) -> bool:
    """Whether a step recorded after priming the optimizer is the steady step: its backward reaches exactly
    the primed parameters, nothing it made outlives it but the loss, and no module's attributes changed.
    Otherwise the model's first step differs from the next (a lazy cache, a first-call flag, a parameter
    without a gradient) and only a whole warm-up step gives the steady one."""
    outlives = [sid for sid in recorder.created if sid != loss_sid and table.get(sid).released_after_op is None]
    return reached == set(primed) and not outlives and attributes_before == attributes_after


def _saved_storages_noted(table: StorageTable, packed: set[int]):
    """saved_tensors_hooks that add the storage id of every tensor autograd saves to `packed`, holding a
    detached alias as autograd holds the tensor (made outside the recorder: it is no op of the step). Autograd
    does not check a hooked tensor's version when backward reads it, so the unpack hook checks it as autograd
    does without hooks: a saved tensor written in place after it was saved stops the step, as eager's
    backward stops."""
    def pack(t: torch.Tensor):
        sid = table.lookup(t)
        if sid is not None:
            packed.add(sid)
        with torch.utils._python_dispatch._disable_current_modes():
            alias = t.detach()                  # shares t's version counter
        return alias, alias._version

    def unpack(saved) -> torch.Tensor:
        alias, version = saved
        if alias._version != version:
            raise RuntimeError(f"one of the variables needed for gradient computation has been modified by an "
                               f"inplace operation: a tensor of shape {list(alias.shape)} is at version "
                               f"{alias._version}; expected version {version} instead")
        return alias
    return torch.autograd.graph.saved_tensors_hooks(pack, unpack)


def _saved_and_held_into_backward(ops, table: StorageTable, packed: set[int]) -> None:
    """A storage autograd saved and released in backward is held into backward although no backward op may
    read it: a formula that needs only its input's shape still saves the input (`gather`'s backward makes
    zeros of the input's size, yet GatherBackward0 saves the input), so it counts as saved for backward
    (passes/saved.py reads `held_until_op`); the release itself was observed, so liveness is unchanged."""
    first_backward = next((i for i, d in enumerate(ops) if d.phase is Phase.BACKWARD), None)
    if first_backward is None:
        return
    for sid in packed:
        storage = table.get(sid)
        released = storage.released_after_op
        if released is not None and released >= first_backward and storage.held_until_op is None:
            table.update(sid, held_until_op=released)


def parameter_counts(model) -> tuple[int, int]:
    """(parameters, of which frozen: requires_grad=False); a quantized weight counts the weights it packs."""
    params = list(model.parameters())
    return sum(_weights(p) for p in params), sum(_weights(p) for p in params if not p.requires_grad)


def _weights(p) -> int:
    """The weights a parameter holds: a packed quantized weight (bitsandbytes' 4-bit `Params4bit`, two
    weights per byte) gives the shape it unpacks to in its `quant_state`."""
    shape = getattr(getattr(p, "quant_state", None), "shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def batch_tensors(batch) -> list[torch.Tensor]:
    """The tensors of a batch in the order its containers hold them: tuples, lists and dicts (as pytree
    flattens them) and dataclasses (their fields in order, as a forward reads a `Batch(tokens, targets)`),
    nested; the step's inputs, which exist before it."""
    out = []
    for leaf in tree_leaves(batch):
        if isinstance(leaf, torch.Tensor):
            out.append(leaf)
        elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
            out += batch_tensors([getattr(leaf, f.name) for f in dataclasses.fields(leaf)])
    return out


def _register_preexisting(recorder: StepRecorder, model, batch, opt) -> None:
    """What lives before the step; persistent unless the recorder sees it released during the step."""
    table = recorder.table
    for fqn, p in model.named_parameters():
        weights = _weights(p)
        recorder.add_existing(p, StorageRole.PARAMETER, name=fqn, frozen=not p.requires_grad,
                              weights=weights if weights != p.numel() else None)
        if p.grad is not None:
            recorder.add_existing(p.grad, StorageRole.GRADIENT, name=f"{fqn}.grad")
    for fqn, b in model.named_buffers():
        if b not in table:
            recorder.add_existing(b, StorageRole.BUFFER, name=fqn)
    for t, name in model_held_tensors(model):      # a quantized weight's scales and code maps
        if t not in table:                            # frozen model memory, but not parameters (not counted)
            recorder.add_existing(t, StorageRole.BUFFER, name=name)
    for i, t in enumerate(batch_tensors(batch)):
        if t not in table:
            recorder.add_existing(t, StorageRole.INPUT, name=f"input {i}")
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    for value, name in optimizer_held_tensors(opt, names):
        if value not in table:
            recorder.add_existing(value, StorageRole.OPTIMIZER_STATE, name=name)
    for m in model.modules():
        for _, label, value in attribute_tensors(m):
            if value not in table:
                recorder.add_existing(value, StorageRole.INTERMEDIATE, name=f"module attribute {label}")
