"""The compiled policy against a real torch.compile (Inductor) training step on CPU.

Saved activations: a wrapped Inductor partition function records the compiled forward graph's outputs
beyond the user outputs (the saved activations), deduplicated by storage, without the graph's own inputs
(parameters, token ids), which our `activation_bytes` also omits.
Peaks: benchmarks/compiled_vs_profiler.py measures a real compiled step with the profiler (allocator
events, so Inductor's own buffers are seen) and predicts it with the `compiled` policy.
"""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs

MLP_FILE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "tiny_mlp_lm.py")
# a LayerNorm whose output is permuted (PVT, SegFormer): eager's layer-norm backward returns a contiguous
# grad_input where Inductor's decomposition returns it transposed, so the reshape after it copies
TRANSPOSED_LAYER_NORM = os.path.join(os.path.dirname(__file__), "..", "fixtures", "transposed_layer_norm.py")


def _real_compiled_saved_bytes(model, batch, monkeypatch) -> int:
    import torch._inductor.compile_fx as compile_fx
    seen = {}
    partition = compile_fx.partition_fn

    def recording_partition(joint, inputs, **kwargs):
        seen["forward"], _ = out = partition(joint, inputs, **kwargs)
        seen["num_fwd_outputs"] = kwargs["num_fwd_outputs"]
        return out

    monkeypatch.setattr(compile_fx, "partition_fn", recording_partition)
    torch._dynamo.reset()
    torch.compile(model, dynamic=False)(*batch).backward()
    gm = seen["forward"]
    inputs = {p.meta["val"].untyped_storage()._cdata for p in gm.graph.find_nodes(op="placeholder")
              if isinstance(p.meta.get("val"), torch.Tensor)}
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0][seen["num_fwd_outputs"]:]
    saved = {}
    for node in outputs:
        val = getattr(node, "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and val.untyped_storage()._cdata not in inputs:
            saved[val.untyped_storage()._cdata] = val.untyped_storage().nbytes()
    return sum(saved.values())


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["compiled", "compiled+full", "compiled+selective"])
def test_compiled_saved_bytes_equal_what_inductor_saves(policy, monkeypatch, compiled_vs_profiler,
                                                        no_compile_caches):
    """With checkpointed blocks (compiled+full / compiled+selective: the blocks in torch.utils.checkpoint,
    as the benchmark wraps them) too: the partition of the tagged joint saves what torch.compile's does."""
    source = load_model_source("llama-debug")
    torch.manual_seed(0)
    model = source.build_model()
    if policy != "compiled":
        assert compiled_vs_profiler.checkpoint_blocks(model, policy.removeprefix("compiled+"))
    measured = _real_compiled_saved_bytes(model, source.example_batch(2, 64), monkeypatch)
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=64, target="cpu"), (PolicySpec(name=policy),))
    predicted = analyze_graphs(graphs).policies[policy]
    assert measured > 0
    assert predicted.saved.activation_bytes == measured


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-debug", MLP_FILE, TRANSPOSED_LAYER_NORM])
def test_compiled_phase_peaks_equal_a_real_compiled_step(model, compiled_vs_profiler, no_compile_caches):
    """Forward and backward exactly; the optimizer (eager code in both) up to the profiler's 0-dim scalar
    tensors that foreach ops wrap Python scalars in (4-8 B each, GROUND_TRUTH.md 2.1), which the prediction
    does not model."""
    predicted = compiled_vs_profiler.predicted_compiled_peaks(model, 2, 128, "whole")
    measured = compiled_vs_profiler.measured_compiled_peaks(model, 2, 128, "whole")
    assert predicted["forward"] == measured["forward"]
    assert predicted["backward"] == measured["backward"]
    assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 64


@pytest.mark.slow
def test_compiled_gradient_accumulation_shows_the_second_backward_holding_every_new_gradient(
        compiled_vs_profiler, no_compile_caches):
    """Whole-model compile with 2 micro-batches: the compiled backward returns all of micro-batch 2's
    gradients together before they are added to the stored ones, so its backward peaks a whole set of
    gradients above micro-batch 1's. Every phase exact against the real compiled step (the optimizer up to
    the profiler's 0-dim scalars)."""
    predicted = compiled_vs_profiler.predicted_compiled_peaks("llama-debug", 2, 128, "whole", accumulate=2)
    measured = compiled_vs_profiler.measured_compiled_peaks("llama-debug", 2, 128, "whole", accumulate=2)
    for phase in compiled_vs_profiler.phase_names(2)[:-1]:
        assert predicted[phase] == measured[phase], phase
    assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 64
    gradient_bytes = 4 * sum(p.numel() for p in load_model_source("llama-debug").build_model().parameters())
    assert predicted["backward (micro-batch 2)"] - predicted["backward (micro-batch 1)"] >= gradient_bytes


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llama-debug", "gpt2-debug"])
@pytest.mark.parametrize("style", ["whole+selective", "whole+full"])
def test_checkpointed_blocks_inside_torch_compile(model, style, compiled_vs_profiler, no_compile_caches):
    """`compiled+selective` / `compiled+full` against torch.compile of a model whose blocks run in
    torch.utils.checkpoint (selective: tracer's default save policy as torch's policy_fn). Their peaks sit
    at a CPU flash-attention kernel (full checkpointing's backward, gpt2's forward), so its scratch counts.
    Forward exact (gpt2-debug's selective forward, which peaks at the loss: 8 B low, an 8-byte tensor the
    plan does not have, as under the plain compiled policy); backward exact up to the row sums the
    attention backward allocates on each worker thread of the intra-op pool, which the profiler does not
    record (32 fp32 values each at seq 128)."""
    predicted = compiled_vs_profiler.predicted_compiled_peaks(model, 2, 128, style)
    measured = compiled_vs_profiler.measured_compiled_peaks(model, 2, 128, style)
    worker_row_sums_bytes = (torch.get_num_threads() - 1) * 32 * 4
    assert 0 <= measured["forward"] - predicted["forward"] <= 8
    assert 0 <= predicted["backward"] - measured["backward"] <= worker_row_sums_bytes
    assert 0 <= measured["optimizer"] - predicted["optimizer"] <= 64
