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
    monkeypatch.setattr(capture, "expression_holds", lambda ops: {})
    last_use, _ = predict_and_measure(FIXTURE, batch=2, seq=256, optimizer="none")
    attention_fp32 = 2 * 4 * 256 * 256 * 4
    assert result.peak_bytes - last_use.peak_bytes == attention_fp32 == measured.peak_bytes - last_use.peak_bytes
