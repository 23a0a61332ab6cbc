"""The compiled policy from Inductor's own decisions: decomposition, partition, lowering, fusion, scheduling
order and buffer planning, run on the captured joint under fake tensors, without compiling any kernel.

  * `inductor_partition(joint, ...)`: the joint re-traced with Inductor's decomposition table (as
    torch.compile's AOT trace applies it), then `torch._inductor.compile_fx.partition_fn`: Inductor's
    joint-graph passes and `min_cut_rematerialization_partition(compiler="inductor")`. A view the capture
    recorded where eager's kernel made a tensor viewable, and that a decomposition's strides no longer allow,
    is re-traced as the reshape it comes from (a copy, as AOT's own trace makes it).
  * An op Inductor cannot lower as traced raises CaptureError naming the model's line.
  * `plan_graph(gm, fake_mode)`: one partitioned graph through Inductor's post-grad passes, `GraphLowering`,
    the `Scheduler` (vertical and horizontal fusion, `reorder_for_peak_memory`) and the wrapper's code
    generation, whose memory planning (allocation, in-place reuse, reuse of freed buffers, frees) is read
    from the wrapper's planned lines. The wrapper's Python source is generated but never loaded, so no
    C++ (or Triton) kernel is compiled. Returns a `GraphPlan`: the graph's fx nodes in the order of the
    kernels that compute them, and one `PlannedStorage` per allocation with the kernel step that allocates
    it and the step after which the wrapper drops its last reference.
  * `plan_forward_and_backward(forward, backward, ...)`: both graphs' plans; given a way to start work in a
    forked child, the forward is lowered there (after its post-grad passes here) while this process plans
    the backward, and its plan comes back by node names. Each graph has its own GraphLowering, so the plans
    are those made one after the other. Inductor is given one compile thread: with more it starts a pool
    of compile worker processes and sends them every kernel it generates, which a plan never runs.

The scheduler is the one of the graph's device: Inductor's CPU (C++) backend for CPU values, and its Triton
backend for a CUDA target, whose joint tracer.capture.triton_target retargets to fake cuda values in a
forked child where Inductor's CUDA path is made to run without a GPU (Triton's fusion, reductions split by
the GPU's SM count, its buffer reuse). Triton templates under max-autotune are not modelled.
Kernel-internal scratch of the CPU flash-attention kernels is sized by tracer.capture.kernel_scratch
(`GraphPlan.scratch`); that of other extern kernels (oneDNN, CUDA attention) is not modelled, nor are CUDA
graphs and `config.memory_planning` (off by default). Measured (benchmarks/compiled_vs_profiler.py, batch
2, seq 256): every phase peak equals a real compiled CPU step on five models, with and without checkpointed
blocks, except gpt2-debug's forward (8 B low) and a backward whose peak is an attention backward (256 B
over: the row sums it allocates on the second thread, which the profiler does not record).
"""
from __future__ import annotations

import contextlib

import dataclasses
import operator

import torch
import torch.fx as fx

from tracer.errors import CaptureError

# meta of the joint's nodes that the re-trace does not carry over by itself
_KEPT_META = ("seq_nr", "fwd_nn_module_stack", "nn_module_stack", "stack_trace", "partitioner_tag", "custom",
              "recompute", "ac_graph_id")


@dataclasses.dataclass(frozen=True)
class PlannedStorage:
    nbytes: int
    alloc_step: int                  # the kernel step whose buffer allocation (or extern call) makes it
    release_step: int | None         # the wrapper drops its last name after this step; None: a graph output
    name: str                        # Inductor's buffer name (the first of a reuse chain)


@dataclasses.dataclass(frozen=True)
class GraphPlan:
    gm: fx.GraphModule                                 # the graph Inductor lowered (after post-grad passes)
    order: tuple[fx.Node, ...]                         # call_function nodes (no getitems), in kernel order
    step_of: dict                                      # fx node -> kernel step
    storages: tuple[PlannedStorage, ...]
    storage_of: dict                                   # fx node -> per tensor output: storage index, placeholder, None
    input_release_step: dict                           # placeholder node -> step after which the graph frees it
    steps: int
    scratch: dict = dataclasses.field(default_factory=dict)   # fx node -> bytes of each kernel-internal scratch


