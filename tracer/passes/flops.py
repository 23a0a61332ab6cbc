"""FLOPs of each captured op, from shapes alone: a registry of per-op formulas and an explicit zero-cost list.

Contract:
    op_flops(op) -> int | None        FLOPs of one `OpNode`; None when the op is unknown (no formula and
                                      not on the zero-cost list). Unknown never silently becomes 0.
    summarize_flops(ops) -> FlopSummary   totals per phase and per op, plus every unknown target with its
                                      count, so a report can say what it could not count.

The registry (`FLOP_FORMULAS`) maps an aten name, with the overload ("aten.add.Tensor") or without it
("aten.add"), to a formula `Callable[[OpNode], int]`; the exact target wins over its overload packet.
It is filled only by `@flop_formula(...)`, which refuses a name that already has a formula or sits on
`ZERO_COST_OPS`. A formula reads the op's args/kwargs (schema positions, see each formula) and outputs.

Conventions (one FLOP = one multiply or add; a fused multiply-add counts 2):
  * Matmuls (mm, addmm, bmm, baddbmm, addbmm, mv, addmv, dot, vdot, matmul, linear, _scaled_mm):
    2*M*K*N per batch. Bias and beta/alpha terms are not counted (as in torch.utils.flop_counter).
  * Convolution: 2 * batch * spatial * prod(weight.shape), with spatial the output's spatial size
    (the input's for a transposed convolution); the weight already holds in_channels/groups. Backward:
    one forward's worth each for grad_input and grad_weight (by output_mask); grad_bias not counted.
    For groups > 1 torch.utils.flop_counter overcounts grad_weight by the factor groups; we do not.
  * Attention (every SDPA forward/backward variant): the two products Q@K^T and P@V forward, five
    products backward (recomputed scores, dP, dV, dQ, dK), with h the number of *query* heads (GQA: k/v
    may have fewer heads; each query head still does the full products). Softmax, scale and dropout are
    not counted (as in torch.utils.flop_counter). is_causal halves the count (the usual convention; the
    exact unmasked fraction of a square causal mask is (s+1)/(2s)). An explicit attn_mask counts in full.
  * Elementwise ops: FLOPs per output element, one per elementary operation, any unary function (exp,
    erf, sigmoid, gelu, ...) counting as one: 1 for add/mul/exp/gelu/where/compare/...; 3 for the
    fused ternary ops addcmul, addcdiv, lerp; 2 for the backward of an activation (local derivative,
    times grad_output) and for dropout (mask, scale).
    `_foreach_*` ops: the same constant per element, elements summed over the first tensor list.
  * Reductions: per *input* element: 1 for sum/mean/amax/..., 2 for norms, 3 for var/std/logsumexp;
    softmax and log_softmax 5 (max, sub, exp, sum, div or log-sub); their backward 4; Inductor's
    prepare_softmax_online (max and sum of exp in one pass) 4.
  * Normalizations, per input element: 5 (mean, sub, square, sum, scale; 3 for RMS norm, 2 for batch
    norm in eval) + 1 for the weight + 1 for the bias when present. Backward (by output_mask):
    8 for grad_input, 2 for grad_weight, 1 for grad_bias.
  * Losses: nll_loss forward/backward 1 per target element; mse_loss 3, its backward 2, per element.
    embedding_dense_backward: 1 per grad_output element (the scatter-add), and so Inductor's
    _unsafe_masked_index_put_accumulate per value added; embedding itself is a gather.
  * Fused Adam/AdamW: 13 per parameter element, + 1 (AdamW) or 2 (Adam) with weight_decay, + 1 amsgrad.
  * Zero cost (`ZERO_COST_OPS`): views and reshapes, data movement (clone, copy_, _to_copy, cat, stack,
    gather, embedding, padding; all-to-all, all-gather and broadcast between ranks), factories and fills,
    RNG, scalar reads, asserts, getitem. Moving or converting bytes costs memory bandwidth, not FLOPs.

Not handled (reported as unknown): einsum and other ops not in the registry, the low-level
_flash_attention_* / _efficient_attention_* kernels, flex attention, higher-order ops (checkpoint HOPs),
nested/jagged attention inputs. Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Callable, Iterable

from tracer.errors import TracerError
from tracer.stepgraph import OpNode, Phase, TensorValue

FlopFormula = Callable[[OpNode], int]

FLOP_FORMULAS: dict[str, FlopFormula] = {}

ZERO_COST_OPS: frozenset[str] = frozenset({
    # views, reshapes, aliases
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten._reshape_alias", "aten.view_as", "aten.t",
    "aten.transpose", "aten.permute", "aten.expand", "aten.expand_as", "aten.slice", "aten.select",
    "aten.unsqueeze", "aten.squeeze", "aten.detach", "aten.detach_", "aten.alias", "aten.as_strided",
    "aten.unbind", "aten.split", "aten.split_with_sizes", "aten.chunk", "aten.narrow", "aten.unfold",
    "aten.diagonal", "aten.view_as_real", "aten.view_as_complex", "aten.lift_fresh",
    # data movement and dtype conversion
    "aten.clone", "aten.copy", "aten.copy_", "aten._to_copy", "aten.lift_fresh_copy", "aten.cat",
    "aten.stack", "aten.constant_pad_nd", "aten.repeat", "aten.flip", "aten.roll", "aten.slice_backward",
    "aten.select_backward", "aten.slice_scatter", "aten.select_scatter", "aten.embedding",
    "aten.index_select", "aten.gather", "aten.index", "aten._foreach_copy_", "prims.convert_element_type",
    # collectives that move data between ranks (a reduction adds: it has no formula yet)
    "c10d.alltoall_base_", "c10d.allgather_", "c10d._allgather_base_", "c10d.broadcast_",
    "_c10d_functional.all_to_all_single", "_c10d_functional.all_gather_into_tensor",
    "_c10d_functional.broadcast", "_c10d_functional.wait_tensor", "_c10d_functional._wrap_tensor_autograd",
    # factories, fills, random numbers
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.zeros", "aten.zeros_like", "aten.ones",
    "aten.ones_like", "aten.full", "aten.full_like", "aten.new_empty", "aten.new_empty_strided",
    "aten.new_zeros", "aten.new_ones", "aten.new_full", "aten.arange", "aten.scalar_tensor", "aten.fill",
    "aten.fill_", "aten.zero_", "aten._foreach_zero_", "aten.rand", "aten.randn", "aten.randint",
    "aten.rand_like", "aten.randn_like", "aten.bernoulli", "aten.bernoulli_", "aten.uniform_", "aten.normal_", "prims.iota",
    # scalars, shapes, asserts, bookkeeping
    "aten._local_scalar_dense", "aten.sym_size", "aten.sym_stride", "aten.sym_numel",
    "aten.sym_storage_offset", "aten._assert_tensor_metadata", "aten._assert_async", "aten._assert_scalar",
    "getitem", "prim.device", "profiler._record_function_enter_new", "profiler._record_function_exit",
})


def flop_formula(*targets: str) -> Callable[[FlopFormula], FlopFormula]:
    """Register the decorated function as the FLOP formula of each target ("aten.mm" or "aten.mm.default").

    Raises:
        TracerError: a target already has a formula or is on ZERO_COST_OPS (nothing is registered then).
    """
    def register(fn: FlopFormula) -> FlopFormula:
        for target in targets:
            if target in FLOP_FORMULAS:
                old = FLOP_FORMULAS[target]
                raise TracerError(f"duplicate FLOP formula for {target}: {fn.__module__}.{fn.__qualname__} "
                                  f"would replace {old.__module__}.{old.__qualname__}",
                                  hint="register each op once; edit the existing formula instead")
            if target in ZERO_COST_OPS:
                raise TracerError(f"FLOP formula for {target}: the op is on the zero-cost list",
                                  hint="remove it from ZERO_COST_OPS in tracer/passes/flops.py first")
        for target in targets:
            FLOP_FORMULAS[target] = fn
        return fn
    return register


def op_flops(op: OpNode) -> int | None:
    """FLOPs of one op, or None when it has no formula and is not zero-cost.

    Raises:
        TracerError: the formula does not fit the op's arguments (names the op and its target).
    """
    packet = _packet(op.target)
    formula = FLOP_FORMULAS.get(op.target) or FLOP_FORMULAS.get(packet)
    if formula is None:
        return 0 if op.target in ZERO_COST_OPS or packet in ZERO_COST_OPS else None
    try:
        return int(formula(op))
    except (IndexError, KeyError, TypeError, ValueError, AttributeError) as exc:
        raise TracerError(f"FLOP formula {formula.__qualname__} failed on op {op.name} ({op.target}): {exc}",
                          hint="the op's arguments do not match the aten schema the formula expects") from exc


@dataclasses.dataclass(frozen=True)
class FlopSummary:
    total_flops: int                          # over ops with a known count
    flops_by_phase: dict[str, int]            # Phase.value -> flops, every phase present
    flops_by_op: dict[str, int]               # overload packet ("aten.mm") -> flops, largest first
    unknown_ops: tuple[tuple[str, int], ...]  # (target, number of ops), sorted by target

    @property
    def unknown_op_count(self) -> int:
        return sum(count for _, count in self.unknown_ops)


def summarize_flops(ops: Iterable[OpNode]) -> FlopSummary:
    by_phase = {phase.value: 0 for phase in Phase}
    by_op: Counter[str] = Counter()
    unknown: Counter[str] = Counter()
    for op in ops:
        flops = op_flops(op)
        if flops is None:
            unknown[op.target] += 1
            continue
        by_phase[op.phase.value] += flops
        if flops:
            by_op[_packet(op.target)] += flops
    return FlopSummary(total_flops=sum(by_phase.values()), flops_by_phase=by_phase,
                       flops_by_op=dict(sorted(by_op.items(), key=lambda item: (-item[1], item[0]))),
                       unknown_ops=tuple(sorted(unknown.items())))


# ----------------------------------------------------------------------------------------------- helpers

def _packet(target: str) -> str:
    """"aten.add.Tensor" -> "aten.add"; names without an overload ("getitem", "aten.add") unchanged."""
    parts = target.split(".")
    return ".".join(parts[:-1]) if len(parts) >= 3 else target


def _arg(op: OpNode, index: int | None, name: str, default=None):
    """Schema argument `name` at position `index` (None: keyword-only), passed positionally or by keyword."""
    if index is not None and index < len(op.args):
        return op.args[index]
    return next((value for key, value in op.kwargs if key == name), default)


def _shape(value) -> tuple[int, ...]:
    if not isinstance(value, TensorValue):
        raise TypeError(f"expected a tensor, got {value!r}")
    return value.shape


def _numel(value) -> int:
    return math.prod(_shape(value))


def _output_numel(op: OpNode) -> int:
    """Elements of the first output; in-place ops without recorded outputs fall back to the largest input."""
    if op.outputs:
        return _numel(op.outputs[0])
    return max((_numel(v) for v in op.input_values()), default=0)


def _list_numel(values) -> int:
    """Elements summed over a tensor list (a `Tensor[]` argument), or of a single tensor."""
    if isinstance(values, TensorValue):
        return _numel(values)
    return sum(_numel(v) for v in values if isinstance(v, TensorValue))


# ------------------------------------------------------------------------------------------------ matmul

def _matmul_flops(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    """2*M*K*N times the broadcast batch size; 1-D operands as in torch.matmul."""
    a = (1, *a) if len(a) == 1 else a
    b = (*b, 1) if len(b) == 1 else b
    (m, k), (k2, n) = a[-2:], b[-2:]
    if k != k2:
        raise ValueError(f"inner dimensions differ: {a} @ {b}")
    batch_a, batch_b = a[:-2], b[:-2]
    rank = max(len(batch_a), len(batch_b))
    batch_a = (1,) * (rank - len(batch_a)) + batch_a
    batch_b = (1,) * (rank - len(batch_b)) + batch_b
    batch = math.prod(max(x, y) for x, y in zip(batch_a, batch_b))
    return 2 * batch * m * k * n


@flop_formula("aten.mm", "aten.bmm", "aten.matmul", "aten.mv", "aten.dot", "aten.vdot", "aten._scaled_mm")
def _mm_flops(op: OpNode) -> int:
    """(self, mat2, ...): the two operands come first."""
    return _matmul_flops(_shape(op.args[0]), _shape(op.args[1]))


@flop_formula("aten.addmm", "aten.baddbmm", "aten.addbmm", "aten.addmv")
def _addmm_flops(op: OpNode) -> int:
    """(self, mat1, mat2): the added term is not counted; addbmm's sum over the batch neither."""
    return _matmul_flops(_shape(op.args[1]), _shape(op.args[2]))


