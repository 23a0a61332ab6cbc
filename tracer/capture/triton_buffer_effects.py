"""What generating a Triton kernel decides about buffers, decided without generating the kernel.

A compiled plan reads two things from Inductor's code generation: the wrapper's buffer lines (allocate,
reuse, free), which the scheduler writes around each kernel, and the buffers a fused kernel keeps in
registers and never stores (`V.graph.removed_buffers`, `inplaced_to_remove`). Generating a Triton kernel
(the coalescing analysis that picks its tiling, each node's loop body run through the kernel's code
printer with its index arithmetic and masks, the source rendered and hashed: 8 of the 20 profiled seconds
of llama-88m's backward plan) decides the second thing only through what the kernel's bookkeeping holds
when its body is done:

  - the buffers it stores (`store_buffer_names`), in body order;
  - the buffers it loads from memory (`args.input_buffers`): a load of a buffer stored earlier in the same
    kernel reads the stored value instead, unless a reduction loop was closed in between (an invalidated
    store, which the kernel must then keep);
  - the in-place pairs, decided before any body runs (`decide_inplace_update`, run as Inductor runs it);

after which the kernel's own `remove_kernel_local_buffers` removes what it stored and nobody outside reads.

`install()` has Triton's scheduling replay that bookkeeping for a kernel whose loop bodies only load,
compute, reduce and store: the loads and stores are listed in the bodies' graphs, in the order they run,
(a masked load's block where it is called) and go through the kernel's real argument table
(`kernel.args`), so aliasing of mutated names and in-place pairs resolve as in Inductor. Such a kernel gets
a comment line where its launch would be (the wrapper's memory planning reads only the buffer lines around
it). Every other kernel is generated as Inductor generates it: a body with an indirect load, a random seed,
a scan, sort or bucketize, an atomic store, an op not on `_PURE_OPS`, a node that mutates a buffer, a
cooperative or multi-kernel reduction, or a reduction loop closed before pointwise nodes that follow it (the
invalidated stores above).

`kernel_code_generated(True)` turns the replay off, for the tests that compare both ways. Not modelled
here: anything about the kernels' code (the plan never reads it).
"""
from __future__ import annotations

import contextlib
import itertools

# ops whose Triton code touches neither the kernel's argument table nor its store cache: arithmetic,
# comparisons, casts, constants, index values (an index value of a static shape names no size argument) and
# reductions (a cooperative one, which takes a workspace argument, is left to Inductor)
_PURE_OPS = frozenset({
    "abs", "acos", "acosh", "add", "and_", "asin", "asinh", "atan", "atan2", "atanh", "bitwise_and",
    "bitwise_left_shift", "bitwise_not", "bitwise_or", "bitwise_right_shift", "bitwise_xor", "ceil",
    "constant", "copysign", "cos", "cosh", "div", "eq", "erf", "erfc", "erfinv", "exp", "exp2", "expm1",
    "floor", "floordiv", "fma", "fmod", "ge", "gt", "hypot", "identity", "index_expr", "int_truediv", "isinf",
    "isnan", "le", "lgamma", "log", "log10", "log1p", "log2", "logical_and", "logical_not", "logical_or",
    "logical_xor", "lshift", "lt", "maximum", "minimum", "mod", "mul", "ne", "neg", "nextafter", "or_", "pow",
    "reciprocal", "relu", "remainder", "round", "rshift", "rsqrt", "sigmoid", "sign", "signbit", "sin", "sinh",
    "sqrt", "square", "sub", "tan", "tanh", "to_dtype", "to_dtype_bitcast", "truediv", "trunc", "truncdiv",
    "value_expr", "where", "xor", "reduction",
})
_MEMORY_OPS = frozenset({"load", "store", "store_reduction"})

_generated = {"all": False}
_counts = {"replayed": 0, "generated": 0}


@contextlib.contextmanager
def kernel_code_generated(generate: bool = True):
    """Within: every Triton kernel generated as Inductor generates it (`generate`), or replayed where it can
    be (the default after `install`)."""
    previous = _generated["all"]
    _generated["all"] = generate
    try:
        yield
    finally:
        _generated["all"] = previous


def kernel_counts() -> dict[str, int]:
    """How many kernels this process replayed and generated since `install()`."""
    return dict(_counts)


def install() -> None:
    """Triton's scheduling replays the buffer bookkeeping of the kernels it can (for this process: a forked
    planning child)."""
    from torch._inductor.codegen.triton import TritonScheduling
    if getattr(TritonScheduling.codegen_node, "_replays_bookkeeping", False):
        return
    generate = TritonScheduling.codegen_node
    names = itertools.count()

    def codegen_node(self, node):
        if not _generated["all"] and _replayed(self, node, names):
            _counts["replayed"] += 1
            return None
        _counts["generated"] += 1
        return generate(self, node)

    codegen_node._replays_bookkeeping = True
    TritonScheduling.codegen_node = codegen_node


