"""The CUDA target: SDPA backend rules, CUDA autocast lists, cuBLAS workspace sizes, and what a cuda-target
capture of llama-debug saves for backward (the CUDA SDPA ops' logsumexp and RNG state)."""
from __future__ import annotations

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.capture.target import (
    CUDA_AUTOCAST_POLICY,
    GPUS,
    SdpaCall,
    choose_sdpa_backend,
    cublas_workspace_bytes,
    cuda_capture,
    device_allocations,
    parse_target,
)
from tracer.errors import UsageError
from tracer.passes.analysis import analyze_graph

MIB = 2**20


def _call(dtype="bfloat16", head_dim=64, **kw) -> SdpaCall:
    fields = dict(dtype=dtype, batch=2, q_heads=12, kv_heads=12, seq_q=1024, seq_k=1024, head_dim_qk=head_dim,
                  head_dim_v=head_dim, is_causal=True)
    fields.update(kw)
    return SdpaCall(**fields)


# (call, gpu) -> backend, each row names the rule that decides it (upstream sdp_utils.cpp)
BACKEND_TABLE = [
    (_call(), "a100", "flash"),                                   # bf16, hd 64, causal, no mask
    (_call(), "h100", "flash"),
    (_call(dtype="float16"), "v100", "efficient"),                # flash needs sm80+
    (_call(), "v100", "math"),                                    # bf16 below sm80: neither fused kernel
    (_call(dtype="float32"), "a100", "efficient"),                # flash needs fp16/bf16
    (_call(dtype="float32"), "t4", "efficient"),                  # fp32 efficient, alignment 1 on sm75
    (_call(dtype="float32", head_dim=62), "a100", "math"),        # fp32 on sm80 needs head dim % 4
    (_call(head_dim=60), "a100", "flash"),                        # flash pads the head dim to 8 itself
    (_call(head_dim=60), "t4", "math"),                           # fp16/bf16 efficient needs % 8 (and bf16 fails)
    (_call(dtype="float16", head_dim=60), "t4", "math"),
    (_call(head_dim=256), "a100", "flash"),
    (_call(head_dim=320), "a100", "efficient"),                   # flash <= 256
    (_call(head_dim=224), "a10g", "efficient"),                   # flash backward on sm86: head dim <= 192
    (_call(head_dim=224, requires_grad=False), "a10g", "flash"),  # ... which only matters for training
    (_call(has_mask=True), "a100", "efficient"),                  # flash takes no attn_mask
    (_call(dropout_p=0.1), "a100", "flash"),                      # dropout is fine for flash (philox state)
    (_call(kv_heads=4, enable_gqa=True), "a100", "flash"),        # GQA native in flash
    (_call(kv_heads=4), "a100", "math"),                          # different heads without enable_gqa
    (_call(seq_q=1, seq_k=1024), "a100", "efficient"),            # flash causal needs square
    (_call(last_dim_contiguous=False), "a100", "math"),
]


@pytest.mark.parametrize("call,gpu,expected", BACKEND_TABLE)
def test_sdpa_backend_choice(call, gpu, expected):
    choice = choose_sdpa_backend(call, GPUS[gpu])
    assert choice.backend == expected, choice.rejected
    tried = [b for b, _ in choice.rejected]
    assert tried == list(("flash", "efficient", "math", "cudnn")[:len(tried)])


def test_cudnn_first_priority_and_its_rules():
    cudnn_first = ("cudnn", "flash", "efficient", "math")
    assert choose_sdpa_backend(_call(), GPUS["h100"], cudnn_first).backend == "cudnn"
    assert choose_sdpa_backend(_call(dropout_p=0.1), GPUS["h100"], cudnn_first).backend == "flash"   # not k/16
    assert choose_sdpa_backend(_call(dtype="float32"), GPUS["h100"], cudnn_first).backend == "efficient"


def test_parse_target_and_cublas_workspaces():
    assert parse_target("cpu").label == "cpu"
    assert parse_target("cuda").label == "cuda:h100"                      # DEFAULT_GPU
    assert parse_target("cuda", "h100").label == parse_target("cuda:h100").label == "cuda:h100"
    for bad in ("tpu", "cuda:x9000"):
        with pytest.raises(UsageError):
            parse_target(bad)
    with pytest.raises(UsageError, match="needs --target cuda"):
        parse_target("cpu", "h100")
    # PyTorch's defaults (CublasHandlePool.cpp): :4096:2:16:8 below sm90, 32 MiB from sm90 on
    assert cublas_workspace_bytes(GPUS["a100"]) == 4096 * 1024 * 2 + 16 * 1024 * 8 == 8_519_680
    assert cublas_workspace_bytes(GPUS["h100"]) == cublas_workspace_bytes(GPUS["b200"]) == 32 * MIB
    assert cublas_workspace_bytes(GPUS["a100"], ":4096:8") == 32 * MIB
    assert cublas_workspace_bytes(GPUS["a100"], ":16:8") == 128 * 1024
    with pytest.raises(UsageError):
        cublas_workspace_bytes(GPUS["a100"], "4096")
    (ws,) = device_allocations(parse_target("cuda:a100"))
    assert (ws.nbytes, ws.count, ws.total_bytes) == (8_519_680, 2, 17_039_360)
    assert device_allocations(parse_target("cpu")) == ()


