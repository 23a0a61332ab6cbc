"""Models built with idioms that read values or copy modules in __init__, and models that hand the loss
over inside an output object: eager prediction vs a real CPU step (tests/truth.py), every phase peak and
the saved bytes exact, and the report's notes name each assumption the build made.

The real step takes the loss the way a training loop does: `loss = model(*batch).loss` drops the other
outputs of an output object as the loss is taken; `logits, loss = model(x, y)` keeps a returned tuple's
other outputs bound until the next step's forward returns (the conventions tracer predicts:
capture/build.py, capture/caller_held.py)."""
import os

import pytest
import torch
from torch import nn

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


class TakeLoss(nn.Module):
    """The training loop's side: call the model (keywords for a dict batch), hand on the loss; a returned
    tuple's other tensors stay bound to the loop's variables (`self.held`) until the next forward returns,
    as `logits, loss = model(x, y)` keeps them."""

    def __init__(self, model, pick, keys=None):
        super().__init__()
        self.model, self.pick, self.keys = model, pick, keys
        self.held: list = []

    def forward(self, *values):
        out = self.model(**dict(zip(self.keys, values))) if self.keys else self.model(*values)
        loss = self.pick(out)
        if isinstance(out, (tuple, list)):
            self.held = [o for o in out if isinstance(o, torch.Tensor) and o is not loss]
        return loss


def predict_and_measure(fixture, *, pick=None, batch=2, seq=16, capture="auto"):
    source = load_model_source(os.path.join(FIXTURES, fixture))
    options = CaptureOptions(batch=batch, seq=seq, capture=capture)
    graph = capture_steps(source, options, (PolicySpec(name="eager"),))["eager"]
    predicted = analyze_graphs({"eager": graph}).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    real_batch = source.example_batch(batch, seq)
    keys = None
    if isinstance(real_batch, dict):
        keys, real_batch = tuple(real_batch), tuple(real_batch.values())
    model = real if pick is None else TakeLoss(real, pick, keys)
    opt = torch.optim.AdamW(real.parameters(), lr=1e-3)
    return graph, predicted, measure_step(model, real_batch, opt, loop_held=lambda: getattr(model, "held", []))


def assert_exact(predicted, measured):
    """Start and saved bytes, the peak's phase and each phase peak exact."""
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert p == m, f"{phase}: predicted {p:,} measured {m:,}"
    assert predicted.peak_bytes == measured.peak_bytes


def test_trunc_normal_init_cs336_style():
    """trunc_normal_ reads `mask.any()` of random values: answered False, and the note names the lines."""
    graph, predicted, measured = predict_and_measure("build_cs336_trunc_normal.py")
    assert_exact(predicted, measured)
    notes = " ".join(graph.config.notes)
    assert "build_cs336_trunc_normal.py:18" in notes and "build_cs336_trunc_normal.py:28" in notes
    assert "taken as False" in notes


def test_deepcopy_clones_and_item_drop_path_schedule():
    """The linspace schedule is computed exactly (no note); deepcopy'd blocks are blocks of their own."""
    graph, predicted, measured = predict_and_measure("build_clones.py")
    assert_exact(predicted, measured)
    assert not any("building the model" in n for n in graph.config.notes)
    assert graph.parameter_count == sum(p.numel() for p in load_model_source(
        os.path.join(FIXTURES, "build_clones.py")).build_model().parameters())


def test_transformer_encoder_deep_copies_its_layer():
    graph, predicted, measured = predict_and_measure("build_transformer_encoder.py")
    assert_exact(predicted, measured)


def test_peft_lora_model():
    pytest.importorskip("peft", reason="peft is not installed")
    graph, predicted, measured = predict_and_measure("build_peft_lora.py")
    assert_exact(predicted, measured)


@pytest.mark.parametrize("capture", ["auto", "dispatch"])
def test_nanogpt_tuple_of_logits_and_loss(capture):
    graph, predicted, measured = predict_and_measure("handover_nanogpt_tuple.py", pick=lambda out: out[1],
                                                     capture=capture)
    assert_exact(predicted, measured)
    assert any("element 1" in n for n in graph.config.notes)
    assert any(n.startswith("the loop keeps output 0 until the end of the step (as `logits, loss = model(x, y)`")
               for n in graph.config.notes)
    logits = 2 * 16 * 64 * 4
    assert predicted.at_peak.by_category["caller_held"] in (logits, 2 * logits)


def test_loss_index_names_the_loss_in_a_tuple():
    graph, predicted, measured = predict_and_measure("handover_loss_index.py", pick=lambda out: out[0])
    assert_exact(predicted, measured)
    assert any("element 0 of the returned tuple" in n for n in graph.config.notes)


def test_transformers_model_output_and_dict_batch():
    pytest.importorskip("transformers", reason="the hf extra is not installed")
    graph, predicted, measured = predict_and_measure("handover_hf_dict_batch.py", pick=lambda out: out.loss)
    assert_exact(predicted, measured)
    assert any("CausalLMOutputWithPast's 'loss'" in n for n in graph.config.notes)


def test_a_plain_tensor_attribute_is_a_buffer_for_the_trace():
    """`self.freqs_cis = precompute_freqs_cis(...)` (complex, not a buffer): export refused it as a fake
    constant, so the step fell to the dispatch rung (no recompute policies); as a buffer it traces."""
    graph, predicted, measured = predict_and_measure("reference_llama_plain_tensor_attribute.py")
    assert graph.config.capture_path == "aot-joint"
    assert_exact(predicted, measured)
