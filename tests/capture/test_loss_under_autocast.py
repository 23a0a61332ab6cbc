"""What the loss keeps for backward under bf16 autocast, per loss function and per target, from autocast's
op lists and the backward formulas (tests/fixtures/loss_heads.py: a linear head over 512 classes).

CPU autocast puts `cross_entropy_loss` on its fp32 list: the logits are cast to float32 first and only the
fp32 log-probabilities are kept (4 B a logit). CUDA's lists do not name it, so it decomposes under autocast:
it calls `log_softmax(self, dim, self.scalar_type())`, and that explicit dtype survives CUDA's
fp32_set_opt_dtype policy, so the log-probabilities stay bf16 (kept by `_log_softmax_backward_data`), and
`nll_loss` (on CUDA's fp32 list) gets a float32 copy of them (kept by `nll_loss_backward`): 6 B a logit.
A model that writes `F.log_softmax` then `F.nll_loss` gets the reverse: on CUDA log_softmax without a dtype
runs in float32 (4 B a logit); on CPU it runs in bf16 and nll_loss's fp32 copy is added (6 B). MSE and BCE
with logits are on both fp32 lists: float32 copies of input and target (8 B a logit).

The CPU column is checked against real CPU autocast steps (saved-tensor hooks, exact); the CUDA column is
the capture's derivation, which no step on this machine can measure; the facts it rests on are checked
against the installed torch (its dispatcher and cross_entropy_loss's own call).
"""
from __future__ import annotations

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "loss_heads.py")
BATCH, SEQ, VOCAB = 2, 32, 512
# loss -> saved bytes a logit under bf16 autocast: (CPU, CUDA)
SAVED_BYTES_PER_LOGIT = {
    "cross_entropy": (4, 6),
    "cross_entropy_smoothed": (4, 6),
    "cross_entropy_ignore": (4, 6),
    "log_softmax_nll": (6, 4),
    "mse": (8, 8),
    "bce_logits": (8, 8),
}


def _source(loss):
    source = load_model_source(FIXTURE)
    net = source.build_model.__globals__["Net"]
    return dataclasses.replace(source, build_model=lambda: net(loss=loss))


def _predict(loss, target):
    graphs = capture_steps(_source(loss), CaptureOptions(batch=BATCH, seq=SEQ, target=target, precision="bf16"),
                           (PolicySpec(name="eager"),))
    return analyze_graphs(graphs).policies["eager"]


def _saved_bytes_per_logit(predicted) -> int:
    """Bytes saved for backward in storages shaped like the (tokens, vocab) logits, per logit."""
    logits_shaped = [predicted.graph.storage(sid) for sid in predicted.saved.storage_ids]
    total = sum(s.nbytes for s in logits_shaped if s.shape == (BATCH * SEQ, VOCAB))
    return total // (BATCH * SEQ * VOCAB)


@pytest.mark.parametrize("loss", list(SAVED_BYTES_PER_LOGIT))
def test_what_the_loss_keeps_on_each_target(loss):
    cpu, cuda = SAVED_BYTES_PER_LOGIT[loss]
    assert _saved_bytes_per_logit(_predict(loss, "cpu")) == cpu
    assert _saved_bytes_per_logit(_predict(loss, "cuda:h100")) == cuda


@pytest.mark.slow
@pytest.mark.parametrize("loss", list(SAVED_BYTES_PER_LOGIT))
def test_the_cpu_column_is_what_a_real_cpu_step_saves(loss):
    from truth import measure_step
    predicted = _predict(loss, "cpu")
    source = _source(loss)
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(BATCH, SEQ),
                            torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16")
    assert predicted.saved.total_bytes == measured.saved_bytes


def test_cross_entropy_is_on_cpus_autocast_list_and_not_on_cudas():
    has = torch._C._dispatch_has_kernel_for_dispatch_key
    assert has("aten::cross_entropy_loss", "AutocastCPU") and not has("aten::cross_entropy_loss", "AutocastCUDA")
    assert has("aten::log_softmax.int", "AutocastCUDA") and has("aten::nll_loss", "AutocastCUDA")


def test_cross_entropy_passes_its_input_dtype_to_log_softmax():
    """The C++ composite, run for real: with cross_entropy_loss let through CPU autocast, the log_softmax it
    calls is seen with dtype=bfloat16 given explicitly (which CUDA's fp32_set_opt_dtype policy keeps)."""
    seen = []
    op = torch.ops.aten.log_softmax.int
    excluded = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)

    def spy(*args, **kwargs):
        seen.append(args[2] if len(args) > 2 else kwargs.get("dtype"))
        with torch._C._ExcludeDispatchKeyGuard(excluded):
            return op(*args, **kwargs)

    lib = torch.library.Library("aten", "IMPL")
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            lib.impl("log_softmax.int", spy, "AutocastCPU")
            lib.impl("cross_entropy_loss", torch.library.fallthrough_kernel, "AutocastCPU")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            F.cross_entropy(torch.randn(4, 10, dtype=torch.bfloat16), torch.tensor([1, 2, 3, 4]))
    finally:
        lib._destroy()
    assert seen == [torch.bfloat16]
