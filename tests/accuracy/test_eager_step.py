"""Predicted eager memory vs a real eager CPU step measured at storage level (tests/truth.py).

Tolerance: 0.1% of the measured value for peaks (measured remainders: at most 8 bytes of 0-dim scalar
tensors that eager makes in forward; kernel scratch is invisible to both sides). Saved-for-backward
bytes must be exact. Each test states which phase the real peak falls in.
"""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def predict_and_measure(model, *, batch, seq, precision="fp32", optimizer="adamw", foreach=True,
                        step="steady", set_to_none=True):
    source = load_model_source(model)
    options = CaptureOptions(batch=batch, seq=seq, precision=precision, optimizer=optimizer, foreach=foreach,
                             step=step, zero_grad_set_to_none=set_to_none)
    analysis = analyze_graph(capture_step(source, options))
    torch.manual_seed(0)
    real = source.build_model()
    real_batch = source.example_batch(batch, seq)
    if source.make_optimizer is not None:
        opt = source.make_optimizer(real.parameters())
    elif optimizer == "adamw":
        opt = torch.optim.AdamW(real.parameters(), lr=1e-3, foreach=foreach)
    elif optimizer == "sgd":
        opt = torch.optim.SGD(real.parameters(), lr=1e-2, momentum=0.9, foreach=foreach)
    else:
        opt = None
    measured = measure_step(real, real_batch, opt, precision=precision, steady=step == "steady",
                            set_to_none=set_to_none)
    return analysis.policies["eager"], measured


def assert_close(predicted: int, measured: int, what: str, rel: float = 0):
    """Within `rel` of the measurement (0: to the byte, as every step here is)."""
    assert abs(predicted - measured) <= rel * measured, f"{what}: predicted {predicted:,} vs measured {measured:,}"


def assert_step_matches(result, measured, *, peak_phase, phases=("forward", "backward", "optimizer")):
    assert result.start_bytes == measured.start_bytes
    assert_close(result.peak_bytes, measured.peak_bytes, "peak")
    assert measured.peak_phase == peak_phase
    assert result.peak_phase == peak_phase
    for phase in phases:
        assert_close(result.phases[phase].peak_bytes, measured.phase_peaks[phase], f"{phase} peak")
    assert result.saved.total_bytes == measured.saved_bytes


def test_llama88m_fp32_foreach_adamw_steady_peak_in_optimizer():
    result, measured = predict_and_measure("llama-88m", batch=2, seq=256)
    assert_step_matches(result, measured, peak_phase="optimizer")
    # the foreach sqrt temporary of exp_avg_sq is the peak (shared/notes/GROUND_TRUTH.md 1.3)
    assert result.peak_op.target == "aten._foreach_sqrt.default"
    predicted_lines = {f"{os.path.basename(r.source.file)}:{r.source.line}": r.bytes_at_peak
                       for r in result.at_peak.lines if r.source}
    measured_top = sorted(((b, line) for line, b in measured.lines_at_peak.items() if ":" in line), reverse=True)[:6]
    for nbytes, line in measured_top:
        assert predicted_lines.get(line) == nbytes, f"{line}: predicted {predicted_lines.get(line)} measured {nbytes}"


def test_llama88m_bf16_autocast_every_phase():
    """Under autocast the bf16 logits stay referenced by the `logits` local while cross_entropy runs on
    their fp32 copy: the forward peak is right only because Python locals are modelled (pylocals)."""
    result, measured = predict_and_measure("llama-88m", batch=2, seq=256, precision="bf16")
    assert_step_matches(result, measured, peak_phase="optimizer")


@pytest.mark.parametrize("foreach", [True, False])
def test_fp16_autocast_with_grad_scaler_every_phase(foreach):
    """--precision fp16: autocast(float16), scaler.scale(loss).backward(), scaler.step(opt), scaler.update():
    the scaled loss, unscale_'s inverse scale and inf flags, and the scaler's state before the step."""
    result, measured = predict_and_measure("llama-debug", batch=2, seq=64, precision="fp16", foreach=foreach)
    assert_step_matches(result, measured, peak_phase=measured.peak_phase)
    assert result.phases["optimizer"].peak_bytes == measured.phase_peaks["optimizer"]


@pytest.mark.parametrize("model", ["llama-debug", "gpt2-debug"])
@pytest.mark.parametrize("precision", ["fp16", "bf16"])
def test_autocasts_copy_of_a_calls_argument_lives_until_the_call_returns(model, precision):
    """`F.cross_entropy` of half-precision logits under autocast: autocast hands the kernel an fp32 copy of
    them, alive while `nll_loss` makes the loss although `log_softmax` read it last. Every phase peak and
    the saved bytes equal the real step's to the byte (the forward peak was 8 B low: the loss and its total
    weight allocated after the copy was freed)."""
    result, measured = predict_and_measure(model, batch=2, seq=64, precision=precision)
    assert result.start_bytes == measured.start_bytes
    assert result.saved.total_bytes == measured.saved_bytes
    assert {p: result.phases[p].peak_bytes for p in ("forward", "backward", "optimizer")} == measured.phase_peaks


def test_llama_4_layers_long_sequence_peak_in_backward():
    result, measured = predict_and_measure(os.path.join(FIXTURES, "llama4.py"), batch=4, seq=1024)
    assert_step_matches(result, measured, peak_phase="backward")


