"""Mixture of experts: the routing assumption (tracer/capture/routing.py) vs real CPU steps whose routers
are made to route exactly as assumed, so the prediction must be exact."""
import json
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.errors import ExitCode
from tracer.passes.analysis import analyze_graphs
from truth import balanced_routers, measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
MOE = os.path.join(FIXTURES, "moe_router.py")


def _predict(source, **options):
    graphs = capture_steps(source, CaptureOptions(**options), (PolicySpec(name="eager"),))
    return graphs["eager"], analyze_graphs(graphs).policies["eager"]


def _assert_exact(predicted, measured):
    """Saved bytes exact; phase peaks within 8 bytes: the 0-dim tensor eager wraps a Python scalar in
    (`... * 1e4`, a double) lives during the forward op that reads it and is not in the graph
    (the same remainder as tests/accuracy/test_eager_step.py)."""
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert 0 <= m - p <= 8, f"{phase}: predicted {p:,} measured {m:,}"


def _measure(source, batch, seq):
    torch.manual_seed(0)
    model = source.build_model()
    return measure_step(model, source.example_batch(batch, seq),
                        torch.optim.AdamW(model.parameters(), lr=1e-3))


def test_balanced_routing_of_a_hand_written_moe_is_exact_against_a_real_step():
    source = load_model_source(MOE)
    graph, predicted = _predict(source, batch=2, seq=16, target="cpu", moe_routing="balanced")
    _assert_exact(predicted, _measure(source, 2, 16))
    notes = "\n".join(graph.config.notes)
    assert "routing assumed balanced at the router aten.topk at moe_router.py:39" in notes
    assert "16 each" in notes
    assert "aten.nonzero at moe_router.py:43 has a data-dependent size" in notes


def test_worst_routing_predicts_more_than_balanced_and_says_so():
    source = load_model_source(MOE)
    """Every token-choice is saved once whatever the routing, so the forward's end is the same; an expert's
    backward temporaries grow with its tokens (32 instead of 16 here), and without an optimizer the
    backward holds the step's peak."""
    _, balanced = _predict(source, batch=2, seq=16, target="cpu", optimizer="none", moe_routing="balanced")
    graph, worst = _predict(source, batch=2, seq=16, target="cpu", optimizer="none", moe_routing="worst")
    assert worst.saved.total_bytes == balanced.saved.total_bytes
    assert worst.phases["backward"].peak_bytes > balanced.phases["backward"].peak_bytes
    assert worst.peak_bytes > balanced.peak_bytes
    notes = "\n".join(graph.config.notes)
    assert "routing assumed worst" in notes and "[32, 32, 0, 0]" in notes


def test_counts_from_a_file_equal_to_balanced_give_the_balanced_prediction(tmp_path):
    source = load_model_source(MOE)
    _, balanced = _predict(source, batch=2, seq=16, target="cpu", moe_routing="balanced")
    path = tmp_path / "routing.json"
    path.write_text(json.dumps({"counts": [16, 16, 16, 16]}))
    graph, from_file = _predict(source, batch=2, seq=16, target="cpu", moe_routing=str(path))
    assert from_file.peak_bytes == balanced.peak_bytes
    assert from_file.saved.total_bytes == balanced.saved.total_bytes
    assert f"routing assumed {path}" in "\n".join(graph.config.notes)


def test_counts_that_do_not_fit_the_router_name_its_line(tmp_path):
    from tracer.cli import main
    path = tmp_path / "routing.json"
    path.write_text("[10, 10, 10, 10]")
    code = main([MOE, "--batch", "2", "--seq", "16", "--target", "cpu", "--moe-routing", str(path), "--quiet"])
    assert code == ExitCode.ANALYSIS


def test_a_data_dependent_size_no_router_decides_is_one_line_naming_the_op(tmp_path, capsys):
    from tracer.cli import main
    model = tmp_path / "masked.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "class M(nn.Module):\n"
        "    def __init__(self):\n        super().__init__(); self.proj = nn.Linear(8, 8)\n"
        "    def forward(self, x):\n"
        "        y = self.proj(x)\n"
        "        return y[y > 0].sum()\n"
        "def build_model(): return M()\n"
        "def example_batch(b, s): return (torch.randn(b, s, 8),)\n")
    code = main([str(model), "--batch", "2", "--seq", "4", "--target", "cpu", "--quiet"])
    err = capsys.readouterr().err
    assert code == ExitCode.ANALYSIS
    assert "masked.py:8" in err and "aten.nonzero" in err and "Traceback" not in err
    assert len([line for line in err.splitlines() if line.strip()]) <= 2


def test_an_unreadable_routing_value_is_a_usage_error():
    from tracer.cli import main
    assert main([MOE, "--seq", "16", "--moe-routing", "skewed"]) == ExitCode.USAGE


HF_MOE = ("num_hidden_layers=2", "hidden_size=32", "intermediate_size=64", "num_attention_heads=4",
          "num_key_value_heads=2", "vocab_size=128", "num_experts_per_tok=2")
HF_EXPERTS = {"hf:mixtral": ("num_local_experts=4",),
              "hf:qwen2_moe": ("num_experts=4", "moe_intermediate_size=64", "shared_expert_intermediate_size=64"),
              "hf:qwen3_moe": ("num_experts=4", "moe_intermediate_size=64", "head_dim=8")}


