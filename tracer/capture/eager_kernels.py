"""Ops whose traced decomposition allocates where the eager kernel does not; while a graph is traced,
they are made to run as eager runs them.

`dropout_as_in_eager()`: `dropout(x, p=0)` (or not training) returns `x` itself in eager (ATen's C++
kernel, CPU and CUDA), but tracing runs torch's Python decomposition of aten.dropout
(torch/_decomp/decompositions.py), which returns `x.clone()`: a copy eager never makes. Where autograd
saves both sides (T5's relu -> dropout -> wo saves the relu output and the copy) the prediction saved one
extra tensor per dropout. For the duration, dropout with p=0 or not training returns its input. With p > 0
in training, a CUDA target keeps torch's decomposition (`native_dropout`: a bool mask, as CUDA's fused kernel
saves), while a CPU target runs what ATen's CPU kernel runs (`_dropout_impl`, dropout.cpp: the fused kernel is
CUDA-only): `noise = empty_like(x).bernoulli_(1 - p); noise.div_(1 - p); x * noise`, so autograd saves the
noise in x's dtype (4 bytes an element in fp32, not the mask's 1), the in-place calls marked as in-place
(tracer/capture/inplace.py) so the noise is one storage, as in eager. Eager runs never reach these Python kernels (no Python dispatcher), so they
are unchanged. Limit: it swaps the op's Python kernels (`py_kernels`, a private torch structure), so a
torch upgrade may need it revisited; tests/accuracy/test_hf.py (T5) fails if it stops working.

`layouts_as_in_eager()`: ops whose fake kernel (torch's Python decomposition, which fake tensors run for
them) gives an output other strides than the eager kernel allocates it with (`CONTIGUOUS_IN_EAGER`). A
later `reshape` of that output is a view in eager but a copy in the trace (`clone` + `_unsafe_view`), one
tensor too many at the backward peak. For the duration, those outputs are made contiguous as eager's
kernels make them. Limit: it swaps entries of `torch._decomp.decomposition_table` (fake tensors run an
entry only when it is torch's own function, so the wrapper carries its name and module); fake tensors
cache an op's output metadata across modes, so the cache is emptied on the way in and out;
tests/capture/test_eager_kernels.py checks the table against real CPU kernels.

`upsampling_as_in_eager()`: F.interpolate's ops trace as ATen's fused kernels and their own backward (the
Python decomposition saves index tensors eager never makes). Limit: it sets aside the ops' `py_kernels`.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def dropout_as_in_eager(cpu: bool = False):
    from torch._C import DispatchKey
    op = torch.ops.aten.dropout.default
    keys = [k for k in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd) if k in op.py_kernels]
    saved = {k: op.py_kernels[k] for k in keys}

    def as_in_eager(decomposed):
        def dropout(input, p, train):
            if not train or p == 0 or input.numel() == 0:
                return input
            return _cpu_dropout(input, p) if cpu else decomposed(input, p, train)
        return dropout

    op.py_kernels.update({k: as_in_eager(saved[k]) for k in keys})
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.update(saved)
        op._dispatch_cache.clear()


# aten op -> positions of outputs that the eager kernel allocates contiguous whatever its inputs' strides;
# the decomposition gives them the strides of an input. native_layer_norm_backward: CPU and CUDA allocate
# grad_input with `empty_like(X, ..., MemoryFormat::Contiguous)` (layer_norm.cpp, layer_norm_kernel.cu); the
# decomposition's grad_input follows grad_out, which is transposed after a `permute` / `transpose` (PVT,
# SegFormer: `x.flatten(2).transpose(1, 2)` then LayerNorm).
CONTIGUOUS_IN_EAGER = {"aten.native_layer_norm_backward.default": (0,)}


@contextlib.contextmanager
def layouts_as_in_eager():
    import functools

    from torch._decomp import decomposition_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    saved = {}
    for name, positions in CONTIGUOUS_IN_EAGER.items():
        op = _op_named(name)
        if op not in decomposition_table:
            continue
        saved[op] = decomposition_table[op]

        def as_in_eager(*args, _decomposed=saved[op], _positions=positions, **kwargs):
            out = _decomposed(*args, **kwargs)
            return tuple(t.contiguous() if i in _positions and t is not None else t for i, t in enumerate(out))

        decomposition_table[op] = functools.wraps(saved[op])(as_in_eager)
    FakeTensorMode.cache_clear()         # metadata cached under torch's own layout would bypass the wrapper
    try:
        yield
    finally:
        decomposition_table.update(saved)
        FakeTensorMode.cache_clear()


def _upsample_ops() -> list:
    """aten's upsample / interpolate overloads with Python autograd-level kernels (torch/_decomp)."""
    from torch._C import DispatchKey
    out = []
    for name in dir(torch.ops.aten):
        if name.startswith(("upsample_", "_upsample_")) and not name.endswith("_backward"):
            packet = getattr(torch.ops.aten, name)
            out += [op for op in (getattr(packet, o) for o in packet.overloads())
                    if DispatchKey.Autograd in op.py_kernels or DispatchKey.CompositeImplicitAutograd in op.py_kernels]
    return out


