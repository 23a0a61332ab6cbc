"""--tp N [--sp]: one Megatron tensor-parallel rank's step (tracer/passes/tensor_parallel.py), computed from
the captured graph. No multi-GPU run is possible here, so the ground truth is Korthikanti et al. (2022),
"Reducing Activation Recomputation in Large Transformer Models", Table 2: a rank's activation bytes per
transformer layer with 16-bit activations and 1-byte dropout masks,

    tensor parallel:                      sbh (10 + 24/t + 5as/(ht))
    tensor + sequence parallel:           sbh (34/t + 5as/(ht))

on a GPT block in the paper's layout (tests/fixtures/megatron_gpt.py: their section 4.1, scaled down:
a=8 heads, h=64, with dropout so the masks exist), run with bf16 weights and activations. The paper leaves
out "small buffers like the mean and variance of layer norm": the tracer counts them (two per layer norm,
(b, s, 1) fp32 each, split along the sequence with sp), and the tests add exactly those bytes to the formula."""
import math
import os

import pytest

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.errors import UsageError
from tracer.passes.analysis import ShardingSetup, analyze_graphs
from tracer.passes.tensor_parallel import COLUMN, ROW, VOCAB, TensorParallelSetup, plan_tensor_parallel
from tracer.stepgraph import StorageRole

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
HEADS, DIM = 8, 64                                   # the fixture's a and h


def paper_activation_bytes(s: int, b: int, h: int, a: int, t: int, sp: bool) -> int:
    """Korthikanti et al. Table 2, bytes per layer on one rank (exact for these sizes: every term divides)."""
    per_element = (34 / t if sp else 10 + 24 / t) + 5 * a * s / (h * t)
    value = s * b * h * per_element
    assert value == int(value)
    return int(value)


def layer_norm_statistics_bytes(s: int, b: int, t: int, sp: bool) -> int:
    """Mean and rstd of the block's two layer norms, (b, s, 1) each in fp32 (CUDA's kernel makes them in the
    accumulation type for a bf16 input: layer_norm_kernel.cu); split along s with sp."""
    return 2 * 2 * (s * b * 4) // (t if sp else 1)


@pytest.fixture(scope="module", params=[(32, 2), pytest.param((64, 1), marks=pytest.mark.slow)], ids=["s32-b2", "s64-b1"])
def gpt_step(request):
    seq, batch = request.param
    source = load_model_source(os.path.join(FIXTURES, "megatron_gpt.py"))
    # the paper's 1-byte masks are CUDA's dropout (on CPU eager saves a float noise tensor)
    graph = capture_steps(source, CaptureOptions(batch=batch, seq=seq, precision="bf16-pure", target="cuda"),
                          (PolicySpec(name="eager"),))["eager"]
    return graph, seq, batch


def rank_step(graph, t, sp=False, **kwargs):
    setup = TensorParallelSetup(t, sp) if t > 1 else None
    return analyze_graphs({"eager": graph}, tensor_parallel=setup, **kwargs).policies["eager"]


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (4, False), (8, False), (2, True), (4, True), (8, True)])
def test_activation_bytes_per_layer_are_the_papers(gpt_step, t, sp):
    graph, s, b = gpt_step
    layers = {row.layer: row.saved_bytes for row in rank_step(graph, t, sp).at_peak.layers}
    expected = paper_activation_bytes(s, b, DIM, HEADS, t, sp) + layer_norm_statistics_bytes(s, b, t, sp)
    assert layers["blocks.0"] == layers["blocks.1"] == expected


def test_roles_come_from_the_data_flow(gpt_step):
    graph, _, _ = gpt_step
    plan = plan_tensor_parallel(graph, 4)
    for block in ("blocks.0", "blocks.1"):
        assert {m for m in plan.linears(COLUMN) if m.startswith(block)} == {
            f"{block}.attn.q_proj", f"{block}.attn.k_proj", f"{block}.attn.v_proj", f"{block}.mlp.fc1"}
        assert {m for m in plan.linears(ROW) if m.startswith(block)} == {f"{block}.attn.o_proj", f"{block}.mlp.fc2"}
    assert "head" in plan.linears(COLUMN)
    assert plan.roles["embed.weight"] == VOCAB
    assert plan.uneven == ()
    assert plan_tensor_parallel(graph, 4, sp=True).roles == plan.roles   # sp splits values, not roles


