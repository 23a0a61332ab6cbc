"""Saved-for-backward bytes vs eager autograd's saved_tensors_hooks (dedup by storage, params excluded)."""
import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.models.llama import LlamaConfig
from tracer.passes.analysis import analyze_graph
from truth import measure_step


def _predict(model, batch, seq, precision, optimizer="none"):
    options = CaptureOptions(batch=batch, seq=seq, precision=precision, optimizer=optimizer)
    return analyze_graph(capture_step(load_model_source(model), options)).policies["eager"]


@pytest.mark.parametrize("model,seq", [("llama-debug", 64), ("llama-88m", 64)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_saved_bytes_equal_eager_autograd(model, seq, precision):
    predicted = _predict(model, 2, seq, precision)
    source = load_model_source(model)
    torch.manual_seed(0)
    measured = measure_step(source.build_model(), source.example_batch(2, seq), None, precision=precision,
                            steady=False)
    assert predicted.saved.total_bytes == measured.saved_bytes


def test_bf16_forward_remainder_is_the_logits_kept_by_a_python_local():
    """Under autocast the bf16 logits stay referenced by `logits` in Llama.forward while cross_entropy
    runs on their fp32 copy; the graph frees them after the cast. That is the whole forward-phase gap
    (plus 8 bytes of 0-dim scalars); backward and optimizer peaks are exact."""
    batch, seq = 2, 128
    predicted = _predict("llama-debug", batch, seq, "bf16", optimizer="adamw")
    source = load_model_source("llama-debug")
    torch.manual_seed(0)
    model = source.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    measured = measure_step(model, source.example_batch(batch, seq), opt, precision="bf16")
    logits_bf16_bytes = batch * seq * LlamaConfig.named("debug").vocab_size * 2
    gap = measured.phase_peaks["forward"] - predicted.phases["forward"].peak_bytes
    assert gap - logits_bf16_bytes in range(0, 16)
    assert predicted.phases["backward"].peak_bytes == measured.phase_peaks["backward"]
    assert predicted.phases["optimizer"].peak_bytes == measured.phase_peaks["optimizer"]