@contextlib.contextmanager
def upsampling_as_in_eager():
    """F.interpolate's ops (upsample_nearest2d, upsample_bilinear2d, ...) run ATen's C++ kernels in eager,
    whose autograd node saves only sizes and whose backward is one `upsample_*_backward` kernel. Tracing runs
    torch's Python decomposition instead (index tensors from `arange`, `_unsafe_index`, an `index_put` into
    zeros in backward), which saves the index tensors. For the duration, the Python kernels are set aside,
    so the trace records the C++ op and its own backward, as eager runs them."""
    from torch._C import DispatchKey
    keys = (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd)
    saved = {op: {k: op.py_kernels[k] for k in keys if k in op.py_kernels} for op in _upsample_ops()}
    for op, kernels in saved.items():
        for key in kernels:
            del op.py_kernels[key]
        op._dispatch_cache.clear()
    try:
        yield
    finally:
        for op, kernels in saved.items():
            op.py_kernels.update(kernels)
            op._dispatch_cache.clear()


def _cpu_dropout(input, p: float):
    """ATen's CPU dropout (`_dropout_impl`): a noise tensor of the input's dtype, filled and scaled in place."""
    import torch.fx.traceback as fx_traceback
    from tracer.capture.inplace import INPLACE_CALL_KEY

    if p == 1:
        return input * torch.zeros((), dtype=input.dtype, device=input.device)
    noise = torch.empty_like(input)
    with fx_traceback.annotate({INPLACE_CALL_KEY: True}):
        noise = noise.bernoulli_(1 - p)
    with fx_traceback.annotate({INPLACE_CALL_KEY: True}):
        noise = noise.div_(1 - p)
    return input * noise


@contextlib.contextmanager
def kernels_as_in_eager(cpu: bool = False):
    """All of the above, while a graph is traced (`cpu`: for a CPU target)."""
    with dropout_as_in_eager(cpu), layouts_as_in_eager(), upsampling_as_in_eager():
        yield


def _op_named(name: str):
    """"aten.native_layer_norm_backward.default" -> the OpOverload."""
    namespace, packet, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload)


@contextlib.contextmanager
def unused_forward_ops_kept():
    """While AOTAutograd traces the joint graph, its dead-code elimination keeps forward ops whose results
    nothing reads: eager runs them all the same (a recurrent state updated after the last chunk and then
    dropped, `position_ids` a model never reads) and holds their outputs until their last Python reference."""
    real = torch.fx.Graph.eliminate_dead_code

    def eliminate_dead_code(graph, is_impure_node=None):
        impure = is_impure_node or (lambda node: node.is_impure())
        return real(graph, is_impure_node=lambda node: impure(node) or _forward_tensor_op(node))

    torch.fx.Graph.eliminate_dead_code = eliminate_dead_code
    try:
        yield
    finally:
        torch.fx.Graph.eliminate_dead_code = real


