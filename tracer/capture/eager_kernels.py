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
them) gives an output other strides than the eager kernel allocates it with (`CONTIGUOUS_IN_EAGER`;
`SUGGESTED_FORMAT_IN_EAGER`: batch norm's, in its input's suggested memory format). A
later `reshape` of that output is a view in eager but a copy in the trace (`clone` + `_unsafe_view`), one
tensor too many at the backward peak. For the duration, those outputs are made contiguous as eager's
kernels make them. Limit: it swaps entries of `torch._decomp.decomposition_table` (fake tensors run an
entry only when it is torch's own function, so the wrapper carries its name and module); fake tensors
cache an op's output metadata across modes, so the cache is emptied on the way in and out;
tests/capture/test_eager_kernels.py checks the table against real CPU kernels. The op-by-op rung runs
under it too (its fake kernels are the same decompositions).

`nn.Dropout(inplace=True)` is aten.dropout_, whose C++ kernel on every device is `_dropout_impl<inplace>` (the
noise made and scaled in place, then `x.mul_(noise)`); it has no Python kernel, so the trace recorded the
noise's in-place calls as new tensors. For the duration it has one making the same calls, each marked in place.

`norm_statistics_as_in_eager(cpu)`: a layer norm's or group norm's saved mean and rstd in the dtype the
target's kernel gives them (fp32 for a 16-bit layer norm input on CUDA; fp32 when the parameters are fp32,
as under autocast), where torch's fake kernels give a CPU tensor's the input's dtype. The op-by-op rung runs
under it too.

`collective_waits_as_in_eager()`: a functional collective's `wait_tensor` returns the tensor it waits on
(the C++ kernel waits and hands its input back), where its fake kernel makes a new one: under fake tensors
every all-to-all's result counted twice while both were live. The op-by-op rung runs under it too.

