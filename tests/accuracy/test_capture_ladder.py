"""The capture ladder: when export fails, the step runs op by op on fake tensors, and the prediction still
matches a real eager step."""
import dataclasses
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.dispatch import CAPTURE_PATH
from tracer.errors import CaptureError
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _compare(model, options, model_args=(), hf_config=(), saved=False):
    source = load_model_source(model, model_args=model_args, hf_config=hf_config)
    predicted = analyze_graphs(capture_steps(source, options, (PolicySpec(name="eager"),))).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(options.batch, options.seq),
                            torch.optim.AdamW(real.parameters(), lr=1e-3))
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    if saved:
        assert predicted.saved.total_bytes == measured.saved_bytes
    return predicted


def test_a_data_dependent_branch_falls_back_to_the_dispatch_path():
    predicted = _compare(os.path.join(FIXTURES, "data_dependent_branch.py"), CaptureOptions(batch=2, seq=16))
    notes = predicted.graph.config.notes
    assert predicted.graph.config.capture_path == CAPTURE_PATH
    assert any("export failed" in n for n in notes)
    assert any("data_dependent_branch.py:18" in n and "0 / False" in n for n in notes)


def test_the_dispatch_path_counts_a_tensor_saved_for_its_shape_as_saved():
    """`torch.gather` saves its input, whose backward formula reads only its size: no backward op reads it,
    yet autograd holds it until the node runs (tests/truth.py counts it through saved_tensors_hooks)."""
    model = os.path.join(FIXTURES, "gathered_scores.py")
    options = CaptureOptions(batch=2, seq=16, capture="dispatch")
    predicted = _compare(model, options)
    source = load_model_source(model)
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(2, 16), torch.optim.AdamW(real.parameters(), lr=1e-3))
    assert predicted.saved.total_bytes == measured.saved_bytes


def test_the_dispatch_path_holds_the_elementwise_storage_a_reduced_mse_loss_keeps():
    """`F.mse_loss`'s eager kernel reduces into a result that keeps the elementwise loss's storage (64 KiB
    here, tokens x classes), which the loop holds to the step's end; its fake kernel's result is 4 bytes
    (backward and the optimizer step were 65,532 B low; diffusers' Lumina2 denoiser, 8,188 B)."""
    predicted = _compare(os.path.join(FIXTURES, "loss_heads.py"), CaptureOptions(batch=2, seq=16, capture="dispatch"),
                         model_args=("loss=mse",))
    assert predicted.graph.config.capture_path == CAPTURE_PATH


def test_the_dispatch_path_reproduces_a_llama_step_exactly():
    predicted = _compare("llama-debug", CaptureOptions(batch=2, seq=64, capture="dispatch"))
    lines = {r.label.rsplit("/", 1)[-1]: r.bytes_at_peak for r in predicted.at_peak.lines}
    loss_line = _line_of("return F.cross_entropy(")
    assert lines[f"llama.py:{loss_line}"] > 0          # backward memory attributed to the forward line (cross-entropy)


HF_GPT2 = ("n_layer=2", "n_embd=64", "n_head=4", "vocab_size=512", "n_positions=64")
HF_BIOGPT = ("num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "intermediate_size=128",
             "vocab_size=256", "hidden_dropout_prob=0.0", "attention_probs_dropout_prob=0.0")    # SDPA's flash


def test_the_dispatch_path_skips_the_causal_mask_as_eager_does():
    """BioGPT makes an all-ones attention mask in forward; eager reads it, finds no padding and calls SDPA
    with is_causal instead of a mask. transformers counts a fake tensor as tracing and built the mask on the
    op-by-op rung (a bool mask converted to a float one that flash attention saved: 4 KiB per layer here)."""
    options = CaptureOptions(batch=2, seq=16, target="cpu", capture="dispatch")
    _compare("hf:biogpt", options, hf_config=HF_BIOGPT, saved=True)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("model,hf_config", [("llama-debug", ()), ("hf:gpt2", HF_GPT2)], ids=["llama", "hf-gpt2"])