def planned_peak_bytes(plan: GraphPlan) -> int:
    """The most bytes the graph's own allocations (`plan.storages`: not its inputs) hold at once, over its
    kernel steps; a storage counts from its allocating step through its release step."""
    held = [0] * (plan.steps + 1)
    for storage in plan.storages:
        last = plan.steps if storage.release_step is None else storage.release_step
        for step in range(storage.alloc_step, last + 1):
            held[step] += storage.nbytes
    return max(held, default=0)


def inductor_partition(joint: fx.GraphModule, fake_mode, *, num_fwd_outputs: int, static_inputs: list[int]):
    """(forward, backward) as torch.compile with Inductor partitions the joint."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import partition_fn
    from torch._inductor.virtualized import V
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    with _use_lazy_graph_module(True):      # see _planning
        decomposed = _decompose(joint, fake_mode)
        args = [p.meta.get("val") for p in decomposed.graph.find_nodes(op="placeholder")]
        with torch.no_grad(), tracing(TracingContext(fake_mode)), V.set_fake_mode(fake_mode):
            return partition_fn(decomposed, args, num_fwd_outputs=num_fwd_outputs,
                                static_lifetime_input_indices=static_inputs)


def _decompose(joint: fx.GraphModule, fake_mode) -> fx.GraphModule:
    """The joint with Inductor's decompositions applied, as AOT autograd traces it for Inductor; placeholders
    keep their names and descriptors (the partitioner reads `primals`/`tangents` from the names), nodes keep
    the meta of the joint node they come from."""
    import torch.fx.traceback as fx_traceback
    from torch._inductor.decomposition import select_decomp_table
    from torch.fx.experimental.proxy_tensor import make_fx

    placeholders = list(joint.graph.find_nodes(op="placeholder"))
    args = [p.meta.get("val") for p in placeholders]
    with fake_mode, fx_traceback.preserve_node_meta():
        gm = make_fx(_ReshapingInterpreter(joint).run, decomposition_table=select_decomp_table())(*args)
    for old, new in zip(placeholders, gm.graph.find_nodes(op="placeholder")):
        new.target = old.target
        new._rename(old.name)
        new.meta["desc"] = old.meta.get("desc")
    by_name = {node.name: node for node in joint.graph.nodes}
    for node in gm.graph.nodes:
        origin = next((by_name.get(src.name) for src in reversed(node.meta.get("from_node") or [])
                       if src.name in by_name), None)
        if origin is None:
            continue
        for key in _KEPT_META:
            if key in origin.meta:
                node.meta[key] = origin.meta[key]
            else:
                node.meta.pop(key, None)
    old_output = next(iter(joint.graph.find_nodes(op="output")))
    next(iter(gm.graph.find_nodes(op="output"))).meta["desc"] = old_output.meta.get("desc")
    gm.recompile()
    return gm


class _ReshapingInterpreter(fx.Interpreter):
    """Replays the joint, each view the strides no longer allow as the reshape it comes from. The capture chose a
    view where eager's kernels made a tensor viewable (a model's reshape or flatten, autograd's formulas); a
    decomposition may make that tensor with other strides (a layer norm's grad_input, transposed where eager's
    kernel returns it contiguous), and then the reshape copies, as AOT autograd's trace of the same code does
    for Inductor. A view that stays valid is replayed as it was recorded."""

    def call_function(self, target, args, kwargs):
        if target is torch.ops.aten.view.default and not _viewable(args[0], args[1]):
            target = torch.ops.aten.reshape.default
        return super().call_function(target, args, kwargs)


def _viewable(tensor: torch.Tensor, shape) -> bool:
    """Whether `tensor`'s sizes and strides can be viewed as `shape`, asked of a meta tensor outside the
    trace (so that a refused view leaves no node behind)."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        probe = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="meta")
        try:
            probe.view(shape)
        except (RuntimeError, ValueError):
            return False
    return True