def test_first_step_creates_optimizer_state_lazily():
    first, measured_first = predict_and_measure("llama-debug", batch=2, seq=64, step="first")
    steady, measured_steady = predict_and_measure("llama-debug", batch=2, seq=64, step="steady")
    assert_step_matches(first, measured_first, peak_phase=measured_first.peak_phase)
    assert_step_matches(steady, measured_steady, peak_phase=measured_steady.peak_phase)
    # no optimizer state exists before a first step: the real step starts lower by Adam's two moments + steps
    assert measured_first.start_bytes < measured_steady.start_bytes
    assert first.phases["optimizer"].peak_bytes == measured_first.phase_peaks["optimizer"]


@pytest.mark.parametrize("foreach", [True, False])
def test_sgd_with_momentum(foreach):
    result, measured = predict_and_measure("llama-debug", batch=2, seq=64, optimizer="sgd", foreach=foreach)
    assert_step_matches(result, measured, peak_phase=measured.peak_phase)


def test_for_loop_adamw():
    result, measured = predict_and_measure("llama-debug", batch=2, seq=64, foreach=False)
    assert_step_matches(result, measured, peak_phase=measured.peak_phase)


def test_custom_python_optimizer():
    result, measured = predict_and_measure(os.path.join(FIXTURES, "custom_optimizer.py"), batch=2, seq=64)
    assert_step_matches(result, measured, peak_phase=measured.peak_phase)


def test_zero_grad_keeps_gradients_between_steps():
    result, measured = predict_and_measure("llama-debug", batch=2, seq=64, set_to_none=False)
    assert_step_matches(result, measured, peak_phase=measured.peak_phase)
    param_bytes = sum(p.numel() * p.element_size() for p in load_model_source("llama-debug").build_model().parameters())
    assert result.at_peak.by_category["gradient"] == param_bytes   # kept gradients are live all step long


def test_gpt2_debug_fp32():
    result, measured = predict_and_measure("gpt2-debug", batch=2, seq=64)
    assert_step_matches(result, measured, peak_phase=measured.peak_phase)


def test_a_forward_that_rewrites_its_input_in_place_is_exact():
    """The graph's new value of a mutated user input (an AOT input with no module path) is the input's own
    storage written in place, as eager does; its name says which input. Every phase peak is exact."""
    model = os.path.join(FIXTURES, "input_mutated.py")
    result, measured = predict_and_measure(model, batch=2, seq=16)
    for phase in ("forward", "backward", "optimizer"):
        assert result.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert result.saved.total_bytes == measured.saved_bytes
    names = [s.name for s in result.graph.storages]
    assert "input 1 (updated in place)" in names


def test_a_parameter_clamped_through_data_in_forward_is_written_in_place():
    """`weight.data.clamp_(...)` in forward: the graph copies the parameter (a mutation autograd does not
    see) and the linear saves the copy; eager writes the parameter's own storage and saves the parameter."""
    model = os.path.join(FIXTURES, "parameter_clamped_in_forward.py")
    result, measured = predict_and_measure(model, batch=2, seq=16)
    for phase in ("forward", "backward", "optimizer"):
        assert result.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert result.saved.total_bytes == measured.saved_bytes
    assert not any("updated in place" in s.name for s in result.graph.storages)   # no storage of its own


def test_an_assertion_on_activation_values_is_taken_as_passing_and_noted():
    """The assert reads a value fake tensors do not have: read as False it would stop the step; the step
    that runs passes it, so the read is True, while the joint graph is traced (no fall to the op-by-op
    rung), and the report says so."""
    model = os.path.join(FIXTURES, "asserts_on_values.py")
    result, measured = predict_and_measure(model, batch=2, seq=16)
    assert result.graph.config.capture_path == "aot-joint"
    for phase in ("forward", "backward", "optimizer"):
        assert result.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert result.saved.total_bytes == measured.saved_bytes
    assert any("assertion at asserts_on_values.py:21" in note and "passing" in note
               for note in result.graph.config.notes)


def test_a_negated_assertion_reads_the_value_that_lets_it_pass(tmp_path):
    """`assert not h.isnan().any()` passes when the value read is False: read as True, as a plain
    `assert (h >= 0).all()` reads, it stopped every capture path with an AssertionError."""
    model = tmp_path / "negated_assert.py"
    model.write_text(open(os.path.join(FIXTURES, "asserts_on_values.py")).read().replace(
        '        assert h_max.isnan().sum() == 0, "NaN in the activations"\n',
        '        assert not h.isnan().any()\n        assert not (not (h >= 0).all())\n'))
    result, measured = predict_and_measure(str(model), batch=2, seq=16)
    for phase in ("forward", "backward", "optimizer"):
        assert result.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert result.saved.total_bytes == measured.saved_bytes
    assert sum("negated_assert.py:21" in note or "negated_assert.py:22" in note
               for note in result.graph.config.notes) == 2


def test_a_weight_gradient_in_another_layout_is_copied_by_accumulate_grad():
    """A Conv2d fed a channels_last view (`permute(0, 2, 1).reshape(...)`, PVT's spatial reduction) returns
    its weight gradient channels_last; AccumulateGrad copies it into the weight's contiguous layout
    (`clone_obey_contract`) after the convolution's node has released what it saved, so for a moment both
    gradients are live."""
    result, measured = predict_and_measure(os.path.join(FIXTURES, "conv_channels_last_input.py"), batch=2, seq=16)
    assert_step_matches(result, measured, peak_phase="optimizer")
    assert result.phases["backward"].peak_bytes == measured.phase_peaks["backward"]
    assert any(op.name == "accumulate_grad_reduce.weight" for op in result.graph.ops)
