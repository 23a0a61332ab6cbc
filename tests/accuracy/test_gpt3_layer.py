"""Korthikanti et al. (2022): a GPT-3 layer in 16-bit with 1-byte dropout masks saves s*b*h*(34 + 5*a*s/h)
bytes. The paper's masks are CUDA's (a CPU step saves dropout's float noise: tracer/capture/eager_kernels.py),
so the step is traced for CUDA; it saves exactly that plus the LayerNorm statistics (mean and rstd for each
of the two LayerNorms: 4 tensors of s*b elements, fp32 as CUDA's kernel makes them for a 16-bit input:
layer_norm_kernel.cu allocates them in the accumulation type)."""
from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.models.gpt3_layer import GPT3LayerConfig
from tracer.passes.analysis import analyze_graph


def test_gpt3_layer_saved_bytes_match_korthikanti():
    cfg = GPT3LayerConfig.named("debug")
    s, b, h, a = 128, 2, cfg.d_model, cfg.n_heads
    options = CaptureOptions(batch=b, seq=s, precision="bf16-pure", optimizer="none", target="cuda")
    result = analyze_graph(capture_step(load_model_source("gpt3-layer-debug"), options)).policies["eager"]
    paper_bytes = s * b * h * (34 + 5 * a * s // h)
    layernorm_stats_bytes = 2 * 2 * s * b * 4
    assert result.saved.total_bytes == paper_bytes + layernorm_stats_bytes
