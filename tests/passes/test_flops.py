"""FLOP formulas on tiny hand-built ops, checked against torch.utils.flop_counter where it has a formula."""
from __future__ import annotations

import dataclasses
import itertools
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, conv_flop_count, sdpa_backward_flop_count, sdpa_flop_count

from tracer.errors import TracerError
from tracer.passes import flops
from tracer.passes.flops import FLOP_FORMULAS, ZERO_COST_OPS, flop_formula, op_flops, summarize_flops
from tracer.stepgraph import OpNode, Phase, TensorValue

_ids = itertools.count()


def tv(*shape: int, dtype: str = "float32") -> TensorValue:
    return TensorValue(next(_ids), tuple(shape), dtype)


def op(target: str, *args, outputs=(), kwargs=(), phase=Phase.FORWARD) -> OpNode:
    return OpNode(index=0, name=f"n{next(_ids)}", target=target, phase=phase, args=tuple(args),
                  kwargs=tuple(kwargs), outputs=tuple(outputs), source=None, module="")


# --------------------------------------------------------------------------------------------- matmul

def test_matmul_family_is_2mkn():
    m, k, n, b = 3, 5, 7, 4
    assert op_flops(op("aten.mm.default", tv(m, k), tv(k, n), outputs=[tv(m, n)])) == 2 * m * k * n
    assert op_flops(op("aten.addmm.default", tv(n), tv(m, k), tv(k, n), outputs=[tv(m, n)])) == 2 * m * k * n
    assert op_flops(op("aten.bmm.default", tv(b, m, k), tv(b, k, n))) == 2 * b * m * k * n
    assert op_flops(op("aten.baddbmm.default", tv(b, m, n), tv(b, m, k), tv(b, k, n))) == 2 * b * m * k * n
    assert op_flops(op("aten.matmul.default", tv(2, 1, m, k), tv(b, k, n))) == 2 * 2 * b * m * k * n
    assert op_flops(op("aten.mv.default", tv(m, k), tv(k))) == 2 * m * k
    assert op_flops(op("aten.dot.default", tv(k), tv(k))) == 2 * k
    assert op_flops(op("aten.linear.default", tv(b, m, k), tv(n, k), None)) == 2 * b * m * k * n


def test_matmul_inner_dimension_mismatch_names_the_op():
    bad = op("aten.mm.default", tv(3, 5), tv(4, 7))
    with pytest.raises(TracerError, match=f"{bad.name}.*aten.mm.default"):
        op_flops(bad)


# ------------------------------------------------------------------------------------------ attention

SDPA_FORWARD = ["_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
                "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
                "scaled_dot_product_attention", "_scaled_dot_product_attention_math"]
SDPA_BACKWARD = ["_scaled_dot_product_flash_attention_for_cpu_backward",
                 "_scaled_dot_product_flash_attention_backward",
                 "_scaled_dot_product_efficient_attention_backward",
                 "_scaled_dot_product_cudnn_attention_backward"]
B, HQ, HKV, SQ, SK, D, DV = 2, 4, 2, 6, 10, 8, 4    # GQA (HKV < HQ), s_q != s_k, d_v != d_q


def sdpa_op(name: str, is_causal: bool, *, causal_as_kwarg: bool = False) -> OpNode:
    """Arguments laid out from the real aten schema, so the formula's positions are checked against it."""
    tensors = {"query": tv(B, HQ, SQ, D), "key": tv(B, HKV, SK, D), "value": tv(B, HKV, SK, DV),
               "grad_out": tv(B, HQ, SQ, DV), "grad_out_": tv(B, HQ, SQ, DV)}
    schema = getattr(torch.ops.aten, name).default._schema
    args, kwargs = [], []
    for arg in schema.arguments:
        value = tensors.get(arg.name, is_causal if arg.name == "is_causal" else None)
        if arg.name == "is_causal" and causal_as_kwarg:
            kwargs.append((arg.name, value))
        elif not arg.kwarg_only and not kwargs:
            args.append(value)
    return op(f"aten.{name}.default", *args, kwargs=kwargs)


