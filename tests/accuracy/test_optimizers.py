"""Every --optimizer that torch (or tracer's reference Lion, or transformers) implements runs for real on
fake tensors in the capture: predicted vs a real CPU step with that optimizer (tests/truth.py), exact to
the byte in every phase."""
import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.capture.optimizer import make_standard_optimizer
from tracer.passes.analysis import analyze_graph
from truth import measure_step


def predict_and_measure_optimizer(name: str, *, foreach: bool = True, model: str = "llama-debug"):
    source = load_model_source(model)
    options = CaptureOptions(batch=2, seq=64, optimizer=name, foreach=foreach, target="cpu")
    result = analyze_graph(capture_step(source, options)).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(2, 64),
                            make_standard_optimizer(name, real.parameters(), foreach=foreach))
    return result, measured


def predict_and_measure_fixture(name: str, *, as_optimizer=lambda made: made):
    """A model file of tests/fixtures with its own make_optimizer: predicted vs a real CPU step."""
    import os
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", name)
    source = load_model_source(path)
    result = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=64, target="cpu"))).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(2, 64), as_optimizer(source.make_optimizer(real.parameters())))
    return result, measured


def assert_exact(result, measured):
    assert result.start_bytes == measured.start_bytes
    assert result.peak_bytes == measured.peak_bytes
    assert result.peak_phase == measured.peak_phase
    assert {name: p.peak_bytes for name, p in result.phases.items()} == measured.phase_peaks
    assert result.saved.total_bytes == measured.saved_bytes


@pytest.mark.parametrize("name,foreach", [("adam", True), ("sgd-plain", True), ("sgd-plain", False),
                                          ("sgd-momentum", True), ("adafactor", True), ("adafactor", False),
                                          ("adafactor-hf", True), ("lion", True)])
def test_optimizer_step_is_exact(name, foreach):
    result, measured = predict_and_measure_optimizer(name, foreach=foreach)
    assert_exact(result, measured)


def test_plain_sgd_keeps_no_state_and_momentum_sgd_one_buffer_per_parameter():
    plain, _ = predict_and_measure_optimizer("sgd-plain")
    momentum, _ = predict_and_measure_optimizer("sgd-momentum")
    param_bytes = plain.at_peak.by_category["parameter"]
    assert plain.start_bytes + param_bytes == momentum.start_bytes


def test_adafactor_factors_the_second_moment_of_matrices():
    """torch's Adafactor keeps, for a (r, c) matrix, a row and a column statistic: r + c values, not r * c."""
    result, _ = predict_and_measure_optimizer("adafactor")
    state = [s for s in result.graph.storages if s.role.value == "optimizer_state" and s.preexisting]
    params = {s.name: s for s in result.graph.storages if s.role.value == "parameter"}
    matrix = next(name for name, p in params.items() if len(p.shape) == 2)
    rows, cols = params[matrix].shape
    factored = {s.name.rsplit(".", 1)[1]: s.nbytes for s in state if s.name.startswith(matrix + ".")}
    assert factored["row_var"] == rows * 4 and factored["col_var"] == cols * 4
    assert "variance" not in factored


def test_state_kept_in_containers_on_groups_and_on_the_optimizer_is_counted_and_exact():
    """A preconditioner per matrix dimension in a list, a moment in a dict, a tensor learning rate in the
    param group and a table on the optimizer object: all exist before the step and are optimizer state."""
    result, measured = predict_and_measure_fixture("container_state_optimizer.py")
    assert_exact(result, measured)
    state = {s.name: s for s in result.graph.storages if s.role.value == "optimizer_state" and s.preexisting}
    matrix = next(s for s in result.graph.storages if s.role.value == "parameter" and len(s.shape) == 2)
    rows, cols = matrix.shape
    assert state[f"{matrix.name}.GG[0]"].nbytes == rows * rows * 4
    assert state[f"{matrix.name}.GG[1]"].nbytes == cols * cols * 4
    assert f"{matrix.name}.moments.m" in state
    assert state["param_groups[0].lr"].nbytes == 4 and state["code_table"].nbytes == 256 * 4


def test_a_list_of_optimizers_is_stepped_in_order_and_exact():
    """make_optimizer returning [Muon, AdamW]: each steps its own parameters, one after the other."""
    from tracer.capture.optimizer import OptimizerChain
    result, measured = predict_and_measure_fixture("muon_and_adamw.py", as_optimizer=OptimizerChain)
    assert_exact(result, measured)
    state = {s.name for s in result.graph.storages if s.role.value == "optimizer_state" and s.preexisting}
    assert "blocks.0.attn.wq.weight.momentum_buffer" in state and "embed.weight.exp_avg_sq" in state


def test_a_model_files_optimizer_that_reads_values_is_exact_and_each_read_is_noted():
    """torch's Adafactor from make_optimizer reads a norm with .item(): taken as 0 on fake tensors, which
    changes no size here, and the report names the line and what the assumption could change."""
    result, measured = predict_and_measure_fixture("user_adafactor.py")
    assert_exact(result, measured)
    notes = [n for n in result.graph.config.notes if "reads a tensor's value" in n]
    assert notes and all(n.startswith("Adafactor.step() reads a tensor's value at ") and "may differ" in n
                         for n in notes)
    assert "adafactor.py:" in notes[0]