def donated_inputs(forward: fx.GraphModule, backward: fx.GraphModule, num_fwd_outputs: int) -> list[int]:
    """The backward's inputs AOT autograd donates to it (saved activations no one else holds: the backward
    may reuse their buffers in place), as `collect_bw_donated_buffer_idxs` finds them (static shapes: no
    saved symints)."""
    from torch._functorch._aot_autograd.graph_compile import collect_fw_donated_buffer_idxs

    def vals(nodes):
        return [getattr(n, "meta", {}).get("val") for n in nodes]

    if not torch._functorch.config.donated_buffer:
        return []
    fw_outs = vals(next(iter(forward.graph.find_nodes(op="output"))).args[0])
    bw_outs = vals(next(iter(backward.graph.find_nodes(op="output"))).args[0])
    return collect_fw_donated_buffer_idxs(vals(forward.graph.find_nodes(op="placeholder")), fw_outs[:num_fwd_outputs],
                                          bw_outs, fw_outs[num_fwd_outputs:])


def inference_graph_passes(gm: fx.GraphModule, fake_mode) -> fx.GraphModule:
    """What Inductor runs on an inference graph before lowering it (no partition runs there): its joint-graph
    passes (constant folding, pattern rewrites), as `compile_fx` does for `is_inference`."""
    from torch._guards import TracingContext, tracing
    from torch._inductor.compile_fx import _recursive_joint_graph_passes
    from torch._inductor.virtualized import V

    devices = {v.device for p in gm.graph.find_nodes(op="placeholder")
               if isinstance(v := p.meta.get("val"), torch.Tensor)}
    with torch.no_grad(), tracing(TracingContext(fake_mode)), V.set_fake_mode(fake_mode):
        return _recursive_joint_graph_passes(gm, input_device=next(iter(devices), torch.device("cpu")))


def plan_graph(gm: fx.GraphModule, fake_mode, *, is_backward: bool, donated: list[int] = (),
               is_inference: bool = False) -> GraphPlan:
    """Inductor's plan for one partitioned graph (edited in place by the post-grad passes); `donated`: the
    indices of the backward's inputs AOT autograd donates (`donated_inputs`); `is_inference`: a graph with
    no backward (a compiled call under no_grad), after `inference_graph_passes`."""
    inputs = _example_inputs(gm)
    _post_grad_passes(gm, fake_mode, donated, is_inference)
    return _lowered_plan(gm, inputs, fake_mode, is_backward=is_backward, donated=donated, is_inference=is_inference)


def plan_forward_and_backward(forward: fx.GraphModule, backward: fx.GraphModule, fake_mode, *,
                              donated: list[int], start_apart=None) -> tuple[GraphPlan, GraphPlan]:
    """`plan_graph` of a partition's forward and backward. `start_apart(work)`: starts `work()` in a forked
    child and returns a handle whose `result()` waits for its value (triton_target.start_forked); when
    given, the forward is lowered and planned there while this process plans the backward (the two plans
    are independent: each is its own GraphLowering), and its plan comes back by node names, placed on this
    process's copy of the forward (the same graph: the child is forked after the post-grad passes)."""
    if start_apart is None:
        return (plan_graph(forward, fake_mode, is_backward=False),
                plan_graph(backward, fake_mode, is_backward=True, donated=donated))
    inputs = _example_inputs(forward)
    _post_grad_passes(forward, fake_mode, (), False)
    apart = start_apart(lambda: _by_node_names(_lowered_plan(forward, inputs, fake_mode, is_backward=False)))
    try:
        backward_plan = plan_graph(backward, fake_mode, is_backward=True, donated=donated)
    except BaseException:
        apart.abandon()
        raise
    return _on_nodes(apart.result(), forward), backward_plan


def _example_inputs(gm: fx.GraphModule) -> list:
    return [p.meta.get("val") for p in gm.graph.find_nodes(op="placeholder")]


