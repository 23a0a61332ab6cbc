"""Gradient accumulation (--accumulate N) predicted vs a real CPU step of N micro-batches measured at storage
level: steady state (optimizer state present), zero_grad(set_to_none=True) after the step. Every phase of
every micro-batch, the peak, the memory before the step and the saved bytes are exact to the byte."""
import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph
from truth import StorageTracker, _batch_tensors


def measure_accumulated_step(model, micro_batches, optimizer):
    """One warm-up step, then one tracked step: forward and backward of each micro-batch (`loss` rebound
    by each forward), optimizer step, zero_grad(set_to_none=True)."""
    def step(tracker=None):
        for k, batch in enumerate(micro_batches, start=1):
            if tracker is not None:
                tracker.phase = f"forward (micro-batch {k})"
            loss = model(*batch)
            if tracker is not None:
                tracker.phase = f"backward (micro-batch {k})"
            loss.backward()
        if tracker is not None:
            tracker.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = StorageTracker()
    tracker.track_existing(list(model.parameters()) + list(model.buffers()), "model")
    tracker.track_existing([t for batch in micro_batches for t in _batch_tensors(batch)], "input")
    tracker.track_existing([v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)],
                           "optimizer_state")
    start = tracker.current
    param_keys = {p.untyped_storage()._cdata for p in model.parameters()}
    saved: dict[tuple[str, int], int] = {}      # per micro-batch (a freed storage's address is reused later)

    def pack(t):
        if t.untyped_storage()._cdata not in param_keys:
            saved.setdefault((tracker.phase, t.untyped_storage()._cdata), t.untyped_storage().nbytes())
        return t

    with tracker, torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        step(tracker)
    return start, tracker, sum(saved.values())


def predict_and_measure(model: str, accumulate: int, *, batch=2, seq=64):
    source = load_model_source(model)
    options = CaptureOptions(batch=batch, seq=seq, accumulate=accumulate, target="cpu")
    result = analyze_graph(capture_step(source, options)).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    micro_batches = [source.example_batch(batch, seq) for _ in range(accumulate)]
    opt = torch.optim.AdamW(real.parameters(), lr=1e-3)
    return result, measure_accumulated_step(real, micro_batches, opt)


@pytest.mark.parametrize("accumulate", [2, 3])
def test_accumulated_step_is_exact_in_every_micro_batch(accumulate):
    result, (start, tracker, saved_bytes) = predict_and_measure("llama-debug", accumulate)
    assert result.start_bytes == start
    assert {name: p.peak_bytes for name, p in result.phases.items()} == tracker.phase_peaks
    assert list(result.phases) == [f"{phase} (micro-batch {k})" for k in range(1, accumulate + 1)
                                   for phase in ("forward", "backward")] + ["optimizer"]
    assert result.peak_bytes == tracker.peak and result.peak_phase == tracker.peak_phase
    assert result.saved.total_bytes == saved_bytes


def test_later_micro_batches_run_with_the_gradients_resident():
    """No gradient exists in the first forward of a step (set to None); every later forward runs over all of
    them: its peak is higher by exactly the gradients' bytes."""
    result, _ = predict_and_measure("llama-debug", 2)
    grad_bytes = sum(s.nbytes for s in result.graph.storages if s.role.value == "gradient")
    first, second = result.phases["forward (micro-batch 1)"], result.phases["forward (micro-batch 2)"]
    assert second.peak_bytes - first.peak_bytes == grad_bytes + 4      # + the first micro-batch's 0-dim loss
    assert result.graph.config.accumulate == 2
