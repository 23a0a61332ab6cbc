"""Eager's in-place torch calls in the functional joint graph (tracer/capture/inplace.py): the direct
trace marks the nodes of each in-place call, and the call's functional op writes into the storage of
the tensor it was called on, as eager does; an out-of-place call allocates."""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tracer.capture import CaptureOptions, PolicySpec, capture_steps
from tracer.capture.inplace import is_inplace_call
from tracer.capture.model_input import ModelSource


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x, index):
        h = self.lin(x)                                   # (n, 8)
        out = torch.zeros_like(h)
        out.index_add_(0, index, h)                       # writes into `out`
        out.masked_fill_(out > 10, 0.0)                   # writes into `out`
        out += h                                          # writes into `out`
        g = F.relu(out, inplace=True)                     # writes into `out` (relu saves it: nothing after writes)
        fresh = g.mul(2.0)                                # a new tensor
        return fresh.sum()


def _graph(direct: bool):
    """The step on the direct trace, or on the export rung (the direct trace made to step aside)."""
    from tracer import capture
    source = ModelSource(name="inplace", path=None, build_model=_InPlace,
                         example_batch=lambda batch, seq: (torch.randn(batch * seq, 8), torch.arange(batch * seq)))
    real = capture.export_joint

    def export_joint(*args, direct=False, _allowed=direct, **kwargs):
        return real(*args, direct=direct and _allowed, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capture, "export_joint", export_joint)
        graphs = capture_steps(source, CaptureOptions(batch=2, seq=4, target="cpu"), (PolicySpec(name="eager"),))
    return graphs["eager"]


@pytest.mark.parametrize("direct, path", [(True, "aot-joint"), (False, "export-joint")])
def test_in_place_calls_write_into_their_tensors_storage(direct, path):
    """On the direct trace the calls are marked; on the export rung export's `torch_fn` names them (the
    kwarg form `inplace=True` is not named there: its relu allocates)."""
    graph = _graph(direct)
    assert graph.config.capture_path == path
    forward = [op for op in graph.ops if op.phase.value == "forward"]
    zeros = next(op for op in forward if op.target == "aten.zeros_like.default")
    in_place = ("aten.index_add.default", "aten.masked_fill.Scalar", "aten.add.Tensor") + (
        ("aten.relu.default",) if path == "aot-joint" else ())
    written = {op.target: op.outputs[0].storage_id for op in forward if op.target in in_place}
    assert set(written) == set(in_place)
    assert set(written.values()) == {zeros.outputs[0].storage_id}
    mul = next(op for op in forward if op.target == "aten.mul.Tensor")
    assert mul.outputs[0].storage_id != zeros.outputs[0].storage_id


def test_which_calls_are_in_place():
    assert is_inplace_call(torch.Tensor.add_) and is_inplace_call(torch.Tensor.__iadd__)
    assert is_inplace_call(torch.Tensor.__setitem__) and is_inplace_call(F.relu, {"inplace": True})
    assert not is_inplace_call(torch.Tensor.add) and not is_inplace_call(F.relu, {"inplace": False})
    assert not is_inplace_call(torch.Tensor.requires_grad_) and not is_inplace_call(torch.Tensor.__add__)


def _predicted_and_measured(path: str, batch: int, seq: int):
    import os

    from tracer.capture import load_model_source
    from tracer.capture.build import StepModule
    from tracer.passes.analysis import analyze_graphs
    from truth import measure_step
    source = load_model_source(os.path.join(os.path.dirname(__file__), "..", "fixtures", path))
    graphs = capture_steps(source, CaptureOptions(batch=batch, seq=seq, target="cpu"), (PolicySpec(name="eager"),))
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(StepModule(model, loss_fn=source.loss_fn, loss_index=source.loss_index),
                            source.example_batch(batch, seq), torch.optim.AdamW(model.parameters(), lr=1e-3))
    return graphs["eager"], predicted, measured


def test_writes_through_nested_views_and_their_copyslices_backward_allocate_as_in_eager():
    """`out[:, -1, :, w:] = x` and its kin (two and three levels of views): the forward's calls are marked,
    and CopySlices' backward `grad_slice.copy_(...)` is put back by a `slice_scatter` into a `select` of its
    gradient, then a `select_scatter`: both write into the storage they already have (was one base-sized
    gradient over per assignment in backward)."""
    graph, predicted, measured = _predicted_and_measured("nested_view_writes.py", 2, 64)
    assert graph.config.capture_path == "aot-joint"
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert predicted.saved.total_bytes == measured.saved_bytes
