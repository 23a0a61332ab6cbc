"""Tensors the training loop holds, declared in the model file (tracer/capture/caller_held.py): the loop
keeps forward outputs until the end of the step (keep_outputs, keep_alive), holds bytes besides the model
(extra_resident_bytes) or calls loss.backward(retain_graph=True). Eager prediction vs a real CPU step whose
loop does exactly that (tests/truth.py): start bytes, every phase peak and the saved bytes exact, and the
bill shows the loop's bytes as caller_held."""
import dataclasses
import os

import pytest
import torch
from torch import nn

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.loop_declarations import extra_bytes
from tracer.errors import ModelInputError
from tracer.passes.analysis import analyze_graphs
from truth import assert_step_exact, measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
BATCH, SEQ = 2, 16


class KeepingLoop(nn.Module):
    """The training loop's side: call the model, keep what the model file says the loop keeps (until the
    next step replaces it), hand the loss on."""

    def __init__(self, model, keep, pick):
        super().__init__()
        self.model, self.keep, self.pick = model, keep, pick
        self.held: list = []

    def forward(self, *batch):
        out = self.model(*batch)
        self.held = [t for _, t in self.keep(out)] if self.keep is not None else []
        return self.pick(out)


def predict_and_measure(fixture, pick=lambda out: out, capture="auto"):
    source = load_model_source(os.path.join(FIXTURES, fixture))
    graph = capture_steps(source, CaptureOptions(batch=BATCH, seq=SEQ, target="cpu", capture=capture),
                          (PolicySpec(name="eager"),))["eager"]
    predicted = analyze_graphs({"eager": graph}).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    resident = () if source.extra_resident_bytes is None else (
        torch.empty(extra_bytes(source.extra_resident_bytes, fixture, BATCH, SEQ), dtype=torch.uint8),)
    loop = KeepingLoop(model, source.keep, pick)
    measured = measure_step(loop, source.example_batch(BATCH, SEQ),
                            torch.optim.AdamW(model.parameters(), lr=1e-3),
                            retain_graph=source.retain_graph, resident=resident, loop_held=lambda: loop.held)
    return graph, predicted, measured


CAPTURES = ("auto", "dispatch")          # the graph rung and the step run op by op


@pytest.mark.parametrize("capture", CAPTURES)
def test_the_loop_keeps_the_logits_through_backward_and_the_optimizer_step(capture):
    graph, predicted, measured = predict_and_measure("caller_keeps_logits.py", pick=lambda out: out["loss"],
                                                     capture=capture)
    assert_step_exact(predicted, measured)
    logits_bytes = BATCH * SEQ * 512 * 4
    assert predicted.at_peak.by_category["caller_held"] == logits_bytes
    # the same step with the logits dropped as the loss is taken: they are gone before the optimizer step
    source = load_model_source(os.path.join(FIXTURES, "caller_keeps_logits.py"))
    dropped = analyze_graphs(capture_steps(dataclasses.replace(source, keep=None),
                                           CaptureOptions(batch=BATCH, seq=SEQ, target="cpu", capture=capture),
                                           (PolicySpec(name="eager"),))).policies["eager"]
    assert predicted.phases["optimizer"].peak_bytes == dropped.phases["optimizer"].peak_bytes + logits_bytes
    assert any("keeps logits until the end of the step" in n for n in graph.config.notes)


@pytest.mark.parametrize("capture", CAPTURES)
def test_a_resident_reference_model_and_keep_alive(capture):
    graph, predicted, measured = predict_and_measure("caller_reference_model.py", pick=lambda out: out[1],
                                                     capture=capture)
    assert_step_exact(predicted, measured)
    resident = 1_000_000 * 2 + BATCH * SEQ * 256 * 2
    previous_logits = BATCH * SEQ * 256 * 4          # the last step's, bound until this forward returns
    assert predicted.start_bytes - resident - previous_logits == sum(
        s.nbytes for s in graph.storages if s.preexisting and not s.caller_held)
    assert predicted.at_peak.by_category["caller_held"] == resident + BATCH * SEQ * 256 * 4   # + the kept logits


@pytest.mark.parametrize("capture", CAPTURES)
def test_retain_graph_holds_every_saved_tensor_to_the_end_of_the_step(capture):
    graph, predicted, measured = predict_and_measure("caller_retain_graph.py", capture=capture)
    assert_step_exact(predicted, measured)
    assert predicted.phases["optimizer"].peak_bytes - predicted.start_bytes >= predicted.saved.activation_bytes


@pytest.mark.parametrize("text, match", [
    ("extra_resident_bytes = -1", "extra_resident_bytes is -1"),
    ("keep_outputs = 'logits'\ndef keep_alive(out):\n    return out", "both keep_outputs and keep_alive"),
    ("keep_outputs = (1.5,)", "keep_outputs must be a tuple"),
    ("retain_graph = 'yes'", "retain_graph is 'yes'"),
])
def test_malformed_declarations_are_refused_with_the_file(tmp_path, text, match):
    path = tmp_path / "model.py"
    path.write_text(open(os.path.join(FIXTURES, "caller_retain_graph.py")).read().replace("retain_graph = True", text))
    with pytest.raises(ModelInputError, match=match):
        load_model_source(str(path))
