"""FP8 training as torchao writes it (`convert_to_float8_training`), against a real CPU step: torchao's
Float8Linear runs forward and backward on the CPU, so the step can be measured here.

Measured (batch 4, seq 128, the fixture's 2 blocks of width 64):
  * at the storage level (tests/truth.py `measure_step`, what the dispatcher sees): the forward and the
    optimizer step are exact; backward is 3.1% low (5,634,892 B predicted, 5,815,124 B measured): the
    Python backward of torchao's `matmul_with_hp_or_float8_args` holds its float8 casts and grad_input as
    locals until it returns, which the capture does not observe (it frees each after its last use);
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


@pytest.mark.xfail(strict=True, reason="a custom Function's Python backward keeps its locals until it returns "
                                       "(torchao's float8 casts and grad_input): not observed, 3.1% low")
def test_float8_backward_is_exact_at_the_storage_level():
    assert _predicted().phases["backward"].peak_bytes == _real().phase_peaks["backward"]


def test_the_cpus_emulated_scaled_mm_scratch_is_named():
    assert any("torch._scaled_mm" in note for note in _predicted().graph.config.notes)