@flop_formula("aten.linear")
def _linear_flops(op: OpNode) -> int:
    """(input (..., in), weight (out, in), bias)."""
    out_features = _shape(op.args[1])[0]
    return 2 * _numel(op.args[0]) * out_features


# ----------------------------------------------------------------------------------------------- conv

def _conv_output_spatial(op: OpNode, x: tuple[int, ...], w: tuple[int, ...]) -> tuple[int, ...]:
    if op.outputs:
        return _shape(op.outputs[0])[2:]
    stride, padding, dilation = (tuple(_arg(op, i, name)) for i, name in
                                 ((3, "stride"), (4, "padding"), (5, "dilation")))
    n = len(x) - 2
    stride, padding, dilation = (v * n if len(v) == 1 else v for v in (stride, padding, dilation))
    return tuple((x[2 + i] + 2 * padding[i] - dilation[i] * (w[2 + i] - 1) - 1) // stride[i] + 1
                 for i in range(n))


def _conv_forward_flops(x: tuple[int, ...], w: tuple[int, ...], out_spatial: tuple[int, ...],
                        transposed: bool) -> int:
    """2 * batch * spatial * prod(weight); the weight holds in/groups (or out/groups when transposed)."""
    spatial = x[2:] if transposed else out_spatial
    return 2 * x[0] * math.prod(spatial) * math.prod(w)


