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
    Inductor's wrapper allocates and frees it (`convert._convert_planned`), writes into the inputs (the
    updated parameter and state) in place, and every buffer the call does not return is freed when it
    returns;
  * one trace and plan per distinct call signature (function, argument shapes, dtypes, subclasses and
    Python values), as dynamo compiles once per guard set; later calls bind the same plan to their inputs.

Run op by op instead, as eager runs it, with a note saying so: a compiled method or callable object
(`opt.step = torch.compile(opt.step)`: the optimizer's state is no argument of the call, so a trace would
take it as constants), and a call whose trace fails. Not modelled: a function compiled before
`make_optimizer` ran (at import) runs op by op without a note; graph breaks (fullgraph is assumed); CUDA
graphs (`mode="reduce-overhead"`).
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect

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


@contextlib.contextmanager
def compiled_calls_planned(recorder_of, fake_mode, calls: CompiledCalls):
    """`torch.compile` returns a `PlannedCompiledFunction` while this is active; `recorder_of()` gives the
    recorder the planned kernels are added to (None: the call runs its function eagerly, unrecorded)."""
    real_compile = torch.compile

    def planned_compile(model=None, **options):
        if model is None:                                   # @torch.compile(fullgraph=True) as a decorator
            return lambda fn: PlannedCompiledFunction(fn, recorder_of, fake_mode, calls)
        return PlannedCompiledFunction(model, recorder_of, fake_mode, calls)

    torch.compile = planned_compile
    try:
        yield calls
    finally:
        torch.compile = real_compile


