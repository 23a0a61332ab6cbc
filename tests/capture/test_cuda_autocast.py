"""The CUDA target's autocast: every path by which real models reach an op on CUDA's autocast lists gets
the dtype CUDA's rules give (upstream aten/src/ATen/autocast_mode.cpp, CUDA bf16), including through
composite ops (F.cross_entropy reaches log_softmax, on the fp32 list, through its decomposition).

Each case runs the path on fake tensors under the capture's CUDA autocast kernels and checks the output
dtype against the rule written here. Where CPU's autocast rule gives the same dtype, a real CPU autocast
run of the same path is checked too (ground truth for the shared part of the rule).
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from tracer.capture.target import cuda_capture, parse_target

BF16, FP32 = torch.bfloat16, torch.float32


def _x(*shape):
    return torch.randn(*shape)


def _mha(x):
    torch.manual_seed(0)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    return mha(x, x, x, need_weights=False)[0]


# (path, inputs, function, dtype on CUDA, does CPU's autocast give the same dtype?); CPU differs for
# layer_norm and group_norm (bf16 on CPU), softmax/log_softmax/rms_norm/exp/sum without a dtype (input dtype)
CASES = [
    ("F.cross_entropy", lambda: (_x(4, 10), torch.tensor([1, 2, 3, 4])),
     lambda x, t: F.cross_entropy(x.to(BF16), t), FP32, True),
    ("F.nll_loss", lambda: (_x(4, 10), torch.tensor([1, 2, 3, 4])),
     lambda x, t: F.nll_loss(x.to(BF16), t), FP32, True),
    ("F.softmax", lambda: (_x(4, 10),), lambda x: F.softmax(x.to(BF16), dim=-1), FP32, False),
    ("F.softmax dtype=bf16", lambda: (_x(4, 10),), lambda x: F.softmax(x, dim=-1, dtype=BF16), BF16, True),
    ("F.log_softmax", lambda: (_x(4, 10),), lambda x: F.log_softmax(x.to(BF16), dim=-1), FP32, False),
    ("F.log_softmax dtype=fp32", lambda: (_x(4, 10),), lambda x: F.log_softmax(x.to(BF16), -1, dtype=FP32), FP32, True),
    ("F.layer_norm", lambda: (_x(4, 8),), lambda x: F.layer_norm(x.to(BF16), (8,)), FP32, False),
    ("F.group_norm", lambda: (_x(2, 4, 6),), lambda x: F.group_norm(x.to(BF16), 2), FP32, False),
    ("F.rms_norm", lambda: (_x(4, 8),), lambda x: F.rms_norm(x.to(BF16), (8,)), FP32, False),
    ("F.mse_loss", lambda: (_x(4, 8), _x(4, 8)), lambda x, y: F.mse_loss(x.to(BF16), y.to(BF16)), FP32, True),
    ("F.binary_cross_entropy_with_logits", lambda: (_x(4, 8), torch.rand(4, 8)),
     lambda x, y: F.binary_cross_entropy_with_logits(x.to(BF16), y), FP32, True),
    ("torch.einsum", lambda: (_x(2, 3, 4), _x(2, 4, 5)), lambda a, b: torch.einsum("bij,bjk->bik", a, b), BF16, True),
    ("torch.matmul", lambda: (_x(3, 4), _x(4, 5)), torch.matmul, BF16, True),
    ("F.linear", lambda: (_x(3, 4), _x(5, 4), _x(5)), F.linear, BF16, True),
    ("torch.baddbmm", lambda: (_x(2, 3, 5), _x(2, 3, 4), _x(2, 4, 5)), torch.baddbmm, BF16, True),
    ("SDPA (math path, fp32 inputs under autocast)", lambda: (_x(1, 2, 8, 16), _x(1, 2, 8, 16), _x(1, 2, 8, 16)),
     F.scaled_dot_product_attention, BF16, True),
    ("nn.MultiheadAttention", lambda: (_x(2, 5, 8),), _mha, BF16, True),
    ("torch.exp", lambda: (_x(4, 8),), lambda x: torch.exp(x.to(BF16)), FP32, False),
    ("Tensor.sum", lambda: (_x(4, 8),), lambda x: x.to(BF16).sum(), FP32, False),
]


def _run_cuda_rules(fn, inputs):
    with FakeTensorMode(allow_non_fake_inputs=True) as mode, cuda_capture(parse_target("cuda:h100"), "bf16"), \
            torch.autocast("cpu", dtype=BF16):
        fakes = [mode.from_tensor(t) for t in inputs]
        return fn(*fakes)


@pytest.mark.parametrize("path, make_inputs, fn, cuda_dtype, cpu_agrees", CASES, ids=[c[0] for c in CASES])
def test_cuda_autocast_output_dtype(path, make_inputs, fn, cuda_dtype, cpu_agrees):
    out = _run_cuda_rules(fn, make_inputs())
    assert out.dtype == cuda_dtype, f"{path}: CUDA autocast gives {cuda_dtype}, traced {out.dtype}"
    if cpu_agrees:
        with torch.autocast("cpu", dtype=BF16):
            real = fn(*make_inputs())
        assert real.dtype == cuda_dtype, f"{path}: a real CPU autocast run gives {real.dtype}"


@pytest.mark.slow
def test_cross_entropy_saves_an_fp32_copy_of_the_log_probabilities_in_the_cuda_graph():
    """cross_entropy_loss (LossNLL.cpp) calls log_softmax(self, dim, self.scalar_type()): the explicit dtype
    keeps log_softmax in bf16 under CUDA autocast, and nll_loss (on the fp32 list) gets an fp32 copy of the
    log-probabilities, which its backward reads: 4 bytes x vocab per token live from forward to backward."""
    from tracer.capture import CaptureOptions, capture_step, load_model_source

    graph = capture_step(load_model_source("llama-debug"),
                         CaptureOptions(batch=1, seq=16, precision="bf16", target="cuda:h100"))
    log_softmax = next(op for op in graph.ops if op.target == "aten._log_softmax.default")
    nll = next(op for op in graph.ops if op.target == "aten.nll_loss_forward.default")
    nll_backward = next(op for op in graph.ops if op.target == "aten.nll_loss_backward.default")
    assert log_softmax.outputs[0].dtype == "bfloat16"
    fp32_log_probs = nll.args[0]
    assert fp32_log_probs.dtype == "float32" and fp32_log_probs.shape == log_softmax.outputs[0].shape
    assert any(getattr(a, "storage_id", None) == fp32_log_probs.storage_id for a in nll_backward.args)
