"""Eager backward formulas are C++ full expressions: their temporaries live until the expression is done
(tracer/capture/formulas.py). A hand-written softmax's division backward holds the step's peak here."""
import os

import pytest

import tracer.capture as capture
from test_eager_step import assert_step_matches, predict_and_measure

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "handwritten_softmax_attention.py")


def test_the_division_backward_keeps_its_temporaries_to_the_end_of_the_expression():
    result, measured = predict_and_measure(FIXTURE, batch=2, seq=256, optimizer="none")
    assert measured.peak_phase == "backward"
    assert_step_matches(result, measured, peak_phase="backward", phases=("forward", "backward"))


def test_freeing_them_at_their_last_use_would_predict_a_lower_peak(monkeypatch):
    result, measured = predict_and_measure(FIXTURE, batch=2, seq=256, optimizer="none")
    monkeypatch.setattr(capture, "expression_holds", lambda ops, python_nodes=frozenset(): {})
    last_use, _ = predict_and_measure(FIXTURE, batch=2, seq=256, optimizer="none")
    attention_fp32 = 2 * 4 * 256 * 256 * 4
    assert result.peak_bytes - last_use.peak_bytes == attention_fp32 == measured.peak_bytes - last_use.peak_bytes


def test_a_custom_autograd_functions_python_backward_frees_at_last_use(tmp_path):
    """A custom autograd.Function's backward is Python code: its temporaries die at their last use, and
    the capture records the Function's node (Function.apply) so the C++ rule leaves it alone."""
    model = tmp_path / "custom_function.py"
    model.write_text(CUSTOM_FUNCTION_MODEL)
    result, measured = predict_and_measure(str(model), batch=4, seq=256, optimizer="none")
    assert_step_matches(result, measured, peak_phase=measured.peak_phase, phases=("forward", "backward"))


CUSTOM_FUNCTION_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class TanhGelu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        t = torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x))
        return g * (0.5 * x * ((1 - t * t) * (0.79788456 + 0.1070322243 * x * x)) + 0.5 * (1 + t))


class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(32, 256)
        self.down = nn.Linear(256, 32)

    def forward(self, x, y):
        return F.mse_loss(self.down(TanhGelu.apply(self.up(x))), y)


def build_model():
    return M()


def example_batch(batch, seq):
    return torch.randn(batch, seq, 32), torch.randn(batch, seq, 32)
'''