@contextlib.contextmanager
def _planning(fake_mode, donated):
    import types
    from torch._guards import TracingContext, tracing
    from torch._inductor import config
    from torch._inductor.virtualized import V
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    context = TracingContext(fake_mode)
    context.fw_metadata = types.SimpleNamespace(bw_donated_idxs=list(donated))   # what get_donated_idxs reads
    # scalar C++ kernels only (simdlen 1): vectorising changes a kernel's code, not which buffers the wrapper
    # allocates, and halves the code generation time (same plans on every model of the benchmark). One
    # compile thread: with more, Inductor starts a pool of compile worker processes (each imports torch) and,
    # once it is up, sends every generated kernel there to be compiled, which a plan never needs. Lazy graph
    # modules, as torch.compile makes them: a graph module a pass builds or edits is read and lowered, never
    # run, so its Python code is generated only if something asks for it (about 1 s of a 10-block plan).
    with torch.no_grad(), tracing(context), V.set_fake_mode(fake_mode), \
            config.patch({"fx_graph_cache": False, "cpp.simdlen": 1, "compile_threads": 1}), \
            _use_lazy_graph_module(True):
        yield


def _post_grad_passes(gm: fx.GraphModule, fake_mode, donated, is_inference: bool) -> None:
    from torch._inductor.compile_fx import _recursive_post_grad_passes
    with _planning(fake_mode, donated):
        _recursive_post_grad_passes(gm, is_inference=is_inference)


def _lowered_plan(gm: fx.GraphModule, inputs: list, fake_mode, *, is_backward: bool, donated: list[int] = (),
                  is_inference: bool = False) -> GraphPlan:
    """The plan of `gm` after its post-grad passes: lowering, scheduling and the wrapper's code generation."""
    from torch._inductor.debug import DebugContext
    from torch._inductor.virtualized import V

    with _planning(fake_mode, donated):
        graph = _StepRecordingLowering(gm, example_inputs=inputs, shape_env=fake_mode.shape_env,
                                       graph_id=int(is_backward), is_inference=is_inference, is_backward=is_backward)
        with V.set_graph_handler(graph), V.set_extern_kernel_nodes([]), V.set_debug_handler(DebugContext()), \
                _real_rng_state_allowed(fake_mode):
            graph.run(*inputs)
            graph.codegen()
            plan = _read_plan(gm, graph)
    return dataclasses.replace(plan, scratch=_kernel_scratch(plan.order))


@dataclasses.dataclass(frozen=True)
class _NodeName:
    """An fx node of a plan made in another process, by its name (`_by_node_names`)."""
    name: str


def _by_node_names(plan: GraphPlan) -> GraphPlan:
    """`plan` without its graph, every fx node replaced by its `_NodeName`: plain data to send back."""
    return _nodes_mapped(plan, None, lambda v: _NodeName(v.name) if isinstance(v, fx.Node) else v)


def _on_nodes(plan: GraphPlan, gm: fx.GraphModule) -> GraphPlan:
    """A `_by_node_names` plan placed on `gm`'s nodes of those names."""
    nodes = {node.name: node for node in gm.graph.nodes}
    return _nodes_mapped(plan, gm, lambda v: nodes[v.name] if isinstance(v, _NodeName) else v)


def _nodes_mapped(plan: GraphPlan, gm, node) -> GraphPlan:
    """`plan` on `gm` with `node(value)` in place of every node it names."""
    return dataclasses.replace(
        plan, gm=gm, order=tuple(map(node, plan.order)),
        step_of={node(n): step for n, step in plan.step_of.items()},
        storage_of={node(n): tuple(map(node, keys)) for n, keys in plan.storage_of.items()},
        input_release_step={node(n): step for n, step in plan.input_release_step.items()},
        scratch={node(n): sizes for n, sizes in plan.scratch.items()})


