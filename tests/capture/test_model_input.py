"""The model-file convention: build_model + example_batch, optional loss_fn and make_optimizer."""
import os

import pytest

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph
from tracer.stepgraph import Phase

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def test_loss_fn_wraps_the_model_and_keeps_module_paths():
    source = load_model_source(os.path.join(FIXTURES, "with_loss_fn.py"))
    assert source.loss_fn is not None
    graph = capture_step(source, CaptureOptions(batch=2, seq=8, optimizer="sgd"))
    modules = {op.module for op in graph.ops if op.phase is Phase.FORWARD}
    assert {"body", "head"} <= modules                      # no wrapper prefix leaks into paths
    assert graph.parameter_count == 16 * 32 + 32 + 32 * 10 + 10
    result = analyze_graph(graph).policies["eager"]
    assert result.peak_bytes > result.start_bytes


@pytest.mark.slow
def test_make_optimizer_from_the_file_is_used():
    source = load_model_source(os.path.join(FIXTURES, "custom_optimizer.py"))
    graph = capture_step(source, CaptureOptions(batch=1, seq=8))
    assert graph.config.optimizer == "custom"
    assert any(op.source and op.source.function == "step" and op.source.file.endswith("custom_optimizer.py")
               for op in graph.ops if op.phase is Phase.OPTIMIZER)
