"""torchtune's Llama 3.2 (issue 35, item 1): its own `llama3_2` component builder at a small size (scaled
RoPE built from a Python list of computed 0-dim tensors, tied embedding) against a real CPU step.

torchtune 0.6 imports `torchao.dtypes.nf4tensor`, which torchao 0.18 (the test extras' FP8 tests) no longer
has, so torchtune is not in the test extras: this test runs where torchtune and a torchao before 0.14 are
installed (`pip install torch==2.13.0 torchtune "torchao<0.14"`, a separate environment) and is skipped
elsewhere. Measured there on 2026-12-05: every phase equal to the byte."""
import importlib
import os

import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.build import StepModule
from tracer.passes.analysis import analyze_graphs
from optional import needs
from truth import measure_step

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "torchtune_llama3_2.py")


def _torchtune_imports() -> bool:
    try:
        importlib.import_module("torchtune.models.llama3_2")
    except Exception:          # torchtune with a torchao it cannot import (module above)
        return False
    return True


@needs("torchtune", reason="torchtune with torchao < 0.14 (module docstring)")
def test_torchtunes_llama3_2_builder_is_exact_against_a_real_step():
    import pytest
    if not _torchtune_imports():
        pytest.skip("torchtune does not import beside this torchao (module docstring)")
    source = load_model_source(FIXTURE)
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=32, target="cpu"), (PolicySpec(name="eager"),))
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(StepModule(model, loss_fn=source.loss_fn), source.example_batch(2, 32),
                            torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.saved.total_bytes == measured.saved_bytes
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