def _forward_tensor_op(node: torch.fx.Node) -> bool:
    """A forward op with a tensor output, other than a 0-dim bool: an unread 0-dim bool is a decomposition's
    value check (one_hot's `(x >= 0).all()`), which eager's fused kernel never makes as a tensor."""
    values = node.meta.get("val")
    values = values if isinstance(values, (tuple, list)) else (values,)
    return (node.op == "call_function" and node.meta.get("partitioner_tag") == "is_forward"
            and any(isinstance(v, torch.Tensor) and not (v.dim() == 0 and v.dtype == torch.bool) for v in values))


# aten op -> positions of inputs that eager autograd saves although the traced backward reads only their
# shape: index_add's source gradient is `grad.index_select(dim, index).expand_as(source)` (derivatives.yaml),
# so eager keeps `source` until its node runs; the traced backward has only an expand to its shape. gather's
# self gradient is `gather_backward(grad, self, dim, index)`, which reads only self's shape to make the zeros
# it scatters into, yet GatherBackward0 saves `self` (a relative-position bias gathered from a
# [batch, heads, q, extent] logits tensor keeps the whole logits tensor until backward).
SAVED_FOR_SHAPE = {"aten.index_add.default": (3,), "aten.gather.default": (0,)}


# aten op -> position of its `reduction` argument, for loss ops whose eager kernel returns a reduced (0-dim)
# result that keeps a storage of the elementwise loss's size (the inputs' broadcast shape, in the result's
# dtype). mse_loss and smooth_l1_loss are structured TensorIterator kernels: their meta step allocates the
# result at the broadcast shape, then the kernel computes the elementwise loss into a buffer of its own and
# reduces it into the result with mean_out / sum_out, which resize_ it to 0-dim; a smaller resize_ keeps the
# storage. soft_margin_loss and binary_cross_entropy compute into a result made like the input, then
# resize_ it to the reduced shape. Measured on CPU (torch 2.13, every dtype and broadcast tried): the loss
# holds the elementwise bytes for the rest of the step. The fake (meta) result is 4 bytes, so the prediction
# was low by the elementwise size in every phase. CUDA: mse_loss and smooth_l1_loss share the structured
# kernel and soft_margin_loss has one implementation for every device, so CUDA does the same; CUDA's
# binary_cross_entropy is a kernel of its own that also reduces into a result made like the input (read,
# not measured: no GPU was at hand). huber_loss, l1_loss, kl_div, nll_loss, BCE-with-logits and the other
# losses return a fresh 0-dim tensor (measured on CPU); tests/capture/test_eager_kernels.py checks this table
# against real CPU kernels.
REDUCED_KEEPS_ELEMENTWISE = {
    "aten.mse_loss.default": 2,
    "aten.smooth_l1_loss.default": 2,
    "aten.soft_margin_loss.default": 2,
    "aten.binary_cross_entropy.default": 3,
}
_REDUCTION_NONE = 0


def reduced_loss_nbytes(target: str, args: tuple, kwargs: dict, result_dtype: str) -> int | None:
    """The bytes eager's storage of this op's result holds, where `REDUCED_KEEPS_ELEMENTWISE` says it keeps
    the elementwise loss's storage; None for any other op or for reduction='none'. `args` hold the op's
    two loss inputs first, as objects with `shape`; `result_dtype` names the result's dtype ("float32"):
    mixed input dtypes promote, and the elementwise storage has the promoted dtype."""
    position = REDUCED_KEEPS_ELEMENTWISE.get(target)
    if position is None or len(args) < 2:
        return None
    reduction = args[position] if position < len(args) else kwargs.get("reduction", 1)
    if reduction == _REDUCTION_NONE:
        return None
    shape = torch.broadcast_shapes(tuple(args[0].shape), tuple(args[1].shape))   # the elementwise loss
    itemsize = getattr(torch, result_dtype).itemsize
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel * itemsize