@flop_formula("aten.convolution", "aten._convolution")
def _convolution_flops(op: OpNode) -> int:
    """(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups, ...)."""
    x, w = _shape(op.args[0]), _shape(op.args[1])
    transposed = bool(_arg(op, 6, "transposed", False))
    return _conv_forward_flops(x, w, _conv_output_spatial(op, x, w), transposed)


@flop_formula("aten.convolution_backward")
def _convolution_backward_flops(op: OpNode) -> int:
    """(grad_output, input, weight, bias_sizes, stride, padding, dilation, transposed, output_padding,
    groups, output_mask): grad_input and grad_weight each cost one forward."""
    grad_out, x, w = (_shape(op.args[i]) for i in range(3))
    transposed = bool(_arg(op, 7, "transposed", False))
    mask = _arg(op, 10, "output_mask", (True, True, True))
    forward = _conv_forward_flops(x, w, grad_out[2:], transposed)
    return forward * (int(bool(mask[0])) + int(bool(mask[1])))


# ------------------------------------------------------------------------------------------ attention

def _attention_flops(q: tuple[int, ...], k: tuple[int, ...], v: tuple[int, ...], *, causal: bool,
                     backward: bool) -> int:
    """q (b, h_q, s_q, d_q), k (b, h_kv, s_k, d_q), v (b, h_kv, s_k, d_v); h_q a multiple of h_kv."""
    if len(q) != 4 or len(k) != 4 or len(v) != 4:
        raise ValueError(f"expected 4-D (batch, heads, seq, dim) q/k/v, got {q}, {k}, {v}")
    b, h_q, s_q, d_q = q
    h_kv, s_k, d_v = k[1], k[2], v[3]
    if h_q % h_kv:
        raise ValueError(f"query heads {h_q} are not a multiple of key/value heads {h_kv}")
    scores = 2 * b * h_q * s_q * s_k                  # per unit of head dim, one (s_q, s_k) product
    flops = scores * (3 * d_q + 2 * d_v) if backward else scores * (d_q + d_v)
    return flops // 2 if causal else flops


