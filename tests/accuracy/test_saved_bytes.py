"""Saved-for-backward bytes vs eager autograd's saved_tensors_hooks (dedup by storage, params excluded)."""
import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
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

