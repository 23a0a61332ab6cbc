"""What export drops but a fake run of the forward shows, vs a real eager CPU step (tests/truth.py)."""
import os

import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _compare(fixture, rel, step="steady"):
    source = load_model_source(os.path.join(FIXTURES, fixture))
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=32, step=step), (PolicySpec(name="eager"),))
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(2, 32), torch.optim.AdamW(model.parameters(), lr=1e-3),
                            steady=step == "steady")
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert abs(p - m) <= rel * m, f"{phase}: predicted {p:,} measured {m:,}"
    return predicted


def test_tensor_kept_on_a_module_attribute_outlives_the_step():
    predicted = _compare("attribute_cache.py", rel=0.0)
    assert any("blocks.1.cache keeps a 65,536 B tensor" in note for note in predicted.graph.config.notes)
    assert predicted.end_bytes == predicted.start_bytes + 4  # new caches replace the old; + the 4-byte loss


def test_checkpointing_written_in_the_model_is_simulated_under_eager():
    """Non-strict export drops torch.utils.checkpoint; the fake run sees which modules it wraps.
    Every phase peak is exact; the backward peak was 4,800 B below before the checkpoint's RNG state was
    held to the end of its region's backward."""
    predicted = _compare("user_checkpoint.py", rel=0.0)
    assert any(op.recomputed for op in predicted.graph.ops)
    notes = [n for n in predicted.graph.config.notes if n.startswith("checkpointed region")]
    assert notes == [f"checkpointed region {i}: module blocks.{i} (called at user_checkpoint.py:18), non-reentrant, "
                     "full" for i in range(2)]


def test_tensors_kept_in_a_list_or_dict_on_a_module_outlive_the_step():
    """A list built by a method called directly on a submodule (its first element a reshaped view) and a
    dict on the root: each element is held from the op that made it until the next step replaces it."""
    predicted = _compare("attribute_pyramid.py", rel=0.0)
    kept = [note.split(" keeps")[0] for note in predicted.graph.config.notes if "past the step" in note]
    assert sorted(kept) == ["pyramid.levels[0]", "pyramid.levels[1]", "pyramid.levels[2]",
                            "the model.last['hidden']"]
    assert predicted.end_bytes == predicted.start_bytes + 4  # new values replace the old; + the 4-byte loss


def test_a_buffer_the_first_forward_fills_is_held_from_before_a_steady_step():
    """The forward replaces a placeholder buffer on its first call (a 32 x 32 table here, 4,096 B). A steady
    step starts with it and reads it: the direct trace sees the replacement, runs one plain forward first,
    and traces again (it was 4,096 B low in every phase)."""
    predicted = _compare("placeholder_buffer.py", rel=0.0)
    (table,) = [s for s in predicted.graph.storages if s.name == "mixer.mixing"]
    assert table.nbytes == 4 * 32 * 32 and table.preexisting
    assert predicted.graph.config.capture_path == "aot-joint"
