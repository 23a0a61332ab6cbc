"""What the compiled policies refuse or flag: an op Inductor cannot lower as the step was traced refuses them
with the model's line (tracer.capture.inductor_plan), in the C++ plan and in Triton's, never as an internal
error; a recurrent layer, where torch.compile breaks the graph, is flagged (tracer.capture.policies)."""
import os

import pytest
from torch import nn

from tracer.capture import CaptureOptions, PolicySpec, capture_step, load_model_source
from tracer.capture import triton_target
from tracer.capture.policies import recurrent_graph_break_notes
from tracer.errors import CaptureError

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
MASK_SELECTED_ROWS = os.path.join(FIXTURES, "constant_selected_rows.py")
GRU_LM = os.path.join(FIXTURES, "gru_lm.py")
TRITON = pytest.mark.skipif(triton_target.triton_unavailable() is not None,
                            reason=f"no Triton plan here: {triton_target.triton_unavailable()}")


@pytest.mark.parametrize("target", ["cpu", pytest.param("cuda:h100", marks=TRITON)])
def test_rows_picked_by_a_boolean_mask_refuse_the_compiled_policy_at_their_line(target):
    """`out[mask] = adapter(h[mask])`: the capture knows how many rows the mask picks (it follows from a
    constant), Inductor's lowering of the picked rows expects a size it cannot know and asserts; torch.compile
    would break the graph there."""
    with pytest.raises(CaptureError, match=r"constant_selected_rows\.py:24 \(out\[mask\] = adapter\(h\[mask\]\).*"
                                           r"\): Inductor cannot lower aten\.") as refused:
        capture_step(load_model_source(MASK_SELECTED_ROWS), CaptureOptions(seq=64, target=target),
                     PolicySpec(name="compiled"))
    assert "use --policy eager, full or selective" in refused.value.hint


def test_a_recurrent_layer_is_flagged_where_torch_compile_breaks_the_graph():
    """Dynamo's `allow_rnn` is off by default: torch.compile runs an nn.GRU eagerly between compiled graphs,
    and the compiled policy, which plans one graph, says so."""
    graph = capture_step(load_model_source(GRU_LM), CaptureOptions(seq=8, target="cpu"), PolicySpec(name="compiled"))
    assert any("torch.compile breaks the graph at GRU" in note for note in graph.config.notes)
    assert recurrent_graph_break_notes(nn.Sequential(nn.Linear(4, 4), nn.ReLU())) == ()
    assert "at LSTM, RNN " in recurrent_graph_break_notes(nn.ModuleList([nn.RNN(4, 4), nn.LSTM(4, 4)]))[0]