def _sdpa_formula(*, qkv_at: int, causal_at: int, backward: bool) -> FlopFormula:
    def formula(op: OpNode) -> int:
        q, k, v = (_shape(op.args[qkv_at + i]) for i in range(3))
        causal = bool(_arg(op, causal_at, "is_causal", False))
        return _attention_flops(q, k, v, causal=causal, backward=backward)
    formula.__qualname__ = f"sdpa_{'backward' if backward else 'forward'}_flops"
    return formula


# Positions of (query, is_causal) in each aten schema; `scale` is keyword-only everywhere and costs nothing.
flop_formula("aten.scaled_dot_product_attention", "aten._scaled_dot_product_attention_math")(
    _sdpa_formula(qkv_at=0, causal_at=5, backward=False))
flop_formula("aten._scaled_dot_product_flash_attention_for_cpu", "aten._scaled_dot_product_flash_attention")(
    _sdpa_formula(qkv_at=0, causal_at=4, backward=False))
flop_formula("aten._scaled_dot_product_efficient_attention", "aten._scaled_dot_product_cudnn_attention")(
    _sdpa_formula(qkv_at=0, causal_at=6, backward=False))
flop_formula("aten._scaled_dot_product_flash_attention_for_cpu_backward")(
    _sdpa_formula(qkv_at=1, causal_at=7, backward=True))
