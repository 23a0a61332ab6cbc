"""Mixture of experts: the routing assumption (tracer/capture/routing.py) vs real CPU steps whose routers
are made to route exactly as assumed, so the prediction must be exact."""
import json
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.errors import ExitCode
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
MOE = os.path.join(FIXTURES, "moe_router.py")


def _predict(source, **options):
    graphs = capture_steps(source, CaptureOptions(**options), (PolicySpec(name="eager"),))
    return graphs["eager"], analyze_graphs(graphs).policies["eager"]


def _assert_exact(predicted, measured):
    """Saved bytes exact; phase peaks within 8 bytes: the 0-dim tensor eager wraps a Python scalar in
    (`... * 1e4`, a double) lives during the forward op that reads it and is not in the graph
    (the same remainder as tests/accuracy/test_eager_step.py)."""
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert 0 <= m - p <= 8, f"{phase}: predicted {p:,} measured {m:,}"


def _measure(source, batch, seq):
    torch.manual_seed(0)
    model = source.build_model()
    return measure_step(model, source.example_batch(batch, seq),
                        torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))


def test_balanced_routing_of_a_hand_written_moe_is_exact_against_a_real_step():
    source = load_model_source(MOE)
    graph, predicted = _predict(source, batch=2, seq=16, target="cpu", moe_routing="balanced")
    _assert_exact(predicted, _measure(source, 2, 16))
    notes = "\n".join(graph.config.notes)
    assert "routing assumed balanced at the router aten.topk at moe_router.py:39" in notes
    assert "16 each" in notes
    assert "aten.nonzero at moe_router.py:43 has a data-dependent size" in notes
