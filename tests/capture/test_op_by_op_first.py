"""The eager-only analysis runs the step op by op first (`CaptureOptions.op_by_op_first`, set by the pipeline
for an analysis that reads only the eager step) and keeps that run only where it stands for the joint
graph's eager step: its report then has every number the graph's has. Where the run used something the two
are not held equal on (a checkpointed region, a value read from a tensor, a data-dependent size, a tensor
subclass, an RNN module, saved-tensor hooks of the model's own, a leaf made in forward, a forward write
into a parameter), or failed, the graph is captured as before. benchmarks/capture_parity.py runs the
comparison below over every fixture."""
import json
import os

import pytest

import tracer
from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.capture.dispatch import GraphRungNeeded, VOUCHED_PATH, capture_step_dispatch
from tracer.checks.baseline import _refuse_config_mismatch
from tracer.errors import ModelRunError
from tracer.reports.json_report import policy_json

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
GRAPH_PATHS = ("aot-joint", "export-joint", "compile-joint")


def _fixture(name: str) -> str:
    return name if not name.endswith(".py") else os.path.join(FIXTURES, name)


def _numbers(report: dict) -> dict:
    """A policy's JSON less what names the path rather than the step (the op-by-op run names an op by its
    phase and index, the graph by its node)."""
    report = json.loads(json.dumps(report, default=str))
    report["peak_op"].pop("name")
    return report


@pytest.mark.parametrize("model", ["llama-debug", "gpt2-debug", "mlp_lm.py", "python_held_containers.py",
                                   "inplace_dropout_head.py", "default_adam.py", "handover_hf_dict_batch.py"])
def test_the_eager_only_analysis_runs_op_by_op_with_every_number_of_the_graph(model):
    default = tracer.analyze(_fixture(model), seq=32).policies["eager"]
    graph = tracer.analyze(_fixture(model), seq=32, capture="export").policies["eager"]
    assert default.graph.config.capture_path == VOUCHED_PATH
    assert graph.graph.config.capture_path in GRAPH_PATHS
    assert _numbers(policy_json(default, top=10)) == _numbers(policy_json(graph, top=10))


@pytest.mark.parametrize("fixture, feature", [
    ("checkpoint_reentrant.py", "a checkpointed region"),
    ("checkpoint_selective.py", "saved-tensor hooks"),            # a non-reentrant region's own
    ("asserts_on_values.py", "values read from tensors"),
    ("constant_value_reads.py", "values read from tensors"),
    ("saved_on_cpu.py", "saved-tensor hooks"),
    ("lstm_lm.py", "an RNN module"),
    ("forward_made_leaf.py", "a leaf tensor made in forward that requires grad"),
    ("parameter_clamped_in_forward.py", "a forward write into a parameter"),
])
def test_a_step_using_what_the_paths_differ_on_is_not_vouched_for(fixture, feature):
    options = CaptureOptions(batch=2, seq=16, target="cuda:h100")
    with pytest.raises(GraphRungNeeded) as raised:
        capture_step_dispatch(load_model_source(_fixture(fixture)), options, vouched=True)
    assert feature in raised.value.features


@pytest.mark.parametrize("fixture", ["checkpoint_selective.py", "moe_router.py", "constant_selected_rows.py",
                                     "lstm_lm.py"])
def test_the_graph_is_captured_where_the_op_by_op_run_is_not_vouched_for(fixture):
    """moe_router and constant_selected_rows: a routing assumption or a size read from constants."""
    graph = capture_step(load_model_source(_fixture(fixture)),
                         CaptureOptions(batch=2, seq=16, target="cuda:h100", op_by_op_first=True))
    assert graph.config.capture_path in GRAPH_PATHS


def test_a_lever_or_a_policy_other_than_eager_captures_the_graph():
    assert tracer.analyze(_fixture("mlp_lm.py"), seq=16, policies=("eager", "full")).policies[
        "eager"].graph.config.capture_path in GRAPH_PATHS
    assert tracer.analyze(_fixture("mlp_lm.py"), seq=16, accumulate=2).policies[
        "eager"].graph.config.capture_path in GRAPH_PATHS


def test_a_saved_tensor_written_in_place_stops_the_op_by_op_run_as_eager_stops(tmp_path):
    """Autograd does not check the version of a tensor its saved-tensor hooks hold; the op-by-op run checks
    it itself (eager raises at backward: tests/reliability/test_ci_gate.py runs it for real)."""
    path = tmp_path / "inplace_saved.py"
    path.write_text("import torch\nfrom torch import nn\n\n\nclass Net(nn.Module):\n"
                    "    def __init__(self):\n        super().__init__()\n        self.lin = nn.Linear(8, 8)\n\n"
                    "    def forward(self, x):\n        y = self.lin(x).sigmoid()\n        y.mul_(2)\n"
                    "        return y.sum()\n\n\ndef build_model():\n    return Net()\n\n\n"
                    "def example_batch(batch, seq):\n    return (torch.randn(batch, 8),)\n")
    with pytest.raises(ModelRunError, match="modified by an inplace operation"):
        capture_step(load_model_source(str(path)), CaptureOptions(batch=2, seq=8, capture="dispatch"))


def test_a_baseline_of_the_graph_checks_a_step_run_op_by_op_in_its_stead():
    assert _refuse_config_mismatch({"capture_path": "aot-joint"}, {"capture_path": VOUCHED_PATH}) == []