`upsampling_as_in_eager()`: F.interpolate's ops trace as ATen's fused kernels and their own backward (the
Python decomposition saves index tensors eager never makes). Limit: it sets aside the ops' `py_kernels`.
"""
from __future__ import annotations

import contextlib
import functools
import itertools

import torch


@contextlib.contextmanager
def dropout_as_in_eager(cpu: bool = False):
    def as_in_eager(decomposed):
        def dropout(input, p, train):
            if not train or p == 0 or input.numel() == 0:
                return input
            return _cpu_dropout(input, p) if cpu else decomposed(input, p, train)
        return dropout

    with _autograd_kernels_replaced(torch.ops.aten.dropout.default, as_in_eager), _inplace_dropout_as_in_eager():
        yield


@contextlib.contextmanager
def _inplace_dropout_as_in_eager():
    """`F.dropout(x, p, inplace=True)` (`nn.Dropout(inplace=True)`: torchvision's MobileNetV3 and MNASNet
    heads) is aten.dropout_, whose C++ kernel on CPU and CUDA alike is `_dropout_impl<inplace>`: the noise
    made and scaled in place, then `x.mul_(noise)`. It has no Python kernel, so the trace recorded the noise's
    `bernoulli_` and `div_` as new tensors (two more of x's size); for the duration it has one that makes
    the same calls, each marked in place."""
    from torch._C import DispatchKey
    op = torch.ops.aten.dropout_.default
    key = DispatchKey.CompositeImplicitAutograd
    if key in op.py_kernels:
        yield
        return

    def dropout_(input, p, train):
        if not train or p == 0 or input.numel() == 0:
            return input
        return _in_place(torch.Tensor.mul_, input, _cpu_dropout_noise(input, p))

    op.py_kernels[key] = dropout_
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        del op.py_kernels[key]
        op._dispatch_cache.clear()


@contextlib.contextmanager
def _autograd_kernels_replaced(op, as_in_eager):
    """For the duration, `op`'s Python kernels at the autograd level (the decomposition tracing runs) are
    `as_in_eager(torch's kernel)`."""
    from torch._C import DispatchKey
    keys = [k for k in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd) if k in op.py_kernels]
    saved = {k: op.py_kernels[k] for k in keys}
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
# aten op -> (positions of outputs the eager kernel allocates in an input's suggested memory format, that
# input's position among the op's arguments). Batch norm's kernels on CPU and CUDA (cuDNN's too) allocate
# their output and grad_input with `empty_like(input, input.suggest_memory_format())` (Normalization.cpp,
# batch_norm.cu, cudnn/BatchNorm.cpp): channels-last only for a 4-d or 5-d channels-last input, contiguous
# for every other layout; the decompositions keep a transposed input's strides (a `BatchNorm1d` over
# `x.transpose(1, 2)`, as sequence models normalise channels), so the `transpose` back and a linear after it
# copied in eager and not in the trace: a tensor of the input's size missing from the saved bytes.
SUGGESTED_FORMAT_IN_EAGER = {
    "aten.native_batch_norm.default": ((0,), 0),
    "aten._native_batch_norm_legit.default": ((0,), 0),
    "aten._native_batch_norm_legit.no_stats": ((0,), 0),
    "aten._native_batch_norm_legit_functional.default": ((0,), 0),
    "aten._native_batch_norm_legit_no_training.default": ((0,), 0),
    "aten._batch_norm_with_update.default": ((0,), 0),
    "aten._batch_norm_with_update_functional.default": ((0,), 0),
    "aten._batch_norm_no_update.default": ((0,), 0),
    "aten.cudnn_batch_norm.default": ((0,), 0),
    "aten.native_batch_norm_backward.default": ((0,), 1),
    "aten.batch_norm_backward.default": ((0,), 1),
    "aten.cudnn_batch_norm_backward.default": ((0,), 0),
}


@contextlib.contextmanager
def layouts_as_in_eager():
    import functools

    from torch._decomp import decomposition_table
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._prims_common import suggest_memory_format
    saved = {}
    rules = {**{name: (positions, None) for name, positions in CONTIGUOUS_IN_EAGER.items()},
             **SUGGESTED_FORMAT_IN_EAGER}
    for name, (positions, input_position) in rules.items():
        op = _op_named(name)
        if op not in decomposition_table:
            continue
        saved[op] = decomposition_table[op]

        def as_in_eager(*args, _decomposed=saved[op], _positions=positions, _input=input_position, **kwargs):
            out = _decomposed(*args, **kwargs)
            layout = torch.contiguous_format if _input is None else suggest_memory_format(args[_input])
            return tuple(t.contiguous(memory_format=layout) if i in _positions and t is not None else t
                         for i, t in enumerate(out))

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
    return input * _cpu_dropout_noise(input, p)


def _cpu_dropout_noise(input, p: float):
    """`_dropout_impl`'s noise: `empty_like(x).bernoulli_(1 - p).div_(1 - p)`, each call in place, marked
    with an id of its own (the model's call may itself be marked in place as a whole: `inplace=True`); at
    p = 1, a 0-dim zero."""
    if p == 1:
        return torch.zeros((), dtype=input.dtype, device=input.device)
    noise = _in_place(torch.Tensor.bernoulli_, torch.empty_like(input), 1 - p)
    return _in_place(torch.Tensor.div_, noise, 1 - p)


@contextlib.contextmanager
def lstm_as_in_eager():
    """nn.LSTM on a CPU target: eager's `at::lstm` (RNN.cpp) runs oneDNN's fused RNN (`mkldnn_rnn`: one
    `mkldnn_rnn_layer` per layer and direction, in training too) whenever `use_mkldnn` holds: mkldnn enabled,
    every tensor on the CPU, the input fp32 (bf16 where oneDNN supports it), not empty, no projections. Its
    autograd node saves the layer's input, output, hy, cy and a workspace of oneDNN's own (the gates and
    states of every step); its backward is one `mkldnn_rnn_layer_backward`. Torch's Python decomposition
    (which tracing runs) takes that path only when the input needs no gradient, so a training step traced
    cell by cell: per-step gates, a `cat`, other saved tensors and other peaks. For the duration:
      * aten.lstm.input runs what `mkldnn_rnn` (mkldnn/RNN.cpp) runs where eager's `use_mkldnn` holds: the
        input made time-major and contiguous once, each layer's mkldnn_rnn_layer on `hx[index]` /
        `cx[index]` with `train` as given, dropout between layers in training, `stack` of the final states;
        elsewhere torch's decomposition, unchanged;
      * the fake (Meta) kernel of mkldnn_rnn_layer returns the workspace at the size oneDNN gives it
        (`mkldnn_rnn_workspace_nbytes`); torch's is empty;
      * the fake kernel of mkldnn_rnn_layer_backward returns the bias gradient of b_ih and of b_hh as two
        tensors, as the CPU kernel does; torch's returns one tensor twice (one storage for two `.grad`s).
    Limit: it swaps the op's `py_kernels` and overrides two Meta kernels (a `torch.library` registration,
    removed on exit); tests/capture/test_eager_kernels.py checks both against the real kernels."""
    import warnings

    from torch._C import DispatchKey
    from torch._subclasses.fake_tensor import FakeTensorMode
    def as_in_eager(decomposed):
        def lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
            if not _lstm_uses_mkldnn(input, hx, params):
                return decomposed(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                  batch_first)
            return _mkldnn_lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                batch_first)
        return lstm

    # the Meta kernels: a `torch.library` registration for plain fake tensors, `py_kernels` for the Python
    # dispatcher that tracing enables (torch registers its Python meta kernels in both)
    metas = {torch.ops.aten.mkldnn_rnn_layer.default: _mkldnn_rnn_layer_meta,
             torch.ops.aten.mkldnn_rnn_layer_backward.default: _mkldnn_rnn_layer_backward_meta}
    saved_metas = {m: m.py_kernels.get(DispatchKey.Meta) for m in metas}
    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            for m, kernel in metas.items():
                lib.impl(m._schema.name.removeprefix("aten::"), kernel, "Meta")
                m.py_kernels[DispatchKey.Meta] = kernel
                m._dispatch_cache.clear()
        FakeTensorMode.cache_clear()
        with _autograd_kernels_replaced(torch.ops.aten.lstm.input, as_in_eager):
            yield
    finally:
        lib._destroy()
        for m, kernel in saved_metas.items():
            if kernel is None:
                m.py_kernels.pop(DispatchKey.Meta, None)
            else:
                m.py_kernels[DispatchKey.Meta] = kernel
            m._dispatch_cache.clear()
        FakeTensorMode.cache_clear()


def _lstm_uses_mkldnn(input, hx, params) -> bool:
    """`use_mkldnn` of aten/src/ATen/native/RNN.cpp, and `lstm`'s own condition (no projections)."""
    if not torch._C._get_mkldnn_enabled() or input.numel() == 0 or len(hx) != 2:
        return False
    if any(t.device.type != "cpu" for t in [input, *hx, *params]):
        return False
    if hx[0].size(2) != hx[1].size(2):                       # projections: eager's cell-by-cell path
        return False
    if input.dtype == torch.float32:
        return True
    if input.dtype == torch.bfloat16:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    if input.dtype == torch.float16:
        return not torch.is_grad_enabled() and bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    return False


def _mkldnn_lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """`mkldnn_rnn` (aten/src/ATen/native/mkldnn/RNN.cpp) for an LSTM, op by op."""
    stride = 4 if has_biases else 2
    directions = 2 if bidirectional else 1
    if batch_first:
        input = input.transpose(0, 1)
    layer_input = input.contiguous()
    h0, c0 = hx[0].contiguous(), hx[1].contiguous()
    hidden_size = h0.size(2)
    hy, cy = [], []
    for layer in range(num_layers):
        outputs = []
        for direction in range(directions):
            index = layer * directions + direction
            w = params[index * stride:(index + 1) * stride]
            b_ih = w[2] if has_biases else torch.zeros(w[0].shape, dtype=w[0].dtype, device=w[0].device)
            b_hh = w[3] if has_biases else torch.zeros(w[1].shape, dtype=w[1].dtype, device=w[1].device)
            out = torch.ops.aten.mkldnn_rnn_layer.default(
                layer_input, w[0], w[1], b_ih, b_hh, h0[index], c0[index], direction > 0, [], _LSTM_MODE,
                hidden_size, num_layers, has_biases, bidirectional, batch_first, train)
            outputs.append(out[0])
            hy.append(out[1])
            cy.append(out[2])
        layer_input = outputs[0] if directions == 1 else torch.cat(outputs, -1)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, True)
    output = layer_input.transpose(0, 1) if batch_first else layer_input
    return output, torch.stack(hy, 0), torch.stack(cy, 0)


