"""Context parallelism (--cp): rank 0 of a real 2-rank step under torch's `context_parallel`, predicted to the
byte.

Each of two gloo processes builds the same model and batch, enters torch's public
`context_parallel(mesh, buffers=[tokens, targets], buffer_seq_dims=[1, 1])` as torchtitan's training loop does
(the batch sharded along the sequence, head-tail load-balanced, `F.scaled_dot_product_attention` replaced by
the ring), and runs one real training step after a warm-up, measured at storage level (tests/truth.py). torch's
ring handlers cover the CUDA attention kernels only; a CPU step picks CPU's flash kernel, so both the real
step and the capture run with `cpu_ring_kernels()` (tracer/capture/context_parallel.py), which gives that
kernel the same ring (torch's `_templated_ring_attention` and its backward). What is checked is the capture:
the ring's collectives, gathered buffers, fp32 merges and saved tensors on fake ranks against real ones.
tracer captures the same file as rank 0 of a fake 2-rank group (`--cp 2`, the batch at seq / 2).

Models: tests/fixtures/context_parallel_lm.py in its two styles (Llama: rotary positions, grouped-query
keys repeated; GPT-2: learned positions) and `hf:llama` (transformers' SDPA attention).
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import tracer
import truth
from gloo import run_ranks

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "context_parallel_lm.py")
STYLES = ("llama", "gpt")
HF_LLAMA = ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
            "num_key_value_heads=2", "vocab_size=128")
BATCH, SEQ, RANKS = 2, 64, 2


def _source(name: str):
    from tracer.capture import load_model_source
    if name == "hf:llama":
        return load_model_source("hf:llama", hf_config=HF_LLAMA)
    spec = importlib.util.spec_from_file_location("context_parallel_lm", FIXTURE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _build(name: str):
    torch.manual_seed(0)
    source = _source(name)
    model = source.build_model() if name == "hf:llama" else source.build_model(style=name)
    return model, source.example_batch(BATCH, SEQ)


def _measured(model, batch, precision: str = "fp32") -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measured = truth.measure_step(model, batch, optimizer, precision=precision)
    return {"phases": measured.phase_peaks, "saved": measured.saved_bytes, "start": measured.start_bytes,
            "forward end": measured.forward_end_bytes}


# tracer's selective policy saves matmuls' and attention's outputs (tracer/policies.py)
SAVE_OPS = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}


def _measure_rank(name: str, checkpointed: bool = False, save_ops=None, precision: str = "fp32") -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.experimental import context_parallel

    from tracer.capture.context_parallel import cpu_ring_kernels
    model, batch = _build(name)
    if checkpointed:
        model.blocks = torch.nn.ModuleList(truth.Checkpointed(block, save_ops) for block in model.blocks)
    tokens, targets = batch
    mesh = DeviceMesh("cpu", torch.arange(RANKS))
    with context_parallel(mesh, buffers=[tokens, targets], buffer_seq_dims=[1, 1],
                          no_restore_buffers={tokens, targets}), cpu_ring_kernels():
        # the sharded buffers are resized in place (their storages keep the whole length): the step gets
        # copies of this rank's share, as a loop that shards its batch before the step does
        return _measured(model, (tokens.clone(), targets.clone()), precision)


def _measure_every_case(rank: int) -> dict:
    return {**{name: _measure_rank(name) for name in (*STYLES, "hf:llama")},
            "llama-full": _measure_rank("llama", checkpointed=True),
            "llama-selective": _measure_rank("llama", checkpointed=True, save_ops=SAVE_OPS),
            "llama-bf16": _measure_rank("llama", precision="bf16")}


@pytest.fixture(scope="module")
def rank0(tmp_path_factory) -> dict:
    return run_ranks(_measure_every_case, RANKS, str(tmp_path_factory.mktemp("cp")))[0]


def _predicted(name: str, cp: int, capture: str = "auto", policy: str = "eager", precision: str = "fp32") -> dict:
    if name == "hf:llama":
        result = tracer.analyze("hf:llama", hf_config=HF_LLAMA, batch=BATCH, seq=SEQ, target="cpu", cp=cp,
                                capture=capture, policies=(policy,)).policies[policy]
    else:
        result = tracer.analyze(FIXTURE, batch=BATCH, seq=SEQ, target="cpu", cp=cp, capture=capture,
                                policies=(policy,), model_args=(f"style={name}",), precision=precision
                                ).policies[policy]
    last_forward = max(op.index for op in result.graph.ops if op.phase.value == "forward")
    return {"phases": {phase: peak.peak_bytes for phase, peak in result.phases.items()},
            "saved": result.saved.total_bytes, "start": result.start_bytes,
            "forward end": result.liveness.live_after[last_forward]}


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["auto", "dispatch"])
@pytest.mark.parametrize("name", [*STYLES, "hf:llama"])
def test_rank_zero_of_a_context_parallel_step_is_predicted_to_the_byte(rank0, name, capture):
    """Every phase's peak, the saved bytes and the bytes before the step, on the joint-graph rung and op by op."""
    assert _predicted(name, RANKS, capture) == rank0[name]


@pytest.mark.slow
@pytest.mark.parametrize("policy", ["full", "selective"])
def test_checkpointed_blocks_run_the_ring_again_in_backward(rank0, policy):
    """Every block under non-reentrant torch.utils.checkpoint (`selective`: matmuls' and attention's outputs
    kept, as tracer's selective policy keeps them): the recompute runs the ring's forward again. Selective
    checkpointing caches the attention's merged outputs (it sees the DTensor op, not the ring's kernels).
    The cache is held outside saved-tensor hooks, which the measured "saved" bytes count, so under
    `selective` the bytes live when forward ends stand for what is kept."""
    predicted, measured = _predicted("llama", RANKS, policy=policy), rank0[f"llama-{policy}"]
    if policy == "selective":
        del predicted["saved"], measured["saved"]
    assert predicted == measured


@pytest.mark.slow
def test_bf16_autocast_rings_bf16_attention(rank0):
    assert _predicted("llama", RANKS, precision="bf16") == rank0["llama-bf16"]


@pytest.mark.slow
@pytest.mark.parametrize("name", STYLES)
def test_the_same_file_in_one_process_holds_the_whole_sequence(name):
    """The control: no group, no ring; the whole sequence's activations are more than rank 0's share."""
    predicted = _predicted(name, 1)
    assert predicted == _measured(*_build(name))
    assert predicted["saved"] > _predicted(name, RANKS)["saved"]