def test_the_dispatch_path_takes_the_cuda_targets_kernels_as_the_graph_does(model, hf_config, precision):
    """For a CUDA target the step run op by op takes CUDA's choices (SDPA's CUDA op, bf16 autocast's CUDA
    lists with eager's weight-cast cache, dropout's fused kernel with a bool mask, foreach AdamW), so it
    equals the graph rung's CUDA step: every phase peak and the saved bytes. (GPT-2 has dropout and
    addmm-based Conv1D projections; on CPU kernels its dropout masks alone were 122,880 B more.)"""
    source = load_model_source(model, hf_config=hf_config)
    results = {}
    for capture in ("auto", "dispatch"):
        options = CaptureOptions(batch=2, seq=64, target="cuda", precision=precision, capture=capture)
        results[capture] = analyze_graphs(capture_steps(source, options, (PolicySpec(name="eager"),))).policies["eager"]
    graph, op_by_op = results["auto"], results["dispatch"]
    assert op_by_op.graph.config.capture_path == CAPTURE_PATH != graph.graph.config.capture_path
    assert op_by_op.graph.config.target == "cuda"
    assert op_by_op.start_bytes == graph.start_bytes
    assert {k: p.peak_bytes for k, p in op_by_op.phases.items()} == {k: p.peak_bytes for k, p in graph.phases.items()}
    assert op_by_op.saved.total_bytes == graph.saved.total_bytes


@pytest.mark.parametrize("model", ["llama-debug", "gpt2-debug"])
def test_the_dispatch_path_scales_an_fp16_loss_as_the_loop_does(model):
    """--precision fp16 op by op: `scaler.scale(loss)` runs after the model's forward and before backward, so
    backward starts with autograd's own ops, and the scale it multiplies by is the GradScaler's state, not a
    tensor the model's forward saved: every phase peak and the saved bytes equal a real step's to the byte
    (they were 8 B over: the loss and the scale counted as saved)."""
    source = load_model_source(model)
    predicted = analyze_graphs(capture_steps(source, CaptureOptions(batch=2, seq=64, precision="fp16", target="cpu",
                                                                    capture="dispatch"),
                                             (PolicySpec(name="eager"),))).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(2, 64), torch.optim.AdamW(real.parameters(), lr=1e-3),
                            precision="fp16")
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert {p: predicted.phases[p].peak_bytes for p in ("forward", "backward", "optimizer")} == measured.phase_peaks


def test_gradient_sums_are_billed_to_the_module_whose_gradient_arrives_last_on_either_rung():
    """Autograd's engine sums the gradients a tensor gets from its readers (the residual stream's, a norm's
    input) when the last one arrives, inside the autograd node that made it: the op-by-op step bills the sum
    to that node's module, and the graph rung, whose sums carry no forward module, does the same. The two
    rungs give the same FLOPs and bytes per layer."""
    source = load_model_source("llama-debug")
    results = {}
    for capture in ("auto", "dispatch"):
        options = CaptureOptions(batch=2, seq=64, capture=capture)
        results[capture] = analyze_graphs(capture_steps(source, options, (PolicySpec(name="eager"),))).policies["eager"]
    graph, op_by_op = results["auto"], results["dispatch"]
    sums = [op.module for op in graph.graph.ops if op.phase.value == "backward" and op.target == "aten.add.Tensor"]
    assert sums and "" not in sums
    assert graph.flops_by_layer == op_by_op.flops_by_layer
    assert ({r.layer: (r.bytes_at_peak, r.saved_bytes) for r in graph.at_peak.layers}
            == {r.layer: (r.bytes_at_peak, r.saved_bytes) for r in op_by_op.at_peak.layers})


@pytest.mark.parametrize("fixture", ["unused_parameters_times_zero.py", "conv_channels_last_input.py"])
def test_a_gradient_accumulation_copy_is_billed_to_the_line_that_made_the_gradient_on_either_rung(fixture):
    """AccumulateGrad copies a gradient that arrives in another layout than its parameter's (an expanded
    zero, a channels-last gradient): it runs as soon as the node that made the gradient has, and both rungs
    bill the copy to that node's line and module."""
    source = load_model_source(os.path.join(FIXTURES, fixture))
    results = {}
    for capture in ("auto", "dispatch"):
        options = CaptureOptions(batch=2, seq=16, capture=capture)
        results[capture] = analyze_graphs(capture_steps(source, options, (PolicySpec(name="eager"),))).policies["eager"]
    graph, op_by_op = results["auto"], results["dispatch"]
    assert all(op.source is not None for op in op_by_op.graph.ops
               if op.phase.value == "backward" and op.target == "aten.copy_.default")
    assert [dataclasses.astuple(row) for row in graph.at_peak.lines] == \
        [dataclasses.astuple(row) for row in op_by_op.at_peak.lines]
    assert ({r.layer: (r.bytes_at_peak, r.saved_bytes) for r in graph.at_peak.layers}
            == {r.layer: (r.bytes_at_peak, r.saved_bytes) for r in op_by_op.at_peak.layers})