_LSTM_MODE = 2           # ideep::rnn_kind::LSTM


def _mkldnn_rnn_layer_meta(input, w0, w1, w2, w3, hx, cx, *scalars):
    from torch._meta_registrations import mkldnn_rnn_layer
    output, hy, cy, workspace = mkldnn_rnn_layer(input, w0, w1, w2, w3, hx, cx, *scalars)
    if torch.is_grad_enabled():            # the CPU kernel keeps a workspace only with grad mode on
        nbytes = mkldnn_rnn_workspace_nbytes((input, w0, w1, w2, w3, hx, cx) + tuple(scalars))
        workspace = input.new_empty((nbytes,), dtype=torch.uint8)
    return output, hy, cy, workspace


def _mkldnn_rnn_layer_backward_meta(*args):
    from torch._meta_registrations import mkldnn_rnn_layer_backward
    diff_x, diff_w1, diff_w2, diff_b, _, diff_hx, diff_cx = mkldnn_rnn_layer_backward(*args)
    return diff_x, diff_w1, diff_w2, diff_b, torch.empty_like(diff_b), diff_hx, diff_cx


def mkldnn_rnn_workspace_nbytes(args: tuple) -> int:
    """The bytes of the workspace eager's `mkldnn_rnn_layer` returns for these arguments (its seven tensors,
    anything with `shape` and `dtype`, then its scalars), grad mode on. oneDNN sizes it in its primitive
    descriptor (per-step gates and states, each region page-aligned, laid out for this CPU's ISA); it is
    asked here: the kernel runs once on zero tensors of these shapes on this CPU (memoised by shapes)."""
    shapes = tuple(tuple(int(d) for d in a.shape) for a in args[:7])
    dtypes = tuple(str(a.dtype).removeprefix("torch.") for a in args[:7])
    return _workspace_nbytes(shapes, dtypes, tuple(tuple(a) if isinstance(a, list) else a for a in args[7:]))


