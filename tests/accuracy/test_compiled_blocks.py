"""The compiled-blocks policy against a real CPU training step with `block.compile()` on every repeated block
(the rest of the model eager), as benchmarks/compiled_vs_profiler.py's `blocks` style runs it.

Peaks: the profiler's allocator events of the real step (Inductor's own buffers included), per phase.
Saved activations: what the real step saves for backward, seen by `saved_tensors_hooks` (the eager ops'
saves and each compiled block's `save_for_backward`), deduplicated by storage, without parameters and the
batch's own tensors, as our `activation_bytes` counts them.
"""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps
from tracer.errors import UsageError
from tracer.passes.analysis import analyze_graphs

SEQ = 64
NO_BLOCKS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "elementwise_only.py")


def _real_saved_bytes(compiled_vs_profiler, name: str) -> int:
    source = compiled_vs_profiler.model_source(name)
    torch.manual_seed(0)
    model = source.build_model()
    batch = source.example_batch(2, SEQ)
    for path in compiled_vs_profiler.block_paths(model):
        model.get_submodule(path).compile(dynamic=False)
    model(*batch).backward()                  # compiles every block outside the hooks
    existing = {t.untyped_storage()._cdata for t in [*model.parameters(), *model.buffers(), *batch]}
    saved: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in existing:
            saved[storage._cdata] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(*batch)
    total = sum(saved.values())
    loss.backward()
    return total


def _predicted(compiled_vs_profiler, name: str, policy: str):
    graphs = capture_steps(compiled_vs_profiler.model_source(name), CaptureOptions(batch=2, seq=SEQ, target="cpu"),
                           (PolicySpec(name=policy),))
    return analyze_graphs(graphs).policies[policy]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-debug", "hf:bert", "mlp"])
def test_block_compile_phase_peaks_equal_a_real_step(model, compiled_vs_profiler, no_compile_caches):
    """Forward and backward exactly; the optimizer (eager in both) up to the profiler's 0-dim scalar tensors
    that foreach ops wrap Python scalars in (4-8 B each), which the prediction does not model."""
    model = compiled_vs_profiler.MLP_FILE if model == "mlp" else model     # blocks mlp.0, mlp.1 (GELU), mlp.2
    predicted = compiled_vs_profiler.predicted_compiled_peaks(model, 2, SEQ, "blocks")
    measured = compiled_vs_profiler.measured_compiled_peaks(model, 2, SEQ, "blocks")
    assert predicted["forward"] == measured["forward"]
    assert predicted["backward"] == measured["backward"]
    assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 64


@pytest.mark.slow
def test_block_compile_saves_what_the_real_step_saves(compiled_vs_profiler, no_compile_caches):
    """Each block saves what its own min-cut partition saves; the eager code around the blocks what eager
    autograd saves. Both the whole-model compiled and the eager policies save something else (so the
    comparison can fail)."""
    measured = _real_saved_bytes(compiled_vs_profiler, "llama-debug")
    predicted = _predicted(compiled_vs_profiler, "llama-debug", "compiled-blocks")
    assert predicted.saved.activation_bytes == measured
    for other in ("compiled", "eager"):
        assert _predicted(compiled_vs_profiler, "llama-debug", other).saved.activation_bytes != measured, other


def test_a_model_without_repeated_blocks_is_refused(compiled_vs_profiler):
    with pytest.raises(UsageError, match="compiles each repeated block"):
        _predicted(compiled_vs_profiler, NO_BLOCKS, "compiled-blocks")


@pytest.mark.slow
def test_a_backward_peak_inside_a_compiled_block_is_exact(compiled_vs_profiler, no_compile_caches, monkeypatch):
    """A tiny vocabulary and a wide MLP put the backward peak inside the last block's compiled backward, the
    first to run (its incoming gradient held, its saved tensors freed as the backward's wrapper deletes
    them, every other block's saved tensors still live)."""
    monkeypatch.setitem(compiled_vs_profiler.HF_CONFIGS, "hf:llama", (
        "num_hidden_layers=3", "hidden_size=64", "intermediate_size=512", "num_attention_heads=4",
        "num_key_value_heads=2", "vocab_size=16"))
    analysis = _predicted(compiled_vs_profiler, "hf:llama", "compiled-blocks")
    backward = analysis.phases["backward"]
    assert analysis.graph.ops[backward.op_index].module.startswith("model.model.layers.2.mlp.")
    measured = compiled_vs_profiler.measured_compiled_peaks("hf:llama", 2, SEQ, "blocks")
    assert backward.peak_bytes == measured["backward"]
    assert analysis.phases["forward"].peak_bytes == measured["forward"]


@pytest.mark.slow
@pytest.mark.parametrize("model, style", [("llama-debug", "blocks+full"), ("hf:bert", "blocks+full"),
                                          ("mlp", "blocks+full"), ("llama-debug", "blocks+selective"),
                                          ("hf:bert", "blocks+selective")])
def test_checkpointed_blocks_compiled_one_by_one_equal_a_real_step(model, style, compiled_vs_profiler,
                                                                  no_compile_caches):
    """torchtitan's recipe: each block wrapped by checkpoint_wrapper (full, or selective with tracer's default
    save policy as torch's policy_fn), then compiled on its own; predicted by compiled-blocks+full and
    compiled-blocks+selective. Each block's min-cut partition recomputes inside its compiled backward."""
    model = compiled_vs_profiler.MLP_FILE if model == "mlp" else model
    predicted = compiled_vs_profiler.predicted_compiled_peaks(model, 2, SEQ, style)
    measured = compiled_vs_profiler.measured_compiled_peaks(model, 2, SEQ, style)
    assert predicted["forward"] == measured["forward"]
    assert predicted["backward"] == measured["backward"]
    assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 64


@pytest.mark.slow
def test_a_checkpoint_the_block_makes_inside_its_forward_is_compiled_with_the_block(compiled_vs_profiler,
                                                                                   no_compile_caches):
    """tests/fixtures/checkpoint_inside_block.py: each block checkpoints its own MLP; block.compile() traces
    the checkpoint into the block's graph, whose partition recomputes the MLP in the compiled backward."""
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", "checkpoint_inside_block.py")
    predicted = compiled_vs_profiler.predicted_compiled_peaks(model, 2, SEQ, "blocks")
    measured = compiled_vs_profiler.measured_compiled_peaks(model, 2, SEQ, "blocks")
    assert predicted["forward"] == measured["forward"]
    assert predicted["backward"] == measured["backward"]


@pytest.mark.parametrize("fixture, refusal", [("user_checkpoint.py", "wraps a whole block from outside it"),
                                              ("checkpoint_reentrant.py", "is reentrant")])
def test_a_checkpoint_around_a_compiled_block_is_refused(fixture, refusal, compiled_vs_profiler):
    """checkpoint(block, x) in the parent's loop runs the block's compiled forward inside an eager checkpoint
    (rerun in backward), which is not modelled; neither is a reentrant checkpoint in a compiled block."""
    model = os.path.join(os.path.dirname(__file__), "..", "fixtures", fixture)
    with pytest.raises(UsageError, match=refusal):
        _predicted(compiled_vs_profiler, model, "compiled-blocks")
