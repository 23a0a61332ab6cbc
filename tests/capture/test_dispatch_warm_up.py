"""The op-by-op rung's steady step: the optimizer state is primed on fake gradients without running the
model, and the recorded step shows whether the model's first step differs from the next; where it does, the
step is recorded again after a whole warm-up step. Either way the step equals the one recorded after a
whole warm-up step, and a real step's phase peaks."""
import dataclasses
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture import dispatch
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
MODEL = os.path.join(FIXTURES, "first_call_state.py")


def _capture(source, options, monkeypatch, *, whole_warm_up: bool):
    recorded = []
    inner = dispatch.capture_step_dispatch

    def spy(src, opts, *, chosen=False, warm_up_step=False, vouched=False):
        recorded.append(warm_up_step)
        return inner(src, opts, chosen=chosen, warm_up_step=warm_up_step or whole_warm_up, vouched=vouched)

    monkeypatch.setattr("tracer.capture.capture_step_dispatch", spy)
    monkeypatch.setattr(dispatch, "capture_step_dispatch", spy)
    graph = capture_steps(source, options, (PolicySpec(name="eager"),))["eager"]
    monkeypatch.undo()
    return graph, recorded


@pytest.mark.parametrize("state, recorded_again", [("none", False), ("cache", True), ("flag", True),
                                                   ("unused", True)])
def test_a_step_primed_without_the_model_is_kept_only_when_the_first_step_leaves_nothing(
        state, recorded_again, monkeypatch):
    source = load_model_source(MODEL, model_args=(f"state={state}",))
    options = CaptureOptions(batch=2, seq=16, capture="dispatch", target="cpu")
    primed, recorded = _capture(source, options, monkeypatch, whole_warm_up=False)
    assert recorded == ([False, True] if recorded_again else [False])
    warmed, _ = _capture(source, options, monkeypatch, whole_warm_up=True)
    assert primed.ops == warmed.ops and primed.storages == warmed.storages

    predicted = analyze_graphs({"eager": primed}).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(2, 16), torch.optim.AdamW(real.parameters(), lr=1e-3))
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase


def test_a_loop_that_differentiates_its_gradients_takes_a_whole_warm_up_step(monkeypatch):
    """Its optimizer reads the gradients' graph, which only a backward with create_graph makes."""
    source = dataclasses.replace(load_model_source(MODEL), create_graph=True)
    options = CaptureOptions(batch=2, seq=16, capture="dispatch", target="cpu")
    calls = []
    monkeypatch.setattr(dispatch, "_prime_optimizer", lambda *a, **k: calls.append(a))
    capture_steps(source, options, (PolicySpec(name="eager"),))
    assert calls == []
