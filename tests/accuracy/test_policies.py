"""Recompute policies vs real CPU steps: torch.utils.checkpoint per block (non-reentrant), measured at
storage level (tests/truth.py, which also sees the CPU RNG state checkpoint saves), and FLOPs vs
torch.utils.flop_counter.FlopCounterMode over the real steps."""
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
from tracer.passes.flops import op_flops
from truth import Checkpointed, measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _predict(model, spec, batch, seq):
    graphs = capture_steps(load_model_source(model), CaptureOptions(batch=batch, seq=seq), (spec,))
    return analyze_graphs(graphs).policies[spec.label]


def _real_model(model, every, save_ops=None):
    source = load_model_source(model)
    torch.manual_seed(0)
    m = source.build_model()
    for i in range(0, len(m.blocks), every or len(m.blocks) + 1):
        if every:
            m.blocks[i] = Checkpointed(m.blocks[i], save_ops)
    return source, m


def _measure(model, every, batch, seq, save_ops=None):
    source, m = _real_model(model, every, save_ops)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    return measure_step(m, source.example_batch(batch, seq), opt)


@pytest.mark.parametrize("model,batch,seq", [("llama-debug", 2, 64), (os.path.join(FIXTURES, "llama4.py"), 2, 256)])
@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointing_matches_a_real_checkpointed_step(model, batch, seq, every, policy):
    """Selective keeps mm and CPU-flash SDPA outputs, like the default `matmul-attention` save policy."""
    predicted = _predict(model, PolicySpec(name=policy, checkpoint_every=every), batch, seq)
    measured = _measure(model, every, batch, seq, SAVE_OPS if policy == "selective" else None)
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert abs(p - m) <= 0.005 * m, f"{phase}: predicted {p:,} measured {m:,}"
    last_forward = max(op.index for op in predicted.graph.ops if op.phase.value == "forward")
    assert predicted.liveness.live_after[last_forward] == measured.forward_end_bytes   # kept for backward


def _matmul_attention_flops(ops) -> int:
    """Our FLOPs over the op families FlopCounterMode knows (matmuls, attention)."""
    families = ("aten.mm", "aten.addmm", "aten.bmm", "aten._scaled_dot_product")
    return sum(op_flops(op) or 0 for op in ops if op.target.startswith(families))


def _counted_step_flops(m, batch) -> int:
    with FlopCounterMode(display=False) as counter:
        m(*batch).backward()
    return counter.get_total_flops()


def test_full_recompute_flops_equal_flop_counter_difference():
    from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count
    cpu_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    cpu_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
    from torch.utils.flop_counter import flop_registry
    added = []
    if cpu_fwd not in flop_registry:      # FlopCounterMode has no CPU flash formulas: add ours (causal = half)
        @register_flop_formula(cpu_fwd)
        def _fwd(q, k, v, dropout_p=0.0, is_causal=False, *a, out_val=None, **kw):
            return sdpa_flop_count(q, k, v) // (2 if is_causal else 1)

        @register_flop_formula(cpu_bwd)
        def _bwd(grad, q, k, v, out, lse, dropout_p=0.0, is_causal=False, *a, out_val=None, **kw):
            return sdpa_backward_flop_count(grad, q, k, v) // (2 if is_causal else 1)
        added = [cpu_fwd, cpu_bwd]
    try:
        predicted = _predict("llama-debug", PolicySpec(name="full"), 2, 64)
        source, plain = _real_model("llama-debug", every=None)
        _, checkpointed = _real_model("llama-debug", every=1)
        batch = source.example_batch(2, 64)
        measured = _counted_step_flops(checkpointed, batch) - _counted_step_flops(plain, batch)
    finally:
        for op in added:
            flop_registry.pop(op, None)
    recomputed = [op for op in predicted.graph.ops if op.recomputed]
    assert measured > 0
    assert _matmul_attention_flops(recomputed) == measured


def test_forward_flops_per_token_of_llama_88m():
    """Forward FLOPs per token = 2 x (parameters used in matmuls, the output layer included) plus the attention
    score and value products: 2 * 2 * s * d per layer per token, halved by causal masking (s x s scores,
    d = heads x head_dim)."""
    seq, batch = 1024, 1
    predicted = _predict("llama-88m", PolicySpec(name="eager"), batch, seq)
    forward = [op for op in predicted.graph.ops if op.phase.value == "forward"]
    d, n_layers, vocab, kv_dim, d_ff = 768, 10, 32_768, 256, 2_048
    matmul_params = n_layers * (2 * d * d + 2 * d * kv_dim + 3 * d * d_ff) + d * vocab
    attention = n_layers * 2 * (2 * seq * d) // 2
    assert _matmul_attention_flops(forward) == batch * seq * (2 * matmul_params + attention)


def test_a_model_without_repeated_blocks_is_checkpointed_whole():
    """No repeated blocks: `full` checkpoints the whole forward as one region, as
    checkpoint(model, ...) around the forward (loss included) does; the report notes it."""
    model = os.path.join(FIXTURES, "dropout_zero.py")
    predicted = _predict(model, PolicySpec(name="full"), 2, 64)
    assert any("checkpointed as one region" in n for n in predicted.graph.config.notes)
    source = load_model_source(model)
    torch.manual_seed(0)
    real = Checkpointed(source.build_model())
    measured = measure_step(real, source.example_batch(2, 64), torch.optim.AdamW(real.parameters(), lr=1e-3))
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert predicted.saved.total_bytes == measured.saved_bytes