def _kernel_scratch(order) -> dict:
    """fx node -> the scratch its extern kernel allocates while it runs (tracer.capture.kernel_scratch), on
    the run's intra-op thread count (a forked planning child's parent's)."""
    from tracer.capture.kernel_scratch import scratch_allocations
    from tracer.capture.triton_target import intra_op_threads
    threads = intra_op_threads()
    scratch = {node: scratch_allocations(node, threads) for node in order}
    return {node: sizes for node, sizes in scratch.items() if sizes}


@contextlib.contextmanager
def _real_rng_state_allowed(fake_mode):
    """A recomputed random op (checkpointing inside torch.compile) is lowered as a fallback of
    run_and_save_rng_state, whose example run reads the real CPU RNG state (a 5,056 B uint8 tensor) under
    the fake mode: real inputs are let through while lowering."""
    previous = fake_mode.allow_non_fake_inputs
    fake_mode.allow_non_fake_inputs = True
    try:
        yield
    finally:
        fake_mode.allow_non_fake_inputs = previous


class _StepRecordingLowering:
    """GraphLowering whose wrapper records, for every line it writes, the scheduler node being generated
    (the kernel step); built lazily so torch._inductor is imported only when the compiled policy runs."""

    def __new__(cls, *args, **kwargs):
        from torch._inductor.exc import LoweringException
        from torch._inductor.graph import GraphLowering

        class Lowering(GraphLowering):
            def run_node(self, n):
                # the interpreter drops env entries after their last use: keep every node's IR value
                try:
                    result = super().run_node(n)
                except LoweringException as exc:
                    raise _lowering_refused(n, exc) from None
                self.lowered_values[n] = result
                return result

            def init_wrapper_code(self, *a, **kw):
                super().init_wrapper_code(*a, **kw)
                self.line_steps = {}
                wrapper, write = self.wrapper_code, self.wrapper_code.writeline
                position: dict = {}

                def writeline(line):
                    node = self.scheduler.current_node if getattr(self, "scheduler", None) else None
                    if node is not None:
                        if not position:
                            position.update({id(n): i for i, n in enumerate(self.scheduler.nodes)})
                        self.line_steps[id(line)] = position.get(id(node))
                    write(line)

                wrapper.writeline = writeline

        lowering = Lowering(*args, **kwargs)
        lowering.lowered_values = {}
        return lowering


def _lowering_refused(node: fx.Node, exc: Exception) -> CaptureError:
    """Inductor cannot lower `node` (an op whose output size the step decides from values, such as boolean-mask
    indexing: the capture knows the rows, Inductor's lowering expects a size it cannot know): the compiled
    policy is refused, naming the op and the model's line."""
    from tracer.capture.source import loc_from_stack_trace
    loc = loc_from_stack_trace(node.meta.get("stack_trace"))
    where = f"{loc.short()} ({loc.code}): " if loc is not None else ""
    reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0].rstrip(": ")
    return CaptureError(f"{where}Inductor cannot lower {node.target} for the compiled policy ({reason})",
                        hint="torch.compile would not compile this op as traced (a graph break or an error); "
                             "use --policy eager, full or selective")


def _nbytes(graph, buffer) -> int:
    size = graph.sizevars.optimization_hint(graph.get_allocation_storage_size(buffer), fallback=0)
    return int(size) * buffer.get_dtype().itemsize


class _Names:
    """Python names of the wrapper's `call` function, each bound to a storage: the index of one this graph
    allocates, or the placeholder node of a graph input. A storage is released when its last name is
    deleted."""

    def __init__(self, placeholders: dict):
        self.storages: list[dict] = []
        self.bound: dict = dict(placeholders)
        self.storage_of_name: dict = dict(placeholders)     # every name ever bound (for the fx mapping)

    def allocate(self, name: str, nbytes: int, step: int) -> None:
        self.storages.append({"nbytes": nbytes, "alloc_step": step, "release_step": None, "name": name})
        self.bind(name, len(self.storages) - 1)

    def bind(self, name: str, key) -> None:
        self.storage_of_name.setdefault(name, key)
        self.bound[name] = key

    def delete(self, name: str):
        """Unbinds `name`; returns its storage when that was the storage's last name."""
        key = self.bound.pop(name, None)
        if key is None or key in self.bound.values():
            return None
        return key