@pytest.mark.parametrize("name", sorted(HF_EXPERTS))
@pytest.mark.parametrize("experts", ["grouped_mm", "eager"])
def test_a_transformers_moe_with_balanced_routers_is_exact_against_a_real_step(name, experts):
    """transformers' default experts implementation on CPU is grouped_mm (fp32 runs on CPU; its fake kernel
    only takes bf16, as CUDA's does: tracer sizes it as the CPU kernel runs): sizes do not depend on
    routing. `experts_implementation=eager` loops over the experts hit (nonzero, torch.where, .item()):
    sizes come from the routing assumption, which the routers here are made to follow."""
    pytest.importorskip("transformers")
    import dataclasses
    overrides = HF_MOE + HF_EXPERTS[name] + (f"experts_implementation={experts}",)
    plain = load_model_source(name, hf_config=overrides)
    source = dataclasses.replace(plain, build_model=lambda: balanced_routers(plain.build_model()))
    graph, predicted = _predict(source, batch=2, seq=16, target="cpu", moe_routing="balanced")
    notes = "\n".join(graph.config.notes)
    if experts == "eager":
        assert "routing assumed balanced at the router aten.topk at modeling_" in notes
        assert "aten.nonzero at modeling_" in notes and "16 each" in notes
    else:
        assert "aten._grouped_mm" in notes and "routing assumed" not in notes
    _assert_exact(predicted, _measure(source, 2, 16))


def test_a_router_taking_a_score_correction_bias_routes_balanced_and_is_exact():
    """MiniMax-M2's router takes `(hidden, e_score_correction_bias)`: the balanced pre-hook replaces the hidden
    state only and passes the bias on (it once dropped it: the real forward raised a TypeError)."""
    pytest.importorskip("transformers")
    import dataclasses
    plain = load_model_source("hf:minimax_m2", hf_config=HF_MOE + ("num_local_experts=4", "head_dim=8"))
    source = dataclasses.replace(plain, build_model=lambda: balanced_routers(plain.build_model()))
    _, predicted = _predict(source, batch=2, seq=16, target="cpu", moe_routing="balanced")
    _assert_exact(predicted, _measure(source, 2, 16))


def test_a_router_with_no_router_module_is_made_to_route_balanced_at_its_argmax():
    """A Switch-style gate (argmax over a softmax, then per-expert `nonzero`) with random weights: the real
    step routes balanced only when its argmax chooses as the assumption does (truth.BalancedTopk, which
    benchmarks/wild.py uses for a mixture of experts without a transformers router module). Routed as the
    weights decide, the same step differs."""
    from truth import BalancedTopk
    source = load_model_source(os.path.join(FIXTURES, "switch_argmax_router.py"))
    graph, predicted = _predict(source, batch=2, seq=16, target="cpu", moe_routing="balanced")
    assert "routing assumed balanced at the router aten.argmax at switch_argmax_router.py:23" in "\n".join(graph.config.notes)
    with BalancedTopk():
        _assert_exact(predicted, _measure(source, 2, 16))
    as_weights_route = _measure(source, 2, 16)
    assert (as_weights_route.saved_bytes, as_weights_route.phase_peaks) != \
        (predicted.saved.total_bytes, {p: predicted.phases[p].peak_bytes for p in as_weights_route.phase_peaks})


def test_a_compiled_policy_for_a_cuda_target_plans_the_routed_sizes_on_the_device_and_names_the_graph_break():
    """Inductor's Triton plan runs the joint again on fake CUDA tensors: the data-dependent op's result,
    sized by the routing, is on the device of its input (it was a CPU tensor, which Inductor's index_add
    decomposition refused), and the note says where torch.compile breaks the graph by default."""
    source = load_model_source(MOE)
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=16, target="cuda"),
                           (PolicySpec(name="compiled"), PolicySpec(name="eager")))
    compiled, eager = analyze_graphs(graphs).policies["compiled"], analyze_graphs(graphs).policies["eager"]
    assert 0 < compiled.peak_bytes
    assert compiled.saved.total_bytes != eager.saved.total_bytes     # Inductor's partition, not eager's saves
    breaks = ("aten.nonzero at moe_router.py:43 has a data-dependent output size: torch.compile breaks the graph "
              "there unless torch._dynamo.config.capture_dynamic_output_shape_ops is set")
    assert any(note.startswith(breaks) for note in graphs["compiled"].config.notes)
    assert not any(note.startswith(breaks) for note in graphs["eager"].config.notes)


def test_a_compiled_policy_whose_inductor_passes_ask_a_routed_size_again_is_refused_in_one_line():
    """transformers' Mixtral with its per-expert loop: Inductor's post-grad passes recompute the fake value of
    a rewritten `nonzero` node from graph values no routing assumption follows; the capture stops with the op
    and what to do, not with a line-less routing error."""
    pytest.importorskip("transformers")
    from tracer.capture.routing import RoutingError
    source = load_model_source("hf:mixtral", hf_config=HF_MOE + HF_EXPERTS["hf:mixtral"]
                               + ("experts_implementation=eager",))
    with pytest.raises(RoutingError) as refused:
        capture_steps(source, CaptureOptions(batch=2, seq=16, target="cuda"), (PolicySpec(name="compiled"),))
    assert str(refused.value).startswith("aten.nonzero has a data-dependent output size that Inductor's passes ask "
                                         "for again while planning a compiled policy")
    assert "experts_implementation=grouped_mm" in refused.value.hint
