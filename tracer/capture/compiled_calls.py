"""Compiled calls inside a recorded stretch (the optimizer step): `torch.compile(fn)(...)` planned as Inductor
plans it, not run op by op.

Optimizers compile their per-parameter update (torchao's `AdamW8bit`, `AdamW4bit`, `AdamWFp8`, `_AdamW` call
`torch.compile(single_param_adam, fullgraph=True)` on every parameter in `step()`), and users compile
`opt.step` itself. Inside the recorder (capture/recorder.py) such a call is one compiled region:

  * `torch.compile` made while the optimizer is built or stepped returns a `PlannedCompiledFunction`;
    calling it traces `fn` on the call's fake arguments with AOT autograd (inference, Inductor's
    decompositions, input mutations kept in the graph), which flattens tensor subclasses into their inner
    tensors (a quantized moment's codes, scales and code map) as torch.compile does;
  * Inductor plans that graph (tracer.capture.inductor_plan, its C++ backend: exact for a CPU target; for a
    CUDA target the report says Triton's fusion of the update is not planned); the graph's kernels become
    the recorder's ops, each buffer allocated and freed where
    Inductor's wrapper allocates and frees it (`convert.convert_planned`), writes into the inputs (the
    updated parameter and state) in place, and every buffer the call does not return is freed when it
    returns;
  * one trace and plan per distinct call signature (function, argument shapes, dtypes, subclasses and
    Python values), as dynamo compiles once per guard set; later calls bind the same plan to their inputs.

Run op by op instead, as eager runs it, with a note saying so: a compiled method or callable object
(`opt.step = torch.compile(opt.step)`: the optimizer's state is no argument of the call, so a trace would
take it as constants), a call whose trace fails, and a function torch.compile made before the capture
began (a library that compiles at import: dynamo's per-call stance hook runs it eagerly while a step is
recorded). Not modelled: graph breaks (fullgraph is assumed); CUDA graphs (`mode="reduce-overhead"`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import sys

import torch
import torch.fx as fx



@dataclasses.dataclass
class CompiledCalls:
    """What the recorded stretch compiled: per function, its calls and distinct plans."""
    calls: dict[str, int] = dataclasses.field(default_factory=dict)          # qualified name -> calls
    plans: dict[tuple, tuple] = dataclasses.field(default_factory=dict)      # signature -> (gm, plan)
    eager: dict[str, str] = dataclasses.field(default_factory=dict)          # name -> why it was not planned

    def notes(self, backend: str) -> tuple[str, ...]:
        out = []
        if self.calls:
            called = ", ".join(f"{name} (x{count})" for name, count in self.calls.items())
            out.append(f"compiled calls in the optimizer step planned by Inductor's {backend} plan "
                       f"({len(self.plans)} distinct graph(s)), each buffer where its wrapper allocates and "
                       f"frees it: {called}")
        out += [f"compiled call {name} in the optimizer step could not be traced for Inductor's plan ({why}): "
                "run op by op as eager runs it, so its temporaries are eager's, not the compiled kernels'"
                for name, why in self.eager.items()]
        return tuple(out)


@dataclasses.dataclass
class _Window:
    """The recording that compiled calls go to now: its recorder (None between recorded stretches), fake
    mode and what it compiled."""
    recorder_of: object
    fake_mode: object
    calls: CompiledCalls


_CURRENT: list = [None]          # the active _Window: compiled functions made in an earlier one consult it


@contextlib.contextmanager
def compiled_calls_planned(recorder_of, fake_mode, calls: CompiledCalls):
    """While active, every compiled function called in a recorded stretch is planned into the recorder
    `recorder_of()` returns (None: not recording, the function runs eagerly, unrecorded):
      * `torch.compile(fn)` returns a `PlannedCompiledFunction` (torchao compiles its update at each call);
      * functions torch.compile made before (a library that compiles at import) are swapped for one in the
        modules that hold them, and put back after;
      * any other compiled frame (a compiled method elsewhere) runs op by op under dynamo's "force_eager"
        stance, named in the report."""
    import torch._dynamo.eval_frame as eval_frame
    real_compile, real_stance = torch.compile, eval_frame._callback_from_stance

    def planned_compile(model=None, **options):
        if model is None:                                   # @torch.compile(fullgraph=True) as a decorator
            return lambda fn: PlannedCompiledFunction(fn, real_compile, options)
        return PlannedCompiledFunction(model, real_compile, options)

    def named_when_recorded(callback):
        if recorder_of() is not None and callback not in (False, None):
            fn = sys._getframe(1).f_locals.get("fn")        # dynamo's wrapper's original function
            if fn is not None:
                calls.eager.setdefault(getattr(fn, "__qualname__", repr(fn)),
                                       "a compiled frame not reachable as a module's function")
        return real_stance(callback)

    previous, _CURRENT[0] = _CURRENT[0], _Window(recorder_of, fake_mode, calls)
    swapped = _swap_compiled_module_functions(real_compile)
    torch.compile = planned_compile
    eval_frame._callback_from_stance = named_when_recorded
    try:
        with torch.compiler.set_stance("force_eager"):
            yield calls
    finally:
        torch.compile = real_compile
        eval_frame._callback_from_stance = real_stance
        for namespace, name, value in swapped:
            namespace[name] = value
        _CURRENT[0] = previous


def _swap_compiled_module_functions(real_compile) -> list:
    """Every function of an imported module (torch's own excepted) that torch.compile made, replaced by a
    `PlannedCompiledFunction` of the function it compiled; returns (module dict, name, original)."""
    swapped = []
    for module_name, module in list(sys.modules.items()):
        if module_name == "torch" or module_name.startswith(("torch.", "tracer")):
            continue
        namespace = getattr(module, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for name, value in list(namespace.items()):
            original = getattr(value, "_torchdynamo_orig_callable", None) if callable(value) else None
            if original is not None and inspect.isfunction(value):
                swapped.append((namespace, name, value))
                namespace[name] = PlannedCompiledFunction(original, real_compile, {}, compiled=value)
    return swapped


class PlannedCompiledFunction:
    """A function as torch.compile runs it inside a recorded step: planned by Inductor, not run op by op;
    outside one, torch.compile's own function (made on first use)."""

    def __init__(self, fn, real_compile, options: dict, compiled=None):
        self.fn, self.real_compile, self.options, self._compiled = fn, real_compile, options, compiled
        functools.update_wrapper(self, fn, updated=())

    def __call__(self, *args, **kwargs):
        from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily
        window = _CURRENT[0]
        recorder = window.recorder_of() if window is not None else None
        if recorder is None:
            if window is not None:
                return self.fn(*args, **kwargs)  # building the optimizer: nothing is recorded, nothing compiled
            if self._compiled is None:
                self._compiled = self.real_compile(self.fn, **self.options)
            return self._compiled(*args, **kwargs)
        if _get_current_dispatch_mode() is not recorder:
            return self.fn(*args, **kwargs)      # inside another compiled call's trace: inlined, as dynamo does
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        calls = window.calls
        if inspect.ismethod(self.fn) or not inspect.isfunction(self.fn):
            # a compiled method (`opt.step`) reads and writes its object's state, which is no argument of
            # the call: a trace would take it as constants and leave traced tensors in it
            calls.eager.setdefault(name, "a method or callable object: its state is not an argument")
            return self.fn(*args, **kwargs)
        with _pop_mode_temporarily():
            try:
                gm, plan, inputs, run = self._plan(args, kwargs, window)
            except Exception as exc:             # noqa: BLE001 - said in the report, then run op by op
                calls.eager.setdefault(name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                gm = None
            if gm is not None:
                result = run(*args, *kwargs.values())   # the graph on the fake inputs: the call's own outputs
        if gm is None:
            return self.fn(*args, **kwargs)      # recorded op by op, as eager runs it
        calls.calls[name] = calls.calls.get(name, 0) + 1
        _record_plan(recorder, gm, plan, inputs, result)
        return result

    def _plan(self, args, kwargs, window: _Window):
        """(graph, plan, flat inputs, the AOT-compiled callable): traced and planned once per signature, on
        stand-ins of the call's tensors, so that nothing cached holds a call's tensor (the recorder sees a
        tensor die only when its last reference goes: a gradient or a temporary would never be freed)."""
        # keyword arguments are arguments of the graph too (a call made with keywords only differs from
        # the last only there), in the order the call gives them
        inputs = flat_inputs([*args, *kwargs.values()])
        key = (getattr(self.fn, "__code__", self.fn), _signature(inputs), tuple(kwargs))
        plans = window.calls.plans
        if key not in plans:
            stand_ins = _stand_ins([*args, *kwargs.values()], window.fake_mode)
            gm, traced_inputs, run = self._trace(stand_ins, tuple(kwargs), window.fake_mode)
            if _signature(traced_inputs) != _signature(inputs):
                raise RuntimeError(f"AOT flattened the compiled call's inputs otherwise than expected: "
                                   f"{_signature(traced_inputs)} against {_signature(inputs)}")
            from tracer.capture.inductor_plan import inference_graph_passes, plan_graph
            gm = inference_graph_passes(gm, window.fake_mode)
            plan = plan_graph(gm, window.fake_mode, is_backward=False, is_inference=True)
            plans[key] = (gm, plan, run)
        gm, plan, run = plans[key]
        return gm, plan, inputs, run

    def _trace(self, args, keywords: tuple, fake_mode):
        """AOT autograd's inference graph of the call; the last len(keywords) of `args` are passed by those
        keywords."""
        from torch._functorch.aot_autograd import aot_function
        from torch._inductor.decomposition import select_decomp_table

        traced = []

        def keep(gm, example_inputs):
            traced.append((gm, list(example_inputs)))
            return gm

        fn = self.fn
        with fake_mode, torch.no_grad():
            positional = len(args) - len(keywords)

            def call(*a):
                return fn(*a[:positional], **dict(zip(keywords, a[positional:])))

            run = aot_function(call, fw_compiler=keep, decompositions=select_decomp_table(),
                               keep_inference_input_mutations=True)
            run(*args)
        return traced[0][0], traced[0][1], run


def _stand_ins(args, fake_mode):
    """`args` with every tensor replaced by a fresh fake tensor of its size, strides and dtype (a subclass
    rebuilt through `__tensor_unflatten__` from stand-ins of its inner tensors); tensors that share a storage
    share their stand-ins' storage, so the trace sees the same aliasing."""
    from torch.utils._pytree import tree_map

    storages: dict = {}
    with fake_mode:
        return tree_map(functools.partial(_stand_in, storages=storages), list(args))


def _stand_in(value, storages: dict):
    """`_stand_ins`' replacement of one value (a module-level function: a nested one calling itself would be
    a reference cycle holding the stand-ins until a garbage collection)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    from tracer.capture.storages import storage_key

    if is_traceable_wrapper_subclass(value):
        names, context = value.__tensor_flatten__()
        inner = {name: _stand_in(getattr(value, name), storages) for name in names}
        return type(value).__tensor_unflatten__(inner, context, value.size(), value.stride())
    if not isinstance(value, torch.Tensor):
        return value
    key = storage_key(value)
    if key not in storages:
        storages[key] = torch.empty(value.untyped_storage().nbytes(), dtype=torch.uint8).untyped_storage()
    fresh = torch.empty(0, dtype=value.dtype).set_(storages[key], value.storage_offset(), value.shape,
                                                  value.stride())
    return fresh.requires_grad_(value.requires_grad) if value.is_floating_point() else fresh


def flat_inputs(args) -> list:
    """The call's arguments as AOT autograd passes them to the graph: pytree leaves in order, a tensor
    subclass replaced by its inner tensors (`__tensor_flatten__`, recursively), other values kept."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    from torch.utils._pytree import tree_leaves
    out: list = []
    # an explicit stack, not a nested function calling itself: that is a reference cycle, which would hold
    # the call's tensors (`out`) until a garbage collection, past the moment the step frees them
    stack = list(reversed(tree_leaves(list(args))))
    while stack:
        value = stack.pop()
        if is_traceable_wrapper_subclass(value):
            stack += [getattr(value, name) for name in reversed(value.__tensor_flatten__()[0])]
        else:
            out.append(value)
    return out


def _signature(inputs: list) -> tuple:
    return tuple((tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                 for x in inputs)


def _output_nodes(gm: fx.GraphModule) -> list:
    found: list = []
    fx.node.map_arg(next(iter(gm.graph.find_nodes(op="output"))).args, found.append)
    return found


def _record_plan(recorder, gm: fx.GraphModule, plan, inputs: list, result) -> None:
    """The plan's kernels appended to the recorder's ops over its table; the call's tensor outputs take the
    storages the plan keeps them in, and every other buffer is freed when the call returns."""
    from torch.utils._pytree import tree_leaves

    from tracer.capture.convert import convert_planned

    if recorder.ops_offset:
        raise RuntimeError("compiled calls are recorded over a table whose ops start at 0")
    values: dict = {}
    for placeholder, value in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        values[placeholder] = (recorder.table.value(value, recorder.ensure_tracked(value))
                               if isinstance(value, torch.Tensor) else value)
    phase, source, module = recorder.site()
    start = len(recorder.ops)
    # the caller holds the call's arguments until it returns and past it: their release is the finalizer's
    made = convert_planned(plan, recorder.table, values, {}, recorder.ops, (None, None), phase=phase,
                           releasable=set())
    for op in recorder.ops[start:]:
        op.compiled_region = True
        if op.source is None:
            op.source, op.module = source, module
    returned = set()
    tensors = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)]
    nodes = [n for n in _output_nodes(gm) if isinstance(n.meta.get("val"), torch.Tensor)]
    for node, tensor in zip(nodes, tensors) if len(nodes) == len(tensors) else ():
        sid = values[node].storage_id
        if sid in made:
            returned.add(sid)
            recorder.table.alias(tensor, sid)
            recorder.track_release(tensor, sid)
    for sid in made:
        if sid not in returned and recorder.table.get(sid).released_after_op is None:
            recorder.table.update(sid, released_after_op=len(recorder.ops) - 1)