flop_formula("aten._scaled_dot_product_flash_attention_backward",
             "aten._scaled_dot_product_efficient_attention_backward")(
    _sdpa_formula(qkv_at=1, causal_at=11, backward=True))
flop_formula("aten._scaled_dot_product_cudnn_attention_backward")(
    _sdpa_formula(qkv_at=1, causal_at=14, backward=True))


# ------------------------------------------------------------------------------------------ elementwise

def _per_output_element(flops_per_element: int) -> FlopFormula:
    def formula(op: OpNode) -> int:
        return flops_per_element * _output_numel(op)
    formula.__qualname__ = f"elementwise_{flops_per_element}_flops"
    return formula


def _per_foreach_element(flops_per_element: int) -> FlopFormula:
    def formula(op: OpNode) -> int:
        return flops_per_element * _list_numel(op.args[0])
    formula.__qualname__ = f"foreach_{flops_per_element}_flops"
    return formula


def _per_input_element(flops_per_element: int, input_at: int = 0) -> FlopFormula:
    def formula(op: OpNode) -> int:
        return flops_per_element * _numel(op.args[input_at])
    formula.__qualname__ = f"per_input_element_{flops_per_element}_flops"
    return formula


flop_formula(
    "aten.add", "aten.add_", "aten.sub", "aten.sub_", "aten.rsub", "aten.mul", "aten.mul_", "aten.div",
    "aten.div_", "aten.neg", "aten.neg_", "aten.abs", "aten.abs_", "aten.reciprocal", "aten.reciprocal_",
    "aten.square", "aten.pow", "aten.pow_", "aten.sqrt", "aten.sqrt_", "aten.rsqrt", "aten.rsqrt_",
    "aten.exp", "aten.exp_", "aten.exp2", "aten.expm1", "aten.log", "aten.log_", "aten.log2", "aten.log10",
    "aten.log1p", "aten.sin", "aten.cos", "aten.tan", "aten.tanh", "aten.tanh_", "aten.sigmoid",
    "aten.sigmoid_", "aten.erf", "aten.relu", "aten.relu_", "aten.silu", "aten.silu_", "aten.gelu",
    "aten.gelu_", "aten.mish", "aten.elu", "aten.leaky_relu", "aten.hardtanh", "aten.hardswish",
    "aten.softplus", "aten.threshold", "aten.where", "aten.masked_fill", "aten.masked_fill_",
    "aten.clamp", "aten.clamp_", "aten.clamp_min", "aten.clamp_min_", "aten.clamp_max", "aten.clamp_max_",
    "aten.maximum", "aten.minimum", "aten.fmod", "aten.remainder", "aten.sign", "aten.floor", "aten.ceil",
    "aten.round", "aten.trunc", "aten.nan_to_num", "aten.eq", "aten.ne", "aten.lt", "aten.le", "aten.gt",
    "aten.ge", "aten.logical_not", "aten.logical_and", "aten.logical_or", "aten.bitwise_not",
    "aten.bitwise_and", "aten.bitwise_or", "aten.isnan", "aten.isinf", "aten.tril", "aten.triu",
    "aten.threshold_backward", "aten.log_sigmoid_forward",
)(_per_output_element(1))

