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



@pytest.mark.parametrize("direct", [True, False], ids=["aot-joint", "export-joint"])
def test_dropout_with_p_zero_saves_no_copy(direct, monkeypatch):
    """Torch's traced decomposition of dropout(p=0) copies its input; eager returns the input itself
    (tracer/capture/eager_kernels.py). Checked on both graph front ends."""
    import os

    import tracer.capture as capture
    real = capture.export_joint
    monkeypatch.setattr(capture, "export_joint", lambda *a, direct=False, **k: real(*a, direct=direct_, **k))
    direct_ = direct
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dropout_zero.py")
    graph = capture_step(load_model_source(model), CaptureOptions(batch=2, seq=16, optimizer="none"))
    assert graph.config.capture_path == ("aot-joint" if direct else "export-joint")
    predicted = analyze_graph(graph).policies["eager"]
    source = load_model_source(model)
    torch.manual_seed(0)
    measured = measure_step(source.build_model(), source.example_batch(2, 16), None, steady=False)
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert not any(op.target == "aten.clone.default" for op in graph.ops)


def test_a_branch_dropped_in_forward_saves_nothing():
    """Tensors saved by a branch the loss never reaches die in forward: backward never reads them, and the
    storages saved after them (which may reuse their addresses) are each counted once."""
    import os
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "discarded_branch.py")
    predicted = _predict(model, 2, 16, "fp32")
    source = load_model_source(model)
    torch.manual_seed(0)
    measured = measure_step(source.build_model(), source.example_batch(2, 16), None, steady=False)
    tanh_outputs_bytes = 4 * 2 * 16 * 32 * 4
    assert predicted.saved.total_bytes >= tanh_outputs_bytes
    assert predicted.saved.total_bytes == measured.saved_bytes