def _replayed(scheduling, node, names) -> bool:
    """Replays the kernel of `node` (a fused or single scheduler node) when it qualifies, as the body of
    `SIMDScheduling.codegen_node_schedule` would run it; False (nothing done) when it does not."""
    from torch._inductor import config
    from torch._inductor.codegen.simd import DisableReduction, EnableReduction
    from torch._inductor.codegen.simd_kernel_features import SIMDKernelFeatures
    from torch._inductor.scheduler import BaseSchedulerNode
    from torch._inductor.virtualized import V

    if config.generate_intermediate_hooks or config.nan_asserts or config.warn_mix_layout \
            or config.cpp.enable_kernel_profile or config.triton.multi_kernel:
        return False
    nodes = [n for n in node.get_nodes() if n.get_name() not in scheduling.scheduler.removed_ops]
    if not nodes or not all(_plain_node(n) for n in nodes):
        return False
    _, (numel, rnumel) = max(nodes, key=lambda n: int(n.is_reduction())).group
    node_schedule = scheduling.generate_node_schedule(nodes, numel, rnumel)
    # the tiling changes only a replayed kernel's index arithmetic: whether its reduction loops (which
    # closes the loop before the pointwise nodes after it) follows from the nodes alone (persistent
    # reductions, `should_use_persistent_reduction`), so the coalescing analysis that picks it is not run
    coalesce = None
    features = SIMDKernelFeatures(node_schedule, numel, rnumel, coalesce)
    tiling, tiling_score = scheduling.get_tiling_and_scores(node_schedule, numel, rnumel, coalesce)
    kernels = scheduling.create_kernel_choices(features, [tiling], {"features": features,
                                                                  "tiling_scores": tiling_score})
    if len(kernels) != 1 or type(kernels[0]) is not scheduling.kernel_type:
        return False
    (kernel,) = kernels
    markers = any(n is DisableReduction or n is EnableReduction for n in node_schedule)
    if kernel.cooperative_reduction or (markers and kernel.range_trees[-1].is_loop):
        return False
    scheduler_nodes = [n for n in node_schedule if isinstance(n, BaseSchedulerNode)]
    with kernel:
        for n in scheduler_nodes:
            n.decide_inplace_update()
        stored: set[str] = set()
        for n in scheduler_nodes:
            _replay_loads_and_stores(kernel, n, stored, V.graph.removed_buffers)
    kernel.kernel_name = f"triton_unwritten_{next(names)}"
    with V.set_kernel_handler(kernel):
        for n in features.scheduler_nodes():
            n.mark_run()
    scheduling.codegen_comment(scheduler_nodes, kernel.kernel_name)
    V.graph.wrapper_code.writeline(f"# {kernel.kernel_name}: launched here; its code is not generated "
                                   "(a buffer plan reads no kernel code)")
    V.graph.removed_buffers |= kernel.removed_buffers
    V.graph.inplaced_to_remove |= kernel.inplaced_to_remove
    scheduling.free_buffers_in_scheduler()
    return True


def _plain_node(node) -> bool:
    """A scheduler node whose loop body only loads (masked or not), computes, reduces and stores, and
    mutates nothing."""
    from torch._inductor.scheduler import SchedulerNode
    if type(node) is not SchedulerNode or node.node is None or node.node.get_mutation_names():
        return False
    if any(out.get_mutations() for out in node.get_outputs()):
        return False
    body = getattr(node, "_body", None)
    if body is None:
        return False
    blocks = [body.root_block, *body.subblocks.values()]
    return all(_plain_op(op, body) for block in blocks for op in block.graph.nodes)


def _plain_op(op, body) -> bool:
    if op.op == "call_module":
        # an index, or a masked load's block (its loads run where the call is, through the same store cache)
        return str(op.target).startswith("get_index") or (
            str(op.target).startswith("masked_subblock") and op.target in body.subblocks)
    if op.op == "call_method":
        if op.target == "store":
            return _store_mode(op) is None
        return op.target in _PURE_OPS or op.target in _MEMORY_OPS
    return True


def _store_mode(op):
    return op.kwargs.get("mode", op.args[4] if len(op.args) > 4 else None)


def _replay_loads_and_stores(kernel, node, stored: set[str], removed_buffers) -> None:
    """The argument-table effects of running `node`'s body through the kernel's ops (CSEProxy's load,
    store and store_reduction, TritonKernel's load and store), in body order: a load of a name stored
    earlier in this kernel is served from the store cache and names no input."""
    _replay_block(kernel, node._body, node._body.root_block, stored, removed_buffers)


def _replay_block(kernel, body, block, stored: set[str], removed_buffers) -> None:
    for op in block.graph.nodes:
        if op.op == "call_module" and op.target in body.subblocks:
            _replay_block(kernel, body, body.subblocks[op.target], stored, removed_buffers)
            continue
        if op.op != "call_method" or op.target not in _MEMORY_OPS:
            continue
        name = op.args[1]
        if op.target == "load":
            if name not in stored:
                kernel.args.input(name)
            continue
        kernel.store_buffer_names.add(name)
        stored.add(name)
        if name not in removed_buffers:
            kernel.args.output(name)