@functools.lru_cache(maxsize=None)
def _workspace_nbytes(shapes: tuple, dtypes: tuple, scalars: tuple) -> int:
    from torch.utils._mode_utils import no_dispatch
    from torch.utils._python_dispatch import _disable_current_modes
    meta_included = torch._C._meta_in_tls_dispatch_include()     # set while a fake kernel runs
    torch._C._set_meta_in_tls_dispatch_include(False)
    try:
        with _disable_current_modes(), no_dispatch(), torch.enable_grad():
            tensors = [torch.zeros(s, dtype=getattr(torch, d), device="cpu") for s, d in zip(shapes, dtypes)]
            scalars = tuple(list(v) if isinstance(v, tuple) else v for v in scalars)
            workspace = torch.ops.aten.mkldnn_rnn_layer.default(*tensors, *scalars)[3]
            return workspace.untyped_storage().nbytes()
    finally:
        torch._C._set_meta_in_tls_dispatch_include(meta_included)


@contextlib.contextmanager
def gru_as_in_eager():
    """nn.GRU on a CPU target: eager's `at::gru` (RNN.cpp) has no oneDNN path; it runs
    `_rnn_impl_with_concat<GRUCell, FullLayer>`: per layer, the input projection of every step at once
    (`linear_ih`, then `unbind(0)`), then per step `GRUCell` with ATen's in-place ops on `unsafe_chunk`s of
    the hidden projection (the reset and update gates are computed into its storage, `add_` / `sigmoid_`,
    and the new hidden into `hidden - new_gate`'s, `mul_` / `add_`), then `stack` of the step outputs.
    Torch's Python decomposition computes each gate out of place (two more tensors per step saved for
    backward) and `cat`s unsqueezed steps. For the duration, aten.gru.input runs the ATen sequence, each
    in-place call marked as in-place (tracer/capture/inplace.py), as `_cpu_dropout` does. Limits: it swaps
    the op's `py_kernels`, like the dropout above; C++ locals are not Python locals, so in a bidirectional
    layer the forward direction's input projection, which ATen keeps until the reverse one is made, is
    freed at its last use (a 2-layer bidirectional GRU measured one projection, 0.5%, low at the forward
    peak; unidirectional GRUs are exact)."""
    def as_in_eager(decomposed):
        def gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
            if input.device.type != "cpu" or input.is_nested:
                return decomposed(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                  batch_first)
            return _aten_cpu_gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional,
                                 batch_first)
        return gru

    with _autograd_kernels_replaced(torch.ops.aten.gru.input, as_in_eager):
        yield


def _in_place(fn, *args):
    """`fn(*args)`, an in-place call, marked as one for tracer/capture/inplace.py with an id of its own (the
    model's torch call, `_VF.gru`, holds many)."""
    import torch.fx.traceback as fx_traceback
    from tracer.capture.meta import INPLACE_CALL_KEY
    with fx_traceback.annotate({INPLACE_CALL_KEY: f"{fn.__name__}_{next(_inplace_ids)}"}):
        return fn(*args)


_inplace_ids = itertools.count()