@pytest.mark.parametrize("name", SDPA_FORWARD)
def test_sdpa_forward_matches_flop_counter_and_causal_halves(name):
    full = sdpa_flop_count((B, HQ, SQ, D), (B, HKV, SK, D), (B, HKV, SK, DV))
    assert op_flops(sdpa_op(name, False)) == full
    assert op_flops(sdpa_op(name, True)) * 2 == full
    assert op_flops(sdpa_op(name, True, causal_as_kwarg=True)) * 2 == full


@pytest.mark.parametrize("name", SDPA_BACKWARD)
def test_sdpa_backward_matches_flop_counter_and_causal_halves(name):
    full = sdpa_backward_flop_count((B, HQ, SQ, DV), (B, HQ, SQ, D), (B, HKV, SK, D), (B, HKV, SK, DV))
    assert op_flops(sdpa_op(name, False)) == full
    assert op_flops(sdpa_op(name, True)) * 2 == full
    assert op_flops(sdpa_op(name, True, causal_as_kwarg=True)) * 2 == full


def test_sdpa_heads_must_divide():
    with pytest.raises(TracerError, match="not a multiple"):
        op_flops(op("aten.scaled_dot_product_attention.default", tv(1, 3, 4, 8), tv(1, 2, 4, 8), tv(1, 2, 4, 8)))


# ----------------------------------------------------------------------------------------------- conv

