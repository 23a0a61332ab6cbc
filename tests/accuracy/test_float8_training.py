"""FP8 training as torchao writes it (`convert_to_float8_training`), against a real CPU step: torchao's
Float8Linear runs forward and backward on the CPU, so the step can be measured here.

Measured (batch 4, seq 128, the fixture's 2 blocks of width 64):
  * at the storage level (tests/truth.py `measure_step`, what the dispatcher sees): every phase is exact.
    Backward was 3.1% low (5,634,892 B against 5,815,124 B) until the capture watched the Python backward
    of torchao's `matmul_with_hp_or_float8_args`, which holds its float8 casts as locals until it returns;
  * at the allocator (`measure_step_at_allocator`), also the CPU's emulated torch._scaled_mm (this build has
    no float8 oneDNN kernel): float copies of both operands and a float product inside the kernel, noted in
    the report and not counted.
"""
import os

import pytest
import torch

import tracer
from tracer.capture import load_model_source
from truth import measure_step

pytest.importorskip("torchao")
FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "float8_training.py")


def _real():
    source = load_model_source(FIXTURE)
    torch.manual_seed(0)
    model = source.build_model()
    return measure_step(model, source.example_batch(4, 128), torch.optim.AdamW(model.parameters()))


def _predicted():
    return tracer.analyze(FIXTURE, batch=4, seq=128, target="cpu").policies["eager"]


def test_float8_forward_and_optimizer_step_are_exact_at_the_storage_level():
    predicted, measured = _predicted(), _real()
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase


def test_float8_backward_is_exact_at_the_storage_level():
    """torchao's Python backward keeps its float8 casts (tensor subclasses) as locals until it returns:
    the capture watches that code's torch calls and the subclasses' inner tensors."""
    assert _predicted().phases["backward"].peak_bytes == _real().phase_peaks["backward"]


def test_the_cpus_emulated_scaled_mm_scratch_is_named():
    assert any("torch._scaled_mm" in note for note in _predicted().graph.config.notes)


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_the_fp8_flag_converts_as_torchao_and_is_exact_at_the_storage_level(recipe):
    """--fp8 RECIPE on a model that does not convert itself: the prediction against a real step of the
    model converted the same way (capture/float8.py's conversion, torchao's own Float8Linear)."""
    from tracer.capture.float8 import convert_for_float8
    model = os.path.join(os.path.dirname(FIXTURE), "saved_on_cpu.py")
    predicted = tracer.analyze(model, batch=4, seq=64, target="cpu", fp8=recipe,
                               model_args=("offload=False",)).policies["eager"]
    source = load_model_source(model)
    torch.manual_seed(0)
    real = convert_for_float8(source.build_model(offload=False), recipe)
    assert sum(type(m).__name__ == "Float8Linear" for m in real.modules()) == 6      # 3 blocks x 2, not the head
    measured = measure_step(real, source.example_batch(4, 64), torch.optim.AdamW(real.parameters()))
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    plain = tracer.analyze(model, batch=4, seq=64, target="cpu", model_args=("offload=False",)).policies["eager"]
    assert predicted.peak_bytes != plain.peak_bytes