flop_formula(
    "aten.addcmul", "aten.addcmul_", "aten.addcdiv", "aten.addcdiv_", "aten.lerp", "aten.lerp_",
)(_per_output_element(3))

flop_formula(
    "aten.silu_backward", "aten.gelu_backward", "aten.sigmoid_backward", "aten.tanh_backward",
    "aten.leaky_relu_backward", "aten.hardtanh_backward", "aten.elu_backward", "aten.softplus_backward",
    "aten.native_dropout", "aten.native_dropout_backward", "aten.log_sigmoid_backward",
)(_per_output_element(2))

flop_formula(
    "aten._foreach_add", "aten._foreach_add_", "aten._foreach_sub", "aten._foreach_sub_",
    "aten._foreach_mul", "aten._foreach_mul_", "aten._foreach_div", "aten._foreach_div_",
    "aten._foreach_neg", "aten._foreach_neg_", "aten._foreach_abs", "aten._foreach_abs_",
    "aten._foreach_reciprocal", "aten._foreach_reciprocal_", "aten._foreach_pow", "aten._foreach_pow_",
    "aten._foreach_sqrt", "aten._foreach_sqrt_", "aten._foreach_rsqrt", "aten._foreach_rsqrt_",
    "aten._foreach_exp", "aten._foreach_exp_", "aten._foreach_log", "aten._foreach_log_",
    "aten._foreach_sign", "aten._foreach_sign_", "aten._foreach_maximum", "aten._foreach_maximum_",
    "aten._foreach_minimum", "aten._foreach_minimum_", "aten._foreach_clamp_min",
    "aten._foreach_clamp_min_", "aten._foreach_clamp_max", "aten._foreach_clamp_max_",
)(_per_foreach_element(1))

flop_formula(
    "aten._foreach_addcmul", "aten._foreach_addcmul_", "aten._foreach_addcdiv", "aten._foreach_addcdiv_",
    "aten._foreach_lerp", "aten._foreach_lerp_",
)(_per_foreach_element(3))

flop_formula("aten._foreach_norm")(_per_foreach_element(2))


# ------------------------------------------------------------------------------------------ reductions

flop_formula(
    "aten.sum", "aten.mean", "aten.amax", "aten.amin", "aten.max", "aten.min", "aten.argmax",
    "aten.argmin", "aten.prod", "aten.any", "aten.all", "aten.cumsum", "aten.count_nonzero",
)(_per_input_element(1))
flop_formula("aten.norm", "aten.linalg_vector_norm")(_per_input_element(2))
flop_formula("aten.var", "aten.std", "aten.var_mean", "aten.std_mean", "aten.logsumexp")(_per_input_element(3))
flop_formula("aten._softmax", "aten._log_softmax")(_per_input_element(5))
flop_formula("aten._softmax_backward_data", "aten._log_softmax_backward_data")(_per_input_element(4))
# Inductor's decomposition of softmax on GPUs: the row max and the sum of exp(x - max) in one pass
flop_formula("prims.prepare_softmax_online")(_per_input_element(4))


