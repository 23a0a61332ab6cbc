"""The capture ladder's torch.compile rung: when every export rung fails, torch.compile's joint graph (under
fake tensors) gives the same step as export, and the prediction still matches a real eager step."""
import dataclasses
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.dispatch import CAPTURE_PATH as DISPATCH_PATH
from tracer.capture.dynamo_joint import CAPTURE_PATH
from tracer.errors import CaptureError
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _export_fails(monkeypatch, *, but_strict: bool = False):
    """Every export rung fails (simulated), or every one but strict export: the reference the compile rung
    is compared with (an export rung that the eager tests validate and that is on the ladder in any case)."""
    import tracer.capture as capture
    real_export_joint = capture.export_joint

    def fails(source, batch, seq, precision, *, strict=False, **kwargs):
        if but_strict and strict:
            return real_export_joint(source, batch, seq, precision, strict=True, **kwargs)
        raise CaptureError("export failed (simulated)", next_rung_may_work=True)

    monkeypatch.setattr(capture, "export_joint", fails)


def _export_rung(source, options, specs, monkeypatch):
    with monkeypatch.context() as patch:
        _export_fails(patch, but_strict=True)
        return analyze_graphs(capture_steps(source, options, specs)).policies


def _measure(source, options):
    torch.manual_seed(0)
    real = source.build_model()
    return measure_step(real, source.example_batch(options.batch, options.seq),
                        torch.optim.AdamW(real.parameters(), lr=1e-3), precision=options.precision)


def _assert_matches(predicted, measured):
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase


def test_llama_is_captured_by_the_compile_rung_when_export_fails(monkeypatch):
    source, options = load_model_source("llama-debug"), CaptureOptions(batch=2, seq=32)
    exported = _export_rung(source, options, (PolicySpec(name="eager"),), monkeypatch)["eager"]
    _export_fails(monkeypatch)
    graphs = capture_steps(source, options, (PolicySpec(name="eager"), PolicySpec(name="full"),
                                             PolicySpec(name="compiled")))
    assert {g.config.capture_path for g in graphs.values()} == {CAPTURE_PATH}
    predicted, measured = analyze_graphs({"eager": graphs["eager"]}).policies["eager"], _measure(source, options)
    _assert_matches(predicted, measured)
    assert predicted.saved.total_bytes == exported.saved.total_bytes == measured.saved_bytes
    assert any(op.recomputed for op in graphs["full"].ops)
    peaks = analyze_graphs(graphs).policies
    assert peaks["compiled"].peak_bytes <= peaks["eager"].peak_bytes
    assert peaks["full"].peak_bytes < peaks["eager"].peak_bytes


@pytest.mark.parametrize("model,options", [
    (os.path.join(FIXTURES, "attribute_cache.py"), CaptureOptions(batch=2, seq=16)),
    (os.path.join(FIXTURES, "user_checkpoint.py"), CaptureOptions(batch=2, seq=16)),
    ("llama-debug", CaptureOptions(batch=2, seq=16, precision="bf16", target="cuda:a100")),
], ids=["attribute_cache", "user_checkpoint", "llama-cuda-bf16"])
def test_the_compile_rung_gives_the_export_rung_step(monkeypatch, model, options):
    """Dynamo returns `self.cache = h` as an extra graph output and tags checkpoint regions itself; neither
    may change the step. A cuda target records CUDA's SDPA op and autocast lists as export does. The step
    must equal the export rung's in every phase, under every policy."""
    source = load_model_source(model)
    specs = (PolicySpec(name="eager"), PolicySpec(name="compiled"))
    exported = _export_rung(source, options, specs, monkeypatch)
    _export_fails(monkeypatch)
    compiled = analyze_graphs(capture_steps(source, options, specs)).policies
    for label in ("eager", "compiled"):
        assert compiled[label].start_bytes == exported[label].start_bytes
        assert compiled[label].saved.total_bytes == exported[label].saved.total_bytes
        for phase in ("forward", "backward", "optimizer"):
            assert compiled[label].phases[phase].peak_bytes == exported[label].phases[phase].peak_bytes, phase


def test_the_compile_rung_attributes_backward_ops_to_forward_lines(monkeypatch):
    _export_fails(monkeypatch)
    graph = capture_steps(load_model_source("llama-debug"), CaptureOptions(batch=2, seq=16),
                          (PolicySpec(name="eager"),))["eager"]
    backward = [op for op in graph.ops if op.phase.name == "BACKWARD" and op.target.startswith("aten.mm")]
    assert backward and all(op.source is not None and op.source.file.endswith("llama.py") for op in backward)
    assert {op.module for op in backward} >= {"blocks.0.attn.wq", "blocks.1.mlp.w2"}


