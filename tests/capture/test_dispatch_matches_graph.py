"""The op-by-op rung (`--capture dispatch`) gives the graph rung's numbers where both run a step. It places
what torch.utils.checkpoint runs inside backward where the graph rung places it: the lines and layers of a
reentrant region's inner backward (autograd nodes made inside backward, which no torch-function mode
sees), the layer of a recomputed op that forward ran inside a block's forward but outside any module's
own (a checkpointed method or plain function), and the modules after a recompute that torch stops early
by raising inside a module. Lines and layers have no real measurement to hold them to, so these compare
the rungs (the recomputed FLOPs are held to FlopCounterMode's on real steps on both rungs in
tests/accuracy/test_checkpoint_as_written.py); on the CLI's default target, a GPU. On a CPU target the
regions' RNG states are real CPU tensors, made outside the dispatcher, which the op-by-op run records
through stand-ins: held to real CPU steps. A batch's tensors held in a dataclass are the step's inputs:
held to a real CPU step."""
import dataclasses
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.dispatch import CAPTURE_PATH
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _eager(fixture: str, capture: str):
    source = load_model_source(os.path.join(FIXTURES, fixture))
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=32, capture=capture, target="cuda:h100"),
                           (PolicySpec(name="eager"),))
    return analyze_graphs(graphs).policies["eager"]


def _rows(rows, fixture: str | None = None) -> list:
    """The rows as tuples; with `fixture`, only the rows of its lines (called from a test, the op-by-op run
    gives the autograd engine's own ops the caller's line, where the CLI has none)."""
    return [dataclasses.astuple(row) for row in rows
            if fixture is None or (row.source is not None and row.source.file.endswith(os.sep + fixture))]


@pytest.mark.parametrize("fixture", ["checkpoint_reentrant.py", "checkpoint_reentrant_locals.py",
                                     "checkpoint_function.py", "checkpoint_inside_block.py"])
def test_checkpointed_regions_have_the_graph_rungs_lines_and_layers(fixture):
    graph, op_by_op = _eager(fixture, "auto"), _eager(fixture, "dispatch")
    assert op_by_op.graph.config.capture_path == CAPTURE_PATH
    assert op_by_op.peak_bytes == graph.peak_bytes
    assert op_by_op.flops_by_layer == graph.flops_by_layer
    assert (op_by_op.step_flops, op_by_op.recompute_flops) == (graph.step_flops, graph.recompute_flops)
    assert _rows(op_by_op.at_peak.lines, fixture) == _rows(graph.at_peak.lines, fixture) != []
    assert _rows(op_by_op.at_peak.layers) == _rows(graph.at_peak.layers)


def test_a_reentrant_regions_inner_backward_has_its_forward_lines():
    """No backward op of the reentrant fixture is left without a line: each has the line of the forward
    (or rerun) op whose node it runs, as backward ops outside checkpointed regions do."""
    ops = _eager("checkpoint_reentrant.py", "dispatch").graph.ops
    rerun = [i for i, op in enumerate(ops) if op.recomputed]
    inner = [op for op in ops[rerun[-1] + 1:] if op.phase.value == "backward" and not op.target.startswith("prim.")
             and op.module.startswith("blocks.")]
    assert rerun and inner
    assert all(op.source is not None and op.source.line in (16, 17, 18) for op in inner)


def test_a_dataclass_batchs_tensors_are_the_steps_inputs():
    """`forward(batch: Batch)` with a dataclass of tensors: they exist before the step, not constants made
    at their first use; every phase peak and the start bytes equal a real CPU step's."""
    source = load_model_source(os.path.join(FIXTURES, "dataclass_batch.py"))
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=32, capture="dispatch", target="cpu"),
                           (PolicySpec(name="eager"),))
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(2, 32), torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert predicted.start_bytes == measured.start_bytes
    assert {name: phase.peak_bytes for name, phase in predicted.phases.items()} == measured.phase_peaks
    assert predicted.at_peak.by_category["input"] > 0


def _cpu_step(fixture: str, capture: str):
    """(the prediction on a CPU target, a real CPU step's measurement) of a fixture, batch 2, seq 32."""
    source = load_model_source(os.path.join(FIXTURES, fixture))
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=32, capture=capture, target="cpu"),
                           (PolicySpec(name="eager"),))
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    return predicted, measure_step(model, source.example_batch(2, 32), torch.optim.AdamW(model.parameters(), lr=1e-3))


@pytest.mark.parametrize("fixture", ["user_checkpoint.py", "checkpoint_function.py", "checkpoint_reentrant.py",
                                     "checkpoint_unread_partial.py"])
def test_a_checkpointed_regions_rng_states_are_device_memory_on_a_cpu_target(fixture):
    """Each region's CPU RNG state (5,056 B here), saved at its entry and held until its backward, and
    fork_rng's copy while it recomputes: every phase peak equals a real CPU step's (the forward peak was
    one state per region low, 10,112 B on two regions)."""
    predicted, measured = _cpu_step(fixture, "dispatch")
    assert predicted.start_bytes == measured.start_bytes
    assert {name: phase.peak_bytes for name, phase in predicted.phases.items()} == measured.phase_peaks
    if fixture in ("user_checkpoint.py", "checkpoint_function.py"):
        assert predicted.saved.total_bytes == measured.saved_bytes


def test_a_module_under_two_names_is_named_as_on_the_graph_rung():
    """`self.head2 = self.head`, called as `head2`: both rungs bill its ops to the same layer (the last of
    its names, as the graph rung's module hooks fire), and every layer's bytes and FLOPs agree."""
    graph, _ = _cpu_step("batchnorm_shared_head.py", "auto")
    op_by_op, measured = _cpu_step("batchnorm_shared_head.py", "dispatch")
    assert "head2" in op_by_op.flops_by_layer
    assert op_by_op.flops_by_layer == graph.flops_by_layer
    assert _rows(op_by_op.at_peak.layers) == _rows(graph.at_peak.layers)
    assert {name: phase.peak_bytes for name, phase in op_by_op.phases.items()} == measured.phase_peaks


@pytest.mark.parametrize("fixture", ["batchnorm_shared_head.py", "input_mutated.py"])
def test_a_buffer_or_input_updated_in_place_is_saved_as_what_existed_before_the_step(fixture):
    """BatchNorm's running stats and a user input written in place in forward: backward reads the storage
    that existed before the step (the op-by-op run sees that storage written), so its saved bytes are input
    bytes, not activations, on both rungs; the totals equal a real CPU step's."""
    graph, measured = _cpu_step(fixture, "auto")
    op_by_op, _ = _cpu_step(fixture, "dispatch")
    assert graph.saved.total_bytes == op_by_op.saved.total_bytes == measured.saved_bytes
    assert graph.saved.activation_bytes == op_by_op.saved.activation_bytes
    assert graph.saved.input_bytes == op_by_op.saved.input_bytes > 0