# ------------------------------------------------------------------------------------- normalizations

def _norm_forward(core: int, weight_at: int, bias_at: int | None) -> FlopFormula:
    def formula(op: OpNode) -> int:
        affine = int(_arg(op, weight_at, "weight") is not None)
        if bias_at is not None:
            affine += int(_arg(op, bias_at, "bias") is not None)
        return (core + affine) * _numel(op.args[0])
    formula.__qualname__ = f"norm_forward_{core}_flops"
    return formula


def _norm_backward(mask_at: int) -> FlopFormula:
    """8 per input element for grad_input, 2 for grad_weight, 1 for grad_bias, as output_mask asks."""
    def formula(op: OpNode) -> int:
        mask = tuple(bool(m) for m in _arg(op, mask_at, "output_mask"))
        return sum(c for c, wanted in zip((8, 2, 1), mask) if wanted) * _numel(op.args[1])
    formula.__qualname__ = "norm_backward_flops"
    return formula


flop_formula("aten.native_layer_norm")(_norm_forward(5, weight_at=2, bias_at=3))
flop_formula("aten._fused_rms_norm")(_norm_forward(3, weight_at=2, bias_at=None))
flop_formula("aten.native_group_norm")(_norm_forward(5, weight_at=1, bias_at=2))
flop_formula("aten._native_batch_norm_legit_no_training")(_norm_forward(2, weight_at=1, bias_at=2))


@flop_formula("aten.native_batch_norm", "aten._native_batch_norm_legit",
              "aten._native_batch_norm_legit_functional")
def _batch_norm_flops(op: OpNode) -> int:
    """(input, weight, bias, running_mean, running_var, training, ...): eval only subtracts and scales."""
    core = 5 if _arg(op, 5, "training", True) else 2
    return _norm_forward(core, weight_at=1, bias_at=2)(op)


flop_formula("aten.native_layer_norm_backward")(_norm_backward(mask_at=7))
flop_formula("aten.native_batch_norm_backward", "aten.native_group_norm_backward")(_norm_backward(mask_at=9))
flop_formula("aten._fused_rms_norm_backward")(_norm_backward(mask_at=5))


# -------------------------------------------------------------------------------------- losses, misc

flop_formula("aten.nll_loss_forward", "aten.nll_loss2d_forward")(_per_input_element(1, input_at=1))
flop_formula("aten.nll_loss_backward", "aten.nll_loss2d_backward")(_per_input_element(1, input_at=2))
flop_formula("aten.mse_loss")(_per_input_element(3))
flop_formula("aten.mse_loss_backward")(_per_input_element(2, input_at=1))
flop_formula("aten.embedding_dense_backward")(_per_input_element(1))
flop_formula("aten.index_add", "aten.index_add_")(_per_input_element(1, input_at=3))
flop_formula("aten.scatter_add", "aten.scatter_add_")(_per_input_element(1, input_at=3))
# (self, mask, indices, values): Inductor's decomposition of an embedding's backward adds each value in
flop_formula("aten._unsafe_masked_index_put_accumulate")(_per_input_element(1, input_at=3))


@flop_formula("aten._fused_adam_", "aten._fused_adamw_", "aten._fused_adam", "aten._fused_adamw")
def _fused_adam_flops(op: OpNode) -> int:
    """(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, *, lr, beta1, beta2,
    weight_decay, eps, amsgrad, ...): 13 per element, + weight decay (1 decoupled, 2 coupled), + amsgrad."""
    per_element = 13
    if _arg(op, None, "weight_decay", 0.0):
        per_element += 1 if "adamw" in op.target else 2
    if _arg(op, None, "amsgrad", False):
        per_element += 1
    return per_element * _list_numel(op.args[0])