def _aten_gru_cell(igates, hidden, w_hh, b_hh):
    """ATen's `GRUCell` (RNN.cpp) on a CPU step whose input projection is precomputed."""
    chunked_igates = igates.unsafe_chunk(3, 1)
    chunked_hgates = torch.nn.functional.linear(hidden, w_hh, b_hh).unsafe_chunk(3, 1)
    reset_gate = _in_place(torch.Tensor.sigmoid_, _in_place(torch.Tensor.add_, chunked_hgates[0], chunked_igates[0]))
    input_gate = _in_place(torch.Tensor.sigmoid_, _in_place(torch.Tensor.add_, chunked_hgates[1], chunked_igates[1]))
    new_gate = _in_place(torch.Tensor.tanh_,
                         chunked_igates[2].add(_in_place(torch.Tensor.mul_, chunked_hgates[2], reset_gate)))
    return _in_place(torch.Tensor.add_, _in_place(torch.Tensor.mul_, hidden - new_gate, input_gate), new_gate)


def _aten_gru_steps(steps, hidden, w_hh, b_hh) -> list:
    """ATen's `FullLayer` over precomputed step inputs: the hidden after each step."""
    outputs = []
    for step in steps:
        hidden = _aten_gru_cell(step, hidden, w_hh, b_hh)
        outputs.append(hidden)
    return outputs


def _aten_gru_layer(input, hidden, w_ih, w_hh, b_ih, b_hh):
    """ATen's `FullLayer` on the CPU: the input projection of every step at once, then the steps; the
    projection lives until the step outputs are stacked. Returns (output, final hidden)."""
    input_w = torch.nn.functional.linear(input, w_ih, b_ih)
    outputs = _aten_gru_steps(input_w.unbind(0), hidden, w_hh, b_hh)
    return torch.stack(outputs, 0), outputs[-1]


def _aten_gru_bidirectional(input, hidden_fw, hidden_rev, fw: tuple, rev: tuple):
    """ATen's `FullBidirectionalLayer` on the CPU: the forward direction's projection is freed once the
    reverse direction's is made (C++ reassigns `input_w` and `step_inputs`); the reverse one lives until the
    directions are concatenated. Returns (output, final forward hidden, final reverse hidden)."""
    input_w = torch.nn.functional.linear(input, fw[0], fw[2])
    step_inputs = input_w.unbind(0)
    fw_outputs = _aten_gru_steps(step_inputs, hidden_fw, fw[1], fw[3])
    fw_output = torch.stack(fw_outputs, 0)
    input_w = torch.nn.functional.linear(input, rev[0], rev[2])
    step_inputs = input_w.unbind(0)
    rev_outputs = _aten_gru_steps(list(reversed(step_inputs)), hidden_rev, rev[1], rev[3])
    rev_final = rev_outputs[-1]
    rev_outputs.reverse()
    rev_output = torch.stack(rev_outputs, 0)
    return torch.cat([fw_output, rev_output], fw_output.dim() - 1), fw_outputs[-1], rev_final


def _aten_cpu_gru(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first):
    """`at::gru` on the CPU: `_rnn_impl_with_concat<GRUCell, FullLayer, FullBidirectionalLayer>`, then the
    output transposed back (`transpose_`) for batch_first."""
    stride = 4 if has_biases else 2
    weights = [tuple(params[i:i + stride]) + ((None, None) if not has_biases else ())
               for i in range(0, len(params), stride)]
    layer_input = input.transpose(0, 1) if batch_first else input
    hiddens = hx.unbind(0)
    final = []
    for layer in range(num_layers):
        if bidirectional:
            layer_input, h_fw, h_rev = _aten_gru_bidirectional(layer_input, hiddens[2 * layer], hiddens[2 * layer + 1],
                                                               weights[2 * layer], weights[2 * layer + 1])
            final += [h_fw, h_rev]
        else:
            w_ih, w_hh, b_ih, b_hh = weights[layer]
            layer_input, h = _aten_gru_layer(layer_input, hiddens[layer], w_ih, w_hh, b_ih, b_hh)
            final.append(h)
        if dropout != 0 and train and layer < num_layers - 1:
            layer_input = torch.dropout(layer_input, dropout, True)
    final_hidden = torch.stack(final, 0)
    return (layer_input.transpose(0, 1) if batch_first else layer_input), final_hidden