def _dispatcher_autocast_ops(key: str) -> set[str]:
    return {n.removeprefix("aten::") for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


def test_cuda_autocast_table_is_this_torch_s_autocast_cuda_registrations():
    """Every op with an AutocastCUDA kernel in the installed torch has a policy in the table, and back."""
    registered = _dispatcher_autocast_ops("AutocastCUDA")
    table = {name.removesuffix(".default") for name in CUDA_AUTOCAST_POLICY}
    assert registered == table, (sorted(registered - table), sorted(table - registered))


def test_cuda_autocast_emulation_on_cpu_tensors():
    x = torch.randn(4, 8)
    w = torch.randn(8, 8)
    target = parse_target("cuda")
    with cuda_capture(target, "bf16"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.exp(x.bfloat16()).dtype == torch.float32          # fp32 list on CUDA, input dtype on CPU
        assert torch.einsum("bi,oi->bo", x, w).dtype == torch.bfloat16  # einsum casts itself on CUDA
        assert x.bfloat16().sum(-1).dtype == torch.float32              # fp32_set_opt_dtype
        assert torch.softmax(x.bfloat16(), -1).dtype == torch.float32
        assert torch.addcmul(x, x.bfloat16(), x).dtype == torch.float32  # promote to the widest
        assert torch.stack([x, x.bfloat16()]).dtype == torch.float32     # CPU-only list entry: no cast
    with torch.autocast("cpu", dtype=torch.bfloat16):                   # registrations are gone again
        assert torch.exp(x.bfloat16()).dtype == torch.bfloat16
    with cuda_capture(parse_target("cpu"), "bf16"), torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.exp(x.bfloat16()).dtype == torch.bfloat16          # cpu target: nothing changes


def _saved_sdpa_outputs(result, op_name: str) -> dict:
    """Saved storages produced by the forward SDPA op, keyed by (dtype, shape)."""
    graph = result.graph
    out = {}
    for op in graph.ops:
        if op.target == op_name and op.phase.value == "forward":
            for value in op.outputs:
                if value.storage_id in result.saved.storage_ids:
                    out[(value.dtype, value.shape)] = out.get((value.dtype, value.shape), 0) + 1
    return out


@pytest.fixture(scope="module")
def llama_debug():
    return load_model_source("llama-debug")


@pytest.mark.slow
def test_cuda_capture_of_llama_debug_saves_flash_logsumexp_and_rng_state(llama_debug):
    """bf16 on an A100: flash attention; it saves out, logsumexp (b, h, s) fp32 and the philox RNG state
    (2,) uint64 per layer, as the CUDA op does (the CPU kernel saves no RNG state)."""
    options = CaptureOptions(batch=2, seq=32, precision="bf16", target="cuda:a100")
    result = analyze_graph(capture_step(llama_debug, options)).policies["eager"]
    targets = [op.target for op in result.graph.ops]
    layers = 2
    assert targets.count("aten._scaled_dot_product_flash_attention.default") == layers
    assert targets.count("aten._scaled_dot_product_flash_attention_backward.default") == layers
    assert not any("for_cpu" in t for t in targets)
    saved = _saved_sdpa_outputs(result, "aten._scaled_dot_product_flash_attention.default")
    assert saved[("bfloat16", (2, 4, 32, 16))] == layers                 # out
    assert saved[("float32", (2, 4, 32))] == layers                      # logsumexp
    assert saved[("uint64", (2,))] == layers                             # philox seed + offset (rng_state)


@pytest.mark.slow
def test_cuda_capture_fp32_uses_efficient_attention_with_padded_logsumexp(llama_debug):
    options = CaptureOptions(batch=2, seq=40, precision="fp32", target="cuda:a100")
    result = analyze_graph(capture_step(llama_debug, options)).policies["eager"]
    saved = _saved_sdpa_outputs(result, "aten._scaled_dot_product_efficient_attention.default")
    assert saved[("float32", (2, 4, 64))] == 2                          # logsumexp padded to ceil(40/32)*32
    assert saved[("int64", ())] == 4                                     # philox seed and offset per layer
    cpu = analyze_graph(capture_step(llama_debug, CaptureOptions(batch=2, seq=40))).policies["eager"]
    assert _saved_sdpa_outputs(cpu, "aten._scaled_dot_product_flash_attention_for_cpu.default")[
        ("float32", (2, 4, 40))] == 2                                    # CPU: unpadded, no RNG state


@pytest.mark.slow
def test_cuda_capture_without_a_fused_kernel_falls_back_to_math(llama_debug):
    options = CaptureOptions(batch=2, seq=32, precision="bf16", target="cuda:v100")
    graph = capture_step(llama_debug, options)
    assert not any("scaled_dot_product" in op.target for op in graph.ops)
    assert any("softmax" in op.target for op in graph.ops)                 # the math composite


@pytest.mark.parametrize("fixture", ["checkpoint_function.py", "checkpoint_reentrant.py"])
def test_a_checkpointed_regions_rng_states_take_device_memory_on_a_cpu_target_only(fixture):
    """torch.utils.checkpoint saves the CPU generator's state at each region's entry and fork_rng stashes a
    copy while the region recomputes: CPU tensors, so a CPU step's device memory holds them and a CUDA
    step's does not (on a GPU they are host memory, the process's own, outside the device's allocator)."""
    import os
    source = load_model_source(os.path.join(os.path.dirname(__file__), "..", "fixtures", fixture))
    rng_bytes = torch.get_rng_state().numel()

    def rng_states(target: str) -> list:
        graph = capture_step(source, CaptureOptions(batch=2, seq=16, target=target))
        return [s for s in graph.storages if s.name and "RNG state" in s.name]

    on_cpu = rng_states("cpu")
    assert on_cpu and all(s.nbytes == rng_bytes and not s.host for s in on_cpu)
    assert rng_states("cuda:h100") == []