def _read_plan(gm: fx.GraphModule, graph) -> GraphPlan:
    from torch._inductor import ir
    from torch._inductor.codegen import wrapper as w

    scheduler = graph.scheduler
    placeholder_names = {p.name: p for p in gm.graph.find_nodes(op="placeholder")}
    names = _Names(placeholder_names)
    input_release: dict = {}
    pending_tuples: dict[str, int] = {}                # multi-output extern call -> its step
    tuple_kernels: dict = {}                           # multi-output extern call -> its IR node
    claimed: dict[str, set] = {}                       # multi-output extern call -> index paths the wrapper names
    step = 0
    for line in graph.wrapper_code.lines:
        for candidate in (getattr(line, "scheduler_node_index", None), graph.line_steps.get(id(line))):
            if candidate is not None:
                step = candidate
                break
        if isinstance(line, w.AllocateLine):
            names.allocate(line.node.get_name(), _nbytes(graph, line.node), step)
        elif isinstance(line, w.ReuseLine):
            index = names.bound.get(line.node.get_name())
            if index is not None:
                if line.delete_old:
                    names.bound.pop(line.node.get_name(), None)
                names.bind(line.reused_as.get_name(), index)
        elif isinstance(line, w.ReinterpretLine):
            index = names.bound.get(line.node.get_name())
            if index is not None:
                names.bind(line.reused_as.get_name(), index)
        elif isinstance(line, (w.FreeIfNotReusedLine, w.FreeLine)):
            if isinstance(line, w.FreeIfNotReusedLine) and line.is_reused:
                continue
            name = line.node.get_name()
            released = names.delete(name)
            if isinstance(released, int):
                names.storages[released]["release_step"] = step
            elif released is not None:
                input_release[released] = step
            if name in pending_tuples:
                for nbytes in _unnamed_outputs(tuple_kernels[name], claimed.get(name, set())):
                    names.allocate(f"{name} output", nbytes, pending_tuples[name])
                    names.storages[-1]["release_step"] = step
                    names.bound.pop(f"{name} output")
            pending_tuples.pop(name, None)
        elif isinstance(line, w.ExternKernelAllocLine):
            node = line.node
            if isinstance(node.layout, ir.MultiOutputLayout):
                pending_tuples[node.get_name()] = step
                tuple_kernels[node.get_name()] = node
            elif node.get_inputs_that_alias_output():
                base = names.bound.get(node.inputs[0].get_name()) if node.inputs else None
                if base is not None:
                    names.bind(node.get_name(), base)
            else:
                names.allocate(node.get_name(), _nbytes(graph, node), step)
        elif isinstance(line, w.MultiOutputLine):
            claimed.setdefault(line.arg_name, set()).add(tuple(index for _, index in line.indices))
            if line.arg_name in pending_tuples and line.result_name not in names.bound:
                buffer = scheduler.name_to_buf[line.result_name].node
                names.allocate(line.result_name, _nbytes(graph, buffer), pending_tuples[line.arg_name])
    steps = len(scheduler.nodes)
    step_of = _kernel_steps(gm, scheduler)
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    order = tuple(sorted(step_of, key=lambda n: (step_of[n], position[n])))
    storage_of = {node: _output_storages(node, graph, names) for node in order}
    storages = tuple(PlannedStorage(**s) for s in names.storages)
    return GraphPlan(gm=gm, order=order, step_of=step_of, storages=storages, storage_of=storage_of,
                     input_release_step=input_release, steps=steps)


def _unnamed_outputs(kernel, claimed: set) -> list[int]:
    """Bytes of each tensor output of a multi-output extern kernel that the wrapper never names (attention's
    logsumexp when the backward recomputes it): it lives in the call's result tuple until the wrapper
    deletes the tuple. The outputs are the fake value of the fx node the kernel runs."""
    node = next((o for o in getattr(kernel, "origins", ()) or () if o.target is getattr(kernel, "op_overload", None)),
                None)
    if node is None:
        return []
    out = []

    def walk(value, path):
        if isinstance(value, torch.Tensor):
            if path not in claimed:
                out.append(value.untyped_storage().nbytes())
        elif isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                walk(item, path + (i,))

    walk(node.meta.get("val"), ())
    return out