@contextlib.contextmanager
def norm_statistics_as_in_eager(cpu: bool):
    """The mean and rstd a layer norm or a group norm saves for backward (one value per normalized row or
    group) in the dtype the target's kernel makes them. `native_layer_norm` on the CPU (layer_norm.cpp) and
    `native_group_norm` on either device (group_norm.cpp): fp32 when a reduced-precision input meets
    parameters of another dtype (autocast leaves a norm's weight and bias fp32: `param_scalar_type` of a
    mixed call), else the input's dtype. `native_layer_norm` on CUDA (layer_norm_kernel.cu): the
    accumulation type, fp32 for an fp16 or bf16 input, which torch's fake kernel gives a CUDA tensor too.
    The capture's tensors are fake CPU tensors whatever the target, and the fake kernels give the input's
    dtype in either case, so a bf16 BERT's head LayerNorm saved 2 x 128 B where a real CPU step saves
    2 x 256 B. Limit: it sets entries of torch's fake-kernel table (`fake_impls.op_implementations_dict`),
    so the fake cache is emptied on the way in and out."""
    from torch._subclasses import fake_impls
    import torch._refs as refs

    layer_norm, group_norm = torch.ops.aten.native_layer_norm.default, torch.ops.aten.native_group_norm.default
    saved = {op: fake_impls.op_implementations_dict.get(op) for op in (layer_norm, group_norm)}   # torch's own

    def mixed_dtype(x, weight, bias):
        parameter = next((t for t in (weight, bias) if t is not None), None)
        return torch.float32 if parameter is not None and parameter.dtype != x.dtype else x.dtype

    def as_in_eager(out, mean, rstd, dtype):
        return (out, mean, rstd) if mean.dtype == dtype else (out, mean.to(dtype), rstd.to(dtype))

    def layer_norm_kernel(fake_mode, func, *args, **kwargs):
        x = args[0]
        weight = args[2] if len(args) > 2 else kwargs.get("weight")
        bias = args[3] if len(args) > 3 else kwargs.get("bias")
        outputs = saved[layer_norm](fake_mode, func, *args, **kwargs)
        if not cpu:                       # at::toAccumulateType(dtype, is_cuda=true)
            return as_in_eager(*outputs, torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype)
        return as_in_eager(*outputs, mixed_dtype(x, weight, bias))

    def group_norm_kernel(fake_mode, func, *args, **kwargs):
        x, weight, bias = args[0], args[1], args[2]
        return as_in_eager(*refs.native_group_norm(*args, **kwargs), mixed_dtype(x, weight, bias))

    kernels = {group_norm: group_norm_kernel}
    if saved[layer_norm] is not None:
        kernels[layer_norm] = layer_norm_kernel
    with _fake_kernels_replaced(kernels):
        yield


@contextlib.contextmanager
def collective_waits_as_in_eager():
    """`_c10d_functional.wait_tensor(t)` returns `t`, as its kernel does. Limit: it sets an entry of torch's
    fake-kernel table (`fake_impls.op_implementations_dict`), so the fake cache is emptied on the way in and
    out."""
    wait = getattr(getattr(torch.ops, "_c10d_functional", None), "wait_tensor", None)
    if wait is None:
        yield
        return
    with _fake_kernels_replaced({wait.default: lambda fake_mode, func, tensor, *args, **kwargs: tensor}):
        yield


@contextlib.contextmanager
def _fake_kernels_replaced(kernels: dict):
    """Each op's entry of torch's fake-kernel table (`fake_impls.op_implementations_dict`) set to the given
    kernel while active, the old entries (or none) put back after; the fake cache is emptied on the way in
    and out, since metadata it cached from the old kernels would bypass the new ones."""
    from torch._subclasses import fake_impls
    from torch._subclasses.fake_tensor import FakeTensorMode

    table = fake_impls.op_implementations_dict
    saved = {op: table.get(op) for op in kernels}
    table.update(kernels)
    FakeTensorMode.cache_clear()
    try:
        yield
    finally:
        for op, kernel in saved.items():
            if kernel is None:
                table.pop(op, None)
            else:
                table[op] = kernel
        FakeTensorMode.cache_clear()


@contextlib.contextmanager
def kernels_as_in_eager(cpu: bool = False):
    """All of the above, while a graph is traced or the step runs op by op (`cpu`: for a CPU target). Run op
    by op, only what the C++ dispatcher reaches takes effect (the decomposition table's strides, the fake
    kernels' table, oneDNN's RNN Meta kernels); the Python kernels it swaps are read by the Python dispatcher
    of a trace only."""
    rnns = (lstm_as_in_eager(), gru_as_in_eager()) if cpu else ()
    with dropout_as_in_eager(cpu), layouts_as_in_eager(), upsampling_as_in_eager(), \
            norm_statistics_as_in_eager(cpu), collective_waits_as_in_eager(), contextlib.ExitStack() as stack:
        for rnn in rnns:
            stack.enter_context(rnn)
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