def test_the_compile_rung_under_bf16_autocast(monkeypatch):
    source, options = load_model_source("llama-debug"), CaptureOptions(batch=2, seq=16, precision="bf16")
    _export_fails(monkeypatch)
    graph = capture_steps(source, options, (PolicySpec(name="eager"),))["eager"]
    assert graph.config.capture_path == CAPTURE_PATH
    predicted, measured = analyze_graphs({"eager": graph}).policies["eager"], _measure(source, options)
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.saved.total_bytes == measured.saved_bytes
    for phase in ("forward", "backward", "optimizer"):   # eager's 0-dim forward scalars (test_eager_step.py)
        assert abs(predicted.phases[phase].peak_bytes - measured.phase_peaks[phase]) <= 8, phase


def test_a_data_dependent_branch_ends_at_dispatch_without_trying_the_compile_rung():
    """The fake forward every graph rung starts from already fails on the branch (it reads a value), so the
    ladder goes straight to dispatch: the first rung's note names the line."""
    graph = capture_steps(load_model_source(os.path.join(FIXTURES, "data_dependent_branch.py")),
                          CaptureOptions(batch=2, seq=16), (PolicySpec(name="eager"),))["eager"]
    assert graph.config.capture_path == DISPATCH_PATH
    notes = " ".join(graph.config.notes)
    assert "data_dependent_branch.py:18" in notes and "torch.compile" not in notes


def test_a_custom_functions_backward_that_runs_its_own_backward_is_run_op_by_op():
    """tests/fixtures/reversible_nested_backward.py: a reversible block's backward recomputes it and writes its
    parameters' .grad by a nested backward(), which the direct trace cannot follow; export would trace the
    Function's forward as plain ops (saving what its backward never needs), so the ladder goes to dispatch,
    whose eager autograd runs the Function's own backward: exact."""
    source, options = load_model_source(os.path.join(FIXTURES, "reversible_nested_backward.py")), \
        CaptureOptions(batch=2, seq=16)
    graph = capture_steps(source, options, (PolicySpec(name="eager"),))["eager"]
    assert graph.config.capture_path == DISPATCH_PATH
    assert "custom autograd Function Reversible" in " ".join(graph.config.notes)
    predicted, measured = analyze_graphs({"eager": graph}).policies["eager"], _measure(source, options)
    _assert_matches(predicted, measured)
    assert predicted.saved.total_bytes == measured.saved_bytes
    with pytest.raises(CaptureError, match="custom autograd Function Reversible"):
        capture_steps(source, dataclasses.replace(options, capture="export"), (PolicySpec(name="eager"),))


def test_when_every_graph_rung_fails_the_notes_name_each_one():
    graph = capture_steps(load_model_source(os.path.join(FIXTURES, "dataclass_batch_graph_break.py")),
                          CaptureOptions(batch=2, seq=16), (PolicySpec(name="eager"),))["eager"]
    assert graph.config.capture_path == DISPATCH_PATH
    notes = " ".join(graph.config.notes)
    assert "torch.export failed" in notes and "torch.export (strict) failed" in notes
    assert "torch.compile (fullgraph) failed" in notes and "dataclass_batch_graph_break.py:30" in notes


def test_a_model_export_rejects_is_captured_by_the_compile_rung():
    """tests/fixtures/dataclass_batch.py: forward takes an unregistered dataclass, which export cannot flatten."""
    source, options = load_model_source(os.path.join(FIXTURES, "dataclass_batch.py")), CaptureOptions(batch=2, seq=16)
    graphs = capture_steps(source, options, (PolicySpec(name="eager"), PolicySpec(name="compiled")))
    assert graphs["eager"].config.capture_path == CAPTURE_PATH
    predicted = analyze_graphs(graphs).policies
    _assert_matches(predicted["eager"], _measure(source, options))
    assert predicted["compiled"].peak_bytes <= predicted["eager"].peak_bytes
    notes = " ".join(graphs["eager"].config.notes)      # the report says why the earlier rungs were skipped
    assert "torch.export failed" in notes and "the next capture path was used" in notes


def test_capture_compile_asks_for_the_compile_rung_alone():
    graph = capture_steps(load_model_source("llama-debug"), CaptureOptions(batch=2, seq=16, capture="compile"),
                          (PolicySpec(name="eager"),))["eager"]
    assert graph.config.capture_path == CAPTURE_PATH and not graph.config.notes
