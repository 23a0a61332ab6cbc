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



def _on_rung(direct: bool, monkeypatch) -> None:
    """Every capture of the test takes the direct trace (`aot-joint`) or the export rung."""
    import tracer.capture as capture
    real = capture.export_joint
    monkeypatch.setattr(capture, "export_joint", lambda *a, direct=False, **k: real(*a, direct=chosen, **k))
    chosen = direct


@pytest.mark.parametrize("direct", [True, False], ids=["aot-joint", "export-joint"])
def test_dropout_with_p_zero_saves_no_copy(direct, monkeypatch):
    """Torch's traced decomposition of dropout(p=0) copies its input; eager returns the input itself
    (tracer/capture/eager_kernels.py). Checked on both graph front ends."""
    import os

    _on_rung(direct, monkeypatch)
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


DROPPED_BRANCH_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x, y):
        h = self.up(x)
        dropped = (h * 3).exp()        # exp saves its result for a backward that never runs: nothing reads it
        return F.mse_loss(self.down(torch.relu(h)), y)


def build_model():
    return M()


def example_batch(batch, seq):
    return torch.randn(batch, seq, 32), torch.randn(batch, seq, 32)
'''


def test_a_branch_the_loss_never_reaches_saves_nothing_for_backward(tmp_path):
    """A forward op whose result nothing reads still runs in eager (the capture keeps it), and autograd saves
    its tensors; they die with the branch when forward returns, so backward never holds them."""
    path = tmp_path / "dropped_branch.py"
    path.write_text(DROPPED_BRANCH_MODEL)
    predicted = _predict(str(path), 2, 64, "fp32")
    source = load_model_source(str(path))
    torch.manual_seed(0)
    measured = measure_step(source.build_model(), source.example_batch(2, 64), None, steady=False)
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert predicted.phases["forward"].peak_bytes == measured.phase_peaks["forward"]


@pytest.mark.parametrize("direct", [True, False], ids=["aot-joint", "export-joint"])
def test_cpu_dropout_saves_eagers_float_noise(direct, monkeypatch):
    """On CPU, eager's dropout with p > 0 is ATen's `_dropout_impl` (the fused kernel is CUDA-only): autograd
    saves a float noise tensor, not native_dropout's bool mask (tracer/capture/eager_kernels.py). Dropout on
    attention probabilities, after an activation, on a residual branch and in nn.TransformerEncoderLayer:
    every phase exact against a real CPU step; a CUDA target saves the 1-byte masks instead."""
    import os
    from truth import assert_step_exact

    _on_rung(direct, monkeypatch)
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "dropout_train.py")
    graph = capture_step(load_model_source(model), CaptureOptions(batch=2, seq=16, target="cpu"))
    assert graph.config.capture_path == ("aot-joint" if direct else "export-joint")
    predicted = analyze_graph(graph).policies["eager"]
    source = load_model_source(model)
    torch.manual_seed(0)
    built = source.build_model()
    measured = measure_step(built, source.example_batch(2, 16), torch.optim.AdamW(built.parameters()))
    assert_step_exact(predicted, measured, scalar_bytes=0)
    cuda = analyze_graph(capture_step(load_model_source(model), CaptureOptions(batch=2, seq=16, target="cuda")))
    assert cuda.policies["eager"].saved.total_bytes < predicted.saved.total_bytes


def test_what_autograd_holds_without_backward_reading_it_is_held_as_in_eager():
    """A custom Function's `ctx.save_for_backward` of a mask its backward never reads is saved until that
    node's backward; a pooling branch the loss ignores keeps what its nodes saved (a tanh's output, the
    copy a matmul of a transposed input makes) until forward returns. Both are seen on the direct trace."""
    import os
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "autograd_holds.py")
    source = load_model_source(model)
    graph = capture_step(source, CaptureOptions(batch=2, seq=16, target="cpu"))
    assert graph.config.capture_path == "aot-joint"
    predicted = analyze_graph(graph).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(2, 16), torch.optim.AdamW(real.parameters(), lr=1e-3))
    mask = [op for op in graph.ops if op.source is not None and "mask = " in op.source.code and not op.is_view][-1]
    assert mask.outputs[0].storage_id in predicted.saved.storage_ids      # no backward op reads it
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert {name: p.peak_bytes for name, p in predicted.phases.items()} == measured.phase_peaks