class PlannedCompiledFunction:
    """A function as torch.compile runs it inside a recorded step: planned by Inductor, not run op by op."""

    def __init__(self, fn, recorder_of, fake_mode, calls: CompiledCalls):
        self.fn, self.recorder_of, self.fake_mode, self.calls = fn, recorder_of, fake_mode, calls

    def __call__(self, *args, **kwargs):
        recorder = self.recorder_of()
        if recorder is None:
            return self.fn(*args, **kwargs)
        from torch.utils._python_dispatch import _pop_mode_temporarily
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        if inspect.ismethod(self.fn) or not inspect.isfunction(self.fn):
            # a compiled method (`opt.step`) reads and writes its object's state, which is no argument of
            # the call: a trace would take it as constants and leave traced tensors in it
            self.calls.eager.setdefault(name, "a method or callable object: its state is not an argument")
            return self.fn(*args, **kwargs)
        with _pop_mode_temporarily() as popped:
            if popped is not recorder:
                raise RuntimeError("a compiled call ran under another dispatch mode than the step's recorder")
            try:
                gm, plan, inputs = self._plan(args, kwargs)
            except Exception as exc:             # noqa: BLE001 - said in the report, then run op by op
                self.calls.eager.setdefault(name, f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
                gm = None
            if gm is not None:
                outputs = _run_graph(gm, inputs)
        if gm is None:
            return self.fn(*args, **kwargs)      # recorded op by op, as eager runs it
        self.calls.calls[name] = self.calls.calls.get(name, 0) + 1
        _record_plan(recorder, gm, plan, inputs, outputs)
        return outputs if outputs else None

    def _plan(self, args, kwargs):
        """(graph, plan, flat inputs): traced and planned once per signature; the cached graph keeps no
        reference to a call's tensors (a gradient would never be freed)."""
        inputs = flat_inputs(args)
        key = (getattr(self.fn, "__code__", self.fn), _signature(inputs), tuple(sorted(kwargs)))
        if key not in self.calls.plans:
            gm, traced_inputs = self._trace(args, kwargs)
            if _signature(traced_inputs) != _signature(inputs):
                raise RuntimeError(f"AOT flattened the compiled call's inputs otherwise than expected: "
                                   f"{_signature(traced_inputs)} against {_signature(inputs)}")
            from tracer.capture.inductor_plan import plan_graph
            plan = plan_graph(gm, self.fake_mode, is_backward=False)
            self._forget_example_inputs(gm)
            self.calls.plans[key] = (gm, plan)
        gm, plan = self.calls.plans[key]
        return gm, plan, inputs

    def _trace(self, args, kwargs):
        from torch._functorch.aot_autograd import aot_function
        from torch._inductor.decomposition import select_decomp_table

        traced = []

        def keep(gm, example_inputs):
            traced.append((gm, list(example_inputs)))
            return gm

        fn = self.fn
        with self.fake_mode, torch.no_grad():
            aot_function(lambda *a: fn(*a, **kwargs), fw_compiler=keep, decompositions=select_decomp_table(),
                         keep_inference_input_mutations=True)(*args)
        return traced[0]

    def _forget_example_inputs(self, gm: fx.GraphModule) -> None:
        with self.fake_mode:
            for placeholder in gm.graph.find_nodes(op="placeholder"):
                val = placeholder.meta.get("val")
                if isinstance(val, torch.Tensor):
                    placeholder.meta["val"] = torch.empty_strided(val.shape, val.stride(), dtype=val.dtype)


def flat_inputs(args) -> list:
    """The call's arguments as AOT autograd passes them to the graph: pytree leaves in order, a tensor
    subclass replaced by its inner tensors (`__tensor_flatten__`, recursively), other values kept."""
    from torch.utils._pytree import tree_leaves
    out: list = []

    def add(value):
        if isinstance(value, torch.Tensor) and hasattr(type(value), "__tensor_flatten__") \
                and type(value) is not torch.Tensor and not isinstance(value, torch.nn.Parameter) \
                and not _is_fake(value):
            names, _ = value.__tensor_flatten__()
            for name in names:
                add(getattr(value, name))
        else:
            out.append(value)

    for leaf in tree_leaves(list(args)):
        add(leaf)
    return out


def _is_fake(value) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(value, FakeTensor)


def _signature(inputs: list) -> tuple:
    return tuple((tuple(x.shape), tuple(x.stride()), x.dtype) if isinstance(x, torch.Tensor) else repr(x)
                 for x in inputs)


def _output_nodes(gm: fx.GraphModule) -> list:
    found: list = []
    fx.node.map_arg(next(iter(gm.graph.find_nodes(op="output"))).args, found.append)
    return found


def _run_graph(gm: fx.GraphModule, inputs: list) -> tuple:
    """The graph's tensor outputs on the fake inputs (what the call returns to the step); none when it
    returns nothing (an optimizer update only writes into its inputs)."""
    if not _output_nodes(gm):
        return ()
    result = gm(*inputs)
    return tuple(r for r in (result if isinstance(result, (list, tuple)) else (result,)) if r is not None)


def _record_plan(recorder, gm: fx.GraphModule, plan, inputs: list, outputs: tuple) -> None:
    """The plan's kernels appended to the recorder's ops over its table; buffers the call does not return
    are freed when it returns."""
    from tracer.capture.convert import _convert_planned

    if recorder.ops_offset:
        raise RuntimeError("compiled calls are recorded over a table whose ops start at 0")
    values: dict = {}
    for placeholder, value in zip(gm.graph.find_nodes(op="placeholder"), inputs):
        values[placeholder] = (recorder.table.value(value, recorder.ensure_tracked(value))
                               if isinstance(value, torch.Tensor) else value)
    phase, source, module = recorder.site()
    start = len(recorder.ops)
    made = _convert_planned(plan, recorder.table, values, {}, recorder.ops, (None, None), phase=phase)
    for op in recorder.ops[start:]:
        op.compiled_region = True
        if op.source is None:
            op.source, op.module = source, module
    returned = set()
    for node, tensor in zip(_output_nodes(gm), outputs):
        sid = values[node].storage_id
        returned.add(sid)
        recorder.table.alias(tensor, sid)
        recorder.track_release(tensor, sid)
    for sid in made:
        if sid not in returned and recorder.table.get(sid).released_after_op is None:
            recorder.table.update(sid, released_after_op=len(recorder.ops) - 1)
