"""--lora RANK [--lora-targets]: peft's LoRA adapters put on the user's model where it is built; eager
prediction vs a real CPU step of the same peft-wrapped model (tests/truth.py): start bytes, every phase peak
and the saved bytes exact. Frozen base weights get no gradient and no optimizer state, and the report
counts them as frozen."""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.lora import apply_lora, default_targets
from tracer.errors import UsageError
from tracer.passes.analysis import analyze_graphs
from tracer.passes.attribution import frozen_parameter_bytes
from optional import needs
from truth import assert_step_exact, measure_step

pytestmark = needs("peft", reason="pip install peft")

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
LLAMA = ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
         "num_key_value_heads=2", "vocab_size=512")


def predict_and_measure(source, rank, targets=(), *, batch=2, seq=32):
    options = CaptureOptions(batch=batch, seq=seq, target="cpu", lora_rank=rank, lora_targets=targets)
    graph = capture_steps(source, options, (PolicySpec(name="eager"),))["eager"]
    predicted = analyze_graphs({"eager": graph}).policies["eager"]
    torch.manual_seed(0)
    real = apply_lora(source.build_model(), rank, targets)
    opt = torch.optim.AdamW(real.parameters(), lr=1e-3)
    return graph, predicted, measure_step(real, source.example_batch(batch, seq), opt), real


def assert_frozen_counted(graph, predicted, real):
    frozen = [p for p in real.parameters() if not p.requires_grad]
    assert graph.frozen_parameter_count == sum(p.numel() for p in frozen) > 0
    assert frozen_parameter_bytes(graph) == sum(p.untyped_storage().nbytes() for p in frozen)
    trainable_bytes = sum(p.untyped_storage().nbytes() for p in real.parameters() if p.requires_grad)
    # AdamW keeps exp_avg and exp_avg_sq (and a 0-dim step each) for the adapters only
    states = [s for s in graph.storages if s.role.value == "optimizer_state" and s.shape != ()]
    assert sum(s.nbytes for s in states) == 2 * trainable_bytes


def test_lora_on_a_hand_written_model_with_its_default_targets():
    """Default targets of a model peft has no table for: every nn.Linear but the output head."""
    source = load_model_source(os.path.join(FIXTURES, "mlp_lm.py"))
    assert default_targets(source.build_model()) == ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down")
    graph, predicted, measured, real = predict_and_measure(source, 4)
    assert_step_exact(predicted, measured)
    assert_frozen_counted(graph, predicted, real)


def test_lora_on_named_targets_of_a_hand_written_model():
    source = load_model_source(os.path.join(FIXTURES, "mlp_lm.py"))
    graph, predicted, measured, real = predict_and_measure(source, 8, ("up",))
    assert_step_exact(predicted, measured)
    assert sum(1 for n, _ in real.named_modules() if n.endswith("up.lora_A")) == 2


def test_lora_on_a_transformers_llama_takes_peft_s_targets():
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    source = load_model_source("hf:llama", hf_config=LLAMA)
    assert {t.rsplit(".", 1)[1] for t in default_targets(source.build_model())} == {"q_proj", "v_proj"}
    graph, predicted, measured, real = predict_and_measure(source, 4)
    assert_step_exact(predicted, measured)
    assert_frozen_counted(graph, predicted, real)


def test_targets_that_match_no_module_are_refused_with_the_linears():
    source = load_model_source(os.path.join(FIXTURES, "mlp_lm.py"))
    with pytest.raises(UsageError, match="no module of MlpLM is named so.*blocks.0.up"):
        capture_steps(source, CaptureOptions(batch=2, seq=8, lora_rank=4, lora_targets=("q_proj",)),
                      (PolicySpec(name="eager"),))


def test_the_report_shows_the_frozen_parameters(tmp_path, capsys):
    from tracer.cli import main
    out = tmp_path / "r.json"
    assert main([os.path.join(FIXTURES, "mlp_lm.py"), "--seq", "8", "--target", "cpu", "--lora", "4",
                 "--lora-targets", "up,down", "--json", str(out), "--quiet"]) == 0
    text = capsys.readouterr().out
    assert "parameters: 26,688 (frozen 25,152, trainable 1,536)" in text
    assert "(frozen 98.25 KiB)" in text                               # the bill's parameter line
    import json
    data = json.loads(out.read_text())
    assert data["frozen_parameter_count"] == 25_152
    assert data["policies"]["eager"]["frozen_parameter_bytes"] == 25_152 * 4
    assert (data["config"]["lora_rank"], data["config"]["lora_targets"]) == (4, ["up", "down"])