def _kernel_steps(gm: fx.GraphModule, scheduler) -> dict:
    """fx node -> its kernel step: the first scheduler node whose IR comes from it (a node lowered to an
    extern kernel, such as attention's fallback or an extern matmul: that kernel's step, not the earlier
    kernels that copy its inputs into the layout it needs, which name it among their origins too, nor an
    earlier user's kernel: an extern kernel is never inlined), or else the first step of a user when that is
    earlier (a node Inductor inlines into its users' kernels and stores
    only later: gpt2's position `iota`, saved for backward by the forward's last kernel), never before the
    steps of its inputs; a node no kernel names (a view, a node Inductor folded away) runs at the step of
    its latest input."""
    from torch._inductor import ir
    first: dict = {}
    first_extern: dict = {}
    for i, snode in enumerate(scheduler.nodes):
        for sub in snode.get_nodes():
            kernel_op = getattr(sub.node, "op_overload", None) if isinstance(sub.node, ir.ExternKernel) else None
            for origin in getattr(sub.node, "origins", ()) or ():
                first.setdefault(origin, i)
                if kernel_op is not None and origin.target is kernel_op:
                    first_extern.setdefault(origin, i)
    first.update(first_extern)
    step_of: dict = {}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is operator.getitem:
            continue
        if node in first_extern:         # an extern kernel is never inlined into its users' kernels
            named = [first_extern[node]]
        else:
            named = [first[u] for u in _users_through_getitems(node) if u in first]
            if node in first:
                named.append(first[node])
        latest_input = max((step_of.get(a, 0) for a in _producers(node)), default=0)
        step_of[node] = max(min(named, default=0), latest_input)
    return step_of


def _users_through_getitems(node: fx.Node) -> list:
    users = []
    for user in node.users:
        users += _users_through_getitems(user) if user.target is operator.getitem else [user]
    return users


def _producers(node: fx.Node) -> list:
    """The call_function nodes whose outputs `node` reads (through getitems)."""
    out = []
    for arg in node.all_input_nodes:
        while arg.target is operator.getitem:
            arg = arg.args[0]
        out.append(arg)
    return out


def _output_storages(node: fx.Node, graph, names: _Names) -> tuple:
    """Per tensor output of the fx node (its fake value, flattened): the index of the storage Inductor keeps
    it in, the placeholder node of a graph input it views, or None when it is computed inside kernels and
    never stored."""
    value = graph.lowered_values.get(node)
    leaves = _ir_leaves(value)
    tensors = _tensor_count(node.meta.get("val"))
    if len(leaves) != tensors:
        leaves = (leaves + [None] * tensors)[:tensors]
    out = []
    for leaf in leaves:
        name = _buffer_name(leaf)
        if name is None or name in graph.removed_buffers:
            out.append(None)
        else:
            out.append(names.storage_of_name.get(name))
    return tuple(out)


def _ir_leaves(value) -> list:
    if isinstance(value, (list, tuple)):
        return [leaf for item in value for leaf in _ir_leaves(item)]
    return [value]


def _tensor_count(val) -> int:
    if isinstance(val, torch.Tensor):
        return 1
    if isinstance(val, (list, tuple)):
        return sum(_tensor_count(v) for v in val)
    return 0


def _buffer_name(value) -> str | None:
    """The buffer behind an IR value (through TensorBox, views and StorageBox), None when unrealized."""
    from torch._inductor import ir
    for _ in range(64):
        if isinstance(value, ir.TensorBox):
            value = value.data
        elif isinstance(value, ir.BaseView):
            value = value.data
        elif isinstance(value, ir.StorageBox):
            value = value.data
        else:
            break
    if isinstance(value, ir.Buffer):
        return value.get_name()
    return None