@pytest.mark.parametrize("groups,stride,transposed", [(1, 1, False), (2, 2, False), (1, 2, True), (2, 1, True)])
def test_convolution_matches_flop_counter(groups, stride, transposed):
    x = torch.randn(2, 4, 9, 7)
    w = torch.randn(4, 6 // groups, 3, 2) if transposed else torch.randn(6, 4 // groups, 3, 2)
    out = torch.ops.aten.convolution(x, w, None, [stride, stride], [1, 0], [1, 1], transposed, [0, 0], groups)
    node = op("aten.convolution.default", tv(*x.shape), tv(*w.shape), None, (stride, stride), (1, 0), (1, 1),
              transposed, (0, 0), groups, outputs=[tv(*out.shape)])
    assert op_flops(node) == conv_flop_count(list(x.shape), list(w.shape), list(out.shape), transposed)
    # without a recorded output the output size comes from stride/padding/dilation
    if not transposed:
        assert op_flops(dataclasses.replace(node, outputs=())) == op_flops(node)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("mask", [(True, True, True), (True, False, False), (False, True, True)])
def test_convolution_backward_matches_flop_counter(transposed, mask):
    x = torch.randn(2, 4, 9, 7)
    w = torch.randn(4, 6, 3, 2) if transposed else torch.randn(6, 4, 3, 2)
    conv_args = ([2, 2], [1, 0], [1, 1], transposed, [0, 0], 1)
    grad_out = torch.randn(torch.ops.aten.convolution(x, w, None, *conv_args).shape)
    with FlopCounterMode(display=False) as counter:
        torch.ops.aten.convolution_backward(grad_out, x, w, [6], *conv_args, list(mask))
    node = op("aten.convolution_backward.default", tv(*grad_out.shape), tv(*x.shape), tv(*w.shape), (6,),
              (2, 2), (1, 0), (1, 1), transposed, (0, 0), 1, mask, phase=Phase.BACKWARD)
    assert op_flops(node) == counter.get_total_flops()


def test_grouped_convolution_backward_is_one_forward_per_gradient():
    # torch.utils.flop_counter overcounts grad_weight by `groups`; each gradient costs one forward here
    x, w, out = tv(2, 4, 9, 7), tv(6, 2, 3, 2), tv(2, 6, 7, 6)
    forward = op_flops(op("aten.convolution.default", x, w, None, (1, 1), (0, 0), (1, 1), False, (0, 0), 2,
                          outputs=[out]))
    backward = op("aten.convolution_backward.default", out, x, w, None, (1, 1), (0, 0), (1, 1), False, (0, 0),
                  2, (True, True, False))
    assert forward == 2 * 2 * 7 * 6 * (6 * 2 * 3 * 2)
    assert op_flops(backward) == 2 * forward


# --------------------------------------------------------------------------- elementwise and reductions

def test_elementwise_counts_output_elements():
    assert op_flops(op("aten.add.Tensor", tv(4, 5), tv(5), outputs=[tv(4, 5)])) == 20
    assert op_flops(op("aten.mul_.Tensor", tv(4, 5), tv(4, 5), outputs=[tv(4, 5)])) == 20
    assert op_flops(op("aten.gelu.default", tv(3, 2), outputs=[tv(3, 2)])) == 6
    assert op_flops(op("aten.where.self", tv(3, 2, dtype="bool"), tv(3, 2), tv(1), outputs=[tv(3, 2)])) == 6
    assert op_flops(op("aten.addcdiv_.default", tv(10), tv(10), tv(10), outputs=[tv(10)])) == 30
    assert op_flops(op("aten.silu_backward.default", tv(3, 2), tv(3, 2), outputs=[tv(3, 2)])) == 12
    assert op_flops(op("aten.threshold_backward.default", tv(3, 2), tv(3, 2), 0, outputs=[tv(3, 2)])) == 6
    # an in-place op recorded without outputs falls back to its largest input
    assert op_flops(op("aten.lerp_.Scalar", tv(7), tv(7), 0.1)) == 21


def test_foreach_sums_elements_over_the_first_list():
    params, grads = (tv(3, 4), tv(5)), (tv(3, 4), tv(5))
    assert op_flops(op("aten._foreach_add_.List", params, grads)) == 17
    assert op_flops(op("aten._foreach_sqrt.default", params, outputs=[tv(3, 4), tv(5)])) == 17
    assert op_flops(op("aten._foreach_addcdiv_.ScalarList", params, grads, grads, (0.1, 0.1))) == 3 * 17
    assert op_flops(op("aten._foreach_lerp_.Scalar", params, grads, 0.1)) == 3 * 17
    assert op_flops(op("aten._fused_adamw_.default", params, grads, params, params, (), (tv(), tv()),
                       kwargs=[("lr", 1e-3), ("weight_decay", 0.1), ("amsgrad", False)])) == 14 * 17


def test_reductions_and_normalizations_count_input_elements():
    x = tv(4, 6)
    assert op_flops(op("aten.sum.dim_IntList", x, (1,), outputs=[tv(4)])) == 24
    assert op_flops(op("aten.mean.dim", x, (-1,), True, outputs=[tv(4, 1)])) == 24
    assert op_flops(op("aten._softmax.default", x, -1, False, outputs=[x])) == 5 * 24
    assert op_flops(op("aten._log_softmax_backward_data.default", x, x, -1, "float32")) == 4 * 24
    assert op_flops(op("aten.native_layer_norm.default", x, (6,), tv(6), tv(6), 1e-5)) == 7 * 24
    assert op_flops(op("aten.native_layer_norm.default", x, (6,), None, None, 1e-5)) == 5 * 24
    assert op_flops(op("aten.native_layer_norm_backward.default", x, x, (6,), tv(4, 1), tv(4, 1), tv(6), tv(6),
                       (True, True, False))) == 10 * 24
    assert op_flops(op("aten.nll_loss_forward.default", x, tv(4, dtype="int64"), None, 1, -100)) == 4
    assert op_flops(op("aten.nll_loss_backward.default", tv(), x, tv(4, dtype="int64"), None, 1, -100, tv())) == 4
    assert op_flops(op("aten.embedding_dense_backward.default", tv(2, 3, 6), tv(2, 3), 11, -1, False)) == 36


# ---------------------------------------------------------------------------- registry and summaries

def test_duplicate_registration_is_refused_and_registers_nothing():
    before = dict(FLOP_FORMULAS)
    with pytest.raises(TracerError, match="duplicate FLOP formula for aten.mm"):
        @flop_formula("aten.some_new_op_for_test", "aten.mm")
        def _again(node):
            return 0
    with pytest.raises(TracerError, match="zero-cost list"):
        flop_formula("aten.view")(lambda node: 0)
    assert FLOP_FORMULAS == before


def test_registration_of_a_new_op(monkeypatch):
    monkeypatch.setattr(flops, "FLOP_FORMULAS", dict(FLOP_FORMULAS))
    node = op("myns.fancy.default", tv(3))
    assert op_flops(node) is None

    @flop_formula("myns.fancy")
    def _fancy(n):
        return 42
    assert op_flops(node) == 42


def test_exact_overload_wins_over_packet(monkeypatch):
    monkeypatch.setattr(flops, "FLOP_FORMULAS", dict(FLOP_FORMULAS))
    flop_formula("aten.add.Scalar")(lambda n: 1)
    assert op_flops(op("aten.add.Scalar", tv(4), 1.0, outputs=[tv(4)])) == 1
    assert op_flops(op("aten.add.Tensor", tv(4), tv(4), outputs=[tv(4)])) == 4


def test_zero_cost_and_unknown_ops_in_summary():
    ops = [
        op("aten.mm.default", tv(2, 3), tv(3, 4), outputs=[tv(2, 4)]),                          # 48
        op("aten.view.default", tv(2, 4), (8,), outputs=[tv(8)]),                               # 0
        op("aten._to_copy.default", tv(8), kwargs=[("dtype", "torch.bfloat16")], outputs=[tv(8)]),
        op("aten.einsum.default", "ij->ji", (tv(2, 2),), outputs=[tv(2, 2)]),                   # unknown
        op("aten.einsum.default", "ij->ji", (tv(2, 2),), outputs=[tv(2, 2)], phase=Phase.BACKWARD),
        op("aten.mm.default", tv(4, 2), tv(2, 3), outputs=[tv(4, 3)], phase=Phase.BACKWARD),    # 48
        op("aten.cummax.default", tv(5), 0, phase=Phase.BACKWARD),                              # unknown
        op("aten.add_.Tensor", tv(5), tv(5), outputs=[tv(5)], phase=Phase.OPTIMIZER),           # 5
        op("getitem", (tv(2),), 0, outputs=[tv(2)]),                                            # 0
    ]
    assert op_flops(ops[1]) == 0 and op_flops(ops[2]) == 0 and op_flops(ops[3]) is None
    summary = summarize_flops(ops)
    assert summary.total_flops == 101
    assert summary.flops_by_phase == {"forward": 48, "backward": 48, "optimizer": 5}
    assert summary.flops_by_op == {"aten.mm": 96, "aten.add_": 5}
    assert summary.unknown_ops == (("aten.cummax.default", 1), ("aten.einsum.default", 2))
    assert summary.unknown_op_count == 3


def test_empty_summary_has_every_phase():
    assert summarize_flops([]).flops_by_phase == {p.value: 0 for p in Phase}


def test_every_registered_name_is_a_real_op():
    names = sorted((set(FLOP_FORMULAS) | ZERO_COST_OPS) - {"getitem"})
    missing = [n for n in names if not hasattr(getattr(torch.ops, n.split(".")[0]), n.split(".", 1)[1])]
    assert missing == []
    assert not set(FLOP_FORMULAS) & ZERO_COST_OPS


def test_module_does_not_import_torch():
    code = "import sys, tracer.passes.flops; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


# ---------------------------------------------------------------------- against FlopCounterMode, live

def _target_name(func) -> str:
    return f"{func.namespace}.{func._opname}.{func._overloadname}"


class _Recorder(TorchDispatchMode):
    """Records each aten op of a real run as an OpNode (storage ids are tensor ids; nothing else needed)."""

    def __init__(self):
        super().__init__()
        self.ops: list[OpNode] = []
        self.phase = Phase.FORWARD

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func.namespace == "aten":
            outputs = tuple(_plain(t) for t in tree_leaves(out) if isinstance(t, torch.Tensor))
            self.ops.append(OpNode(index=len(self.ops), name=f"op{len(self.ops)}", target=_target_name(func),
                                   phase=self.phase, args=_plain(args),
                                   kwargs=tuple((k, _plain(v)) for k, v in kwargs.items()),
                                   outputs=outputs, source=None, module=""))
        return out


def _plain(obj):
    if isinstance(obj, torch.Tensor):
        return TensorValue(id(obj), tuple(obj.shape), str(obj.dtype))
    if isinstance(obj, (tuple, list)):
        return tuple(_plain(o) for o in obj)
    return obj if isinstance(obj, (int, float, bool, str)) or obj is None else str(obj)


def _cpu_flash_formulas():
    """FlopCounterMode has no formula for the CPU flash op; these count the full s_q*s_k like its others."""
    def forward(query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_flop_count(query, key, value)

    def backward(grad_out, query, key, value, *args, out_shape=None, **kwargs):
        return sdpa_backward_flop_count(grad_out, query, key, value)
    aten = torch.ops.aten
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}


BATCH, SEQ, DIM, HEADS, KV_HEADS, HEAD_DIM = 2, 8, 16, 4, 2, 4


def _mlp_attention_model() -> torch.nn.ModuleDict:
    torch.manual_seed(0)
    return torch.nn.ModuleDict({
        "fc1": torch.nn.Linear(DIM, 2 * DIM), "fc2": torch.nn.Linear(2 * DIM, DIM),
        "wq": torch.nn.Linear(DIM, HEADS * HEAD_DIM), "wkv": torch.nn.Linear(DIM, 2 * KV_HEADS * HEAD_DIM)})


def _mlp_attention_loss(m: torch.nn.ModuleDict, x: torch.Tensor, causal: bool) -> torch.Tensor:
    h = m["fc2"](F.relu(m["fc1"](x)))                                                    # (B, S, D)
    q = m["wq"](h).view(BATCH, SEQ, HEADS, HEAD_DIM).transpose(1, 2)                    # (B, H, S, hd)
    kv = m["wkv"](h).view(BATCH, SEQ, 2 * KV_HEADS, HEAD_DIM).transpose(1, 2)           # (B, 2*Hkv, S, hd)
    k, v = kv.chunk(2, dim=1)                                                           # (B, Hkv, S, hd)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)      # (B, H, S, hd)
    return a.transpose(1, 2).reshape(BATCH, SEQ, DIM).pow(2).mean()


@pytest.mark.parametrize("causal", [False, True])
def test_matches_flop_counter_mode_on_a_real_step(causal):
    model, x = _mlp_attention_model(), torch.randn(BATCH, SEQ, DIM)
    recorder = _Recorder()
    with recorder:
        loss = _mlp_attention_loss(model, x, causal)
        recorder.phase = Phase.BACKWARD
        loss.backward()
    with FlopCounterMode(display=False, custom_mapping=_cpu_flash_formulas()) as counter:
        _mlp_attention_loss(model, x, causal).backward()
    theirs = {str(packet): n for packet, n in counter.get_flop_counts()["Global"].items()}
    summary = summarize_flops(recorder.ops)

    assert summary.unknown_ops == ()
    attention = {"aten._scaled_dot_product_flash_attention_for_cpu",
                 "aten._scaled_dot_product_flash_attention_for_cpu_backward"}
    assert attention <= set(theirs) and {"aten.addmm", "aten.mm"} <= set(theirs)
    for packet, n in theirs.items():
        expected = n // 2 if causal and packet in attention else n
        assert summary.flops_by_op[packet] == expected, packet
    assert summary.flops_by_phase["backward"] > summary.flops_by_phase["forward"] > 0