@pytest.mark.slow
def test_roles_of_a_llama_block_with_other_names():
    """llama-debug names its linears wq/wk/wv/wo and w1/w2/w3 (SwiGLU), ties the head to the embedding and
    runs RoPE and SDPA: the roles still follow from the graph."""
    graph = capture_steps(load_model_source("llama-debug"), CaptureOptions(batch=2, seq=32),
                          (PolicySpec(name="eager"),))["eager"]
    plan = plan_tensor_parallel(graph, 2)
    assert set(plan.linears(COLUMN)) == {f"blocks.{i}.{m}" for i in (0, 1)
                                         for m in ("attn.wq", "attn.wk", "attn.wv", "mlp.w1", "mlp.w3")}
    assert set(plan.linears(ROW)) == {f"blocks.{i}.{m}" for i in (0, 1) for m in ("attn.wo", "mlp.w2")}
    assert plan.roles["embed.weight"] == VOCAB


def megatron_parameter_bytes(graph, t: int) -> int:
    """What Megatron keeps per rank, from the module definitions: column-parallel weights and biases, row
    weights and the word embedding hold 1/t; layer norms and row biases are whole."""
    total = 0
    for s in graph.storages:
        if s.role is not StorageRole.PARAMETER:
            continue
        module, _, kind = s.name.rpartition(".")
        split = (module.endswith(("q_proj", "k_proj", "v_proj", "fc1")) or module in ("embed", "head")
                 or (module.endswith(("o_proj", "fc2")) and kind == "weight"))
        total += s.nbytes // t if split else s.nbytes
    return total


@pytest.mark.parametrize("t", [2, 4, 8])
def test_parameters_gradients_and_adam_state_per_rank_are_megatrons(gpt_step, t):
    graph, _, _ = gpt_step
    rank = rank_step(graph, t).graph
    by_role = {role: sum(s.nbytes for s in rank.storages if s.role is role and s.shape != ())
               for role in (StorageRole.PARAMETER, StorageRole.GRADIENT, StorageRole.OPTIMIZER_STATE)}
    params = megatron_parameter_bytes(graph, t)
    assert by_role[StorageRole.PARAMETER] == params
    assert by_role[StorageRole.GRADIENT] == params
    assert by_role[StorageRole.OPTIMIZER_STATE] == 2 * params               # exp_avg, exp_avg_sq
    assert any(f"({params // 2:,} of" in n for n in rank.config.notes)      # bf16: 2 bytes a parameter


def test_tensor_parallel_composes_with_zero(gpt_step):
    """--tp 2 --shard zero1 --world-size 4: ZeRO shards what the tensor-parallel rank holds."""
    graph, _, _ = gpt_step
    rank = rank_step(graph, 2)
    sharded = rank_step(graph, 2, sharding=ShardingSetup("zero1", 4)).sharded
    steps = sum(s.nbytes for s in rank.graph.storages if s.role is StorageRole.OPTIMIZER_STATE and s.shape == ())
    state = sum(s.nbytes for s in rank.graph.storages if s.role is StorageRole.OPTIMIZER_STATE) - steps
    assert sharded.model_state_bytes["optimizer_state"] == state // 4 + steps
    assert sharded.model_state_bytes["parameter"] == megatron_parameter_bytes(graph, 2)


def test_the_whole_step_is_smaller_per_rank_and_one_rank_is_the_step(gpt_step):
    graph, _, _ = gpt_step
    whole = rank_step(graph, 1)
    peaks = [rank_step(graph, t).peak_bytes for t in (2, 4, 8)]
    assert whole.peak_bytes > peaks[0] > peaks[1] > peaks[2]
    assert rank_step(graph, 4, sp=True).peak_bytes < peaks[1]
    assert plan_tensor_parallel(graph, 1).split_storage_ids == frozenset()
    with pytest.raises(UsageError, match="--tp 0"):
        plan_tensor_parallel(graph, 0)


def test_a_split_that_does_not_divide_a_linear_is_refused_as_megatron_refuses_it(gpt_step):
    graph, _, _ = gpt_step
    plan = plan_tensor_parallel(graph, 3)              # 64 output features over 3 ranks
    assert "blocks.0.attn.q_proj.weight" in plan.uneven
    with pytest.raises(UsageError, match=r"--tp 3: blocks\.0\.attn\.q_proj\.weight \(64, 64\) does not split"):
        rank_step(graph, 3)