@pytest.mark.parametrize("fixture", ["user_checkpoint.py", "checkpoint_position_bias.py"])
def test_a_non_reentrant_checkpoints_recompute_is_recomputed_forward_work_on_either_rung(fixture):
    """torch.utils.checkpoint's recompute runs the region's forward code again inside backward: the op-by-op
    rung marks those ops recomputed at their own lines and modules, as the graph rung does, so the
    recomputed FLOPs and the FLOPs and bytes per layer and line are the same on both (on a CUDA target: on
    the CPU, the op-by-op rung does not see the CPU RNG state each region saves)."""
    source = load_model_source(os.path.join(FIXTURES, fixture))
    results = {}
    for capture in ("auto", "dispatch"):
        options = CaptureOptions(batch=2, seq=16, capture=capture, target="cuda:h100")
        results[capture] = analyze_graphs(capture_steps(source, options, (PolicySpec(name="eager"),))).policies["eager"]
    graph, op_by_op = results["auto"], results["dispatch"]
    assert op_by_op.recompute_flops == graph.recompute_flops > 0
    assert op_by_op.recompute_flops_by_line == graph.recompute_flops_by_line
    assert op_by_op.flops_by_layer == graph.flops_by_layer
    assert [dataclasses.astuple(row) for row in graph.at_peak.lines] == \
        [dataclasses.astuple(row) for row in op_by_op.at_peak.lines]


def test_a_selective_regions_recompute_under_its_caching_mode_is_recomputed_forward_work_too():
    """A selective region's recompute runs under checkpoint.py's caching mode (inside the model's frames):
    the op-by-op rung still finds the model line it runs from and counts its FLOPs as recomputed."""
    source = load_model_source(os.path.join(FIXTURES, "checkpoint_selective.py"))
    results = {}
    for capture in ("auto", "dispatch"):
        options = CaptureOptions(batch=2, seq=16, capture=capture, target="cuda:h100")
        results[capture] = analyze_graphs(capture_steps(source, options, (PolicySpec(name="eager"),))).policies["eager"]
    assert results["dispatch"].recompute_flops_by_line == results["auto"].recompute_flops_by_line
    assert results["dispatch"].recompute_flops > 0


def test_policies_need_a_graph():
    with pytest.raises(CaptureError, match="need a captured graph"):
        capture_steps(load_model_source(os.path.join(FIXTURES, "data_dependent_branch.py")),
                      CaptureOptions(batch=2, seq=16), (PolicySpec(name="full"),))


def test_strict_export_is_tried_when_non_strict_export_fails(monkeypatch):
    """The rung between non-strict export and the dispatch fallback; the direct trace and non-strict export
    are made to fail here."""
    import tracer.capture as capture
    real_export_joint = capture.export_joint

    def non_strict_fails(source, batch, seq, precision, *, strict=False, target="cpu", direct=False,
                         offload_activations=False, steady=False):
        if not strict:
            raise CaptureError("non-strict export failed (simulated)", next_rung_may_work=True)
        return real_export_joint(source, batch, seq, precision, strict=True, target=target)

    monkeypatch.setattr(capture, "export_joint", non_strict_fails)
    graphs = capture_steps(load_model_source("llama-debug"), CaptureOptions(batch=2, seq=16),
                           (PolicySpec(name="eager"), PolicySpec(name="full")))
    assert graphs["eager"].config.capture_path == "export-joint (strict)"
    assert any(op.recomputed for op in graphs["full"].ops)


def test_an_unknown_capture_path_is_a_usage_error():
    from tracer.errors import UsageError
    with pytest.raises(UsageError, match="unknown capture path 'bogus'"):
        capture_steps(load_model_source("llama-debug"), CaptureOptions(batch=2, seq=8, capture="bogus"),
                      (PolicySpec(name="eager"),))


def _line_of(code: str) -> int:
    """The line of tracer/models/llama.py that starts with `code` (the zoo model's source moves)."""
    import tracer.models.llama as llama
    with open(llama.__file__) as f:
        return next(n for n, text in enumerate(f, start=1) if text.strip().startswith(code))
