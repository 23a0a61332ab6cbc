"""Autocast's weight-cast cache (tracer/capture/autocast_cache.py) against real CPU steps: CPU autocast keeps
the same cache as CUDA's. Under bf16 and fp16 autocast, with no checkpointing, reentrant and non-reentrant
checkpointing, every phase peak and what is live when the forward ends are exact: a checkpointed forward
ends holding a low-precision copy of every trainable weight an autocast op read, while frozen weights and the
model's own casts are not cached."""
import dataclasses
import os

import pytest
import torch

from test_checkpoint_as_written import _hf_source
from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
from truth import assert_step_exact, measure_step

pytestmark = pytest.mark.slow

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
BATCH, SEQ = 2, 32


def _fixture(**net_kwargs):
    source = load_model_source(os.path.join(FIXTURES, "autocast_cached_weights.py"))
    net = source.build_model.__globals__["Net"]
    return dataclasses.replace(source, build_model=lambda: net(**net_kwargs))


def _predict(source, precision):
    graphs = capture_steps(source, CaptureOptions(batch=BATCH, seq=SEQ, target="cpu", precision=precision),
                           (PolicySpec(name="eager"),))
    return analyze_graphs(graphs).policies["eager"]


def _measure(source, precision):
    torch.manual_seed(0)
    model = source.build_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return measure_step(model, source.example_batch(BATCH, SEQ), optimizer, precision=precision)


def _live_when_forward_ends(predicted) -> int:
    last_forward = max(op.index for op in predicted.graph.ops if op.phase.value == "forward")
    return predicted.liveness.live_after[last_forward]


def _assert_phases_exact(predicted, measured, scalar_bytes=0):
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert abs(p - m) <= scalar_bytes, f"{phase}: predicted {p:,} measured {m:,}"


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("checkpoint", [None, "reentrant", "non-reentrant"])
def test_cached_casts_live_until_the_autocast_region_exits(precision, checkpoint):
    """A reentrant region's forward runs under no_grad and a non-reentrant one drops what it saves, yet both
    leave every cached weight copy alive until autocast exits after the loss: 198,528 B more than the
    copies' own uses would keep on this model, which the prediction lacked before the cache was modelled.
    Each recompute in backward is an autocast region of its own. Under fp16 the loop holds `loss` through the
    step and `scaler.scale(loss)` through backward. (Saved bytes are not compared for reentrant regions:
    CheckpointFunction holds its inputs outside the saved-tensor hooks.)"""
    source = _fixture(checkpoint=checkpoint)
    predicted, measured = _predict(source, precision), _measure(source, precision)
    if checkpoint == "reentrant":      # the backward: test_reentrant_backward_under_autocast below
        assert predicted.start_bytes == measured.start_bytes
        assert predicted.phases["forward"].peak_bytes == measured.phase_peaks["forward"]
    else:
        assert_step_exact(predicted, measured, scalar_bytes=0)
    # fp16: the captured forward ends with `scaler.scale(loss)` (4 B), the measured one just before it
    scaled_loss_bytes = 4 if precision == "fp16" else 0
    assert _live_when_forward_ends(predicted) == measured.forward_end_bytes + scaled_loss_bytes


def test_reentrant_backward_under_autocast():
    """A reentrant rerun's input is a detached leaf, so the two layers that read it share one cached bf16
    copy: eager adds their bf16 gradients in that copy's cast-back node and casts once (one bf16 (2, 32, 64)
    gradient, 8,192 B, below casting each back and summing in float32), and the report says so."""
    source = _fixture(checkpoint="reentrant")
    predicted = _predict(source, "bf16")
    _assert_phases_exact(predicted, _measure(source, "bf16"))
    notes = [n for n in predicted.graph.config.notes if n.startswith("autocast cast cache")]
    assert len(notes) == 1 and "a reentrant region's input" in notes[0] and "summed in bfloat16 before one" in notes[0]


@pytest.mark.parametrize("repeats", [1, 2])
def test_a_weight_read_twice_in_one_region_is_cast_once(repeats):
    """The first block runs again after the last (once or twice): eager returns the cached copy for the later
    calls, so its weights cost one bf16 copy (was 2,112 B over in forward), their gradients meet in the
    copy's one cast-back, and the report names the shared copies."""
    source = _fixture(repeat_first=repeats)
    predicted, measured = _predict(source, "bf16"), _measure(source, "bf16")
    assert_step_exact(predicted, measured)
    assert _live_when_forward_ends(predicted) == measured.forward_end_bytes
    notes = [n for n in predicted.graph.config.notes if n.startswith("autocast cast cache")]
    assert len(notes) == 1 and "blocks.0.up.weight" in notes[0] and "bfloat16 copy" in notes[0]


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("reentrant", [True, False])
def test_transformers_gradient_checkpointing_under_bf16_autocast(reentrant):
    """transformers' Llama with gradient_checkpointing_enable(), as Trainer(bf16=True, gradient_checkpointing=
    True) runs it: each layer's cached weight copies outlive the layer's checkpointed forward."""
    source = _hf_source("hf:llama", "sdpa", reentrant=reentrant)
    predicted = analyze_graphs(capture_steps(source, CaptureOptions(batch=2, seq=64, target="cpu", precision="bf16"),
                                             (PolicySpec(name="eager"),))).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(2, 64),
                            torch.optim.AdamW(model.parameters(), lr=1e-3), precision="bf16")
    _assert_phases_exact(predicted, measured, scalar_bytes=0)
    assert _live_when_forward_ends(predicted) == measured.forward_end_bytes
