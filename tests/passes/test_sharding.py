"""Per-rank memory under DDP / ZeRO / FSDP2 (tracer/passes/sharding.py): the ZeRO paper's figures, the
single-device limits, and FSDP2's unit schedule on a hand-built step. tests/accuracy/test_fsdp.py checks
the FSDP2 numbers against a real fully_shard step."""
import pytest

import tracer
from tracer.choices import CUDA_CONTEXT_BYTES, GPUS
from graph_builder import GraphBuilder
from tracer.errors import UsageError
from tracer.passes.analysis import analyze_graph
from tracer.passes.sharding import STRATEGIES, find_units, shard_bytes, shard_memory, zero_model_state_bytes
from tracer.stepgraph import StorageRole


def test_zero_paper_7_5b_on_64_gpus():
    """Rajbhandari et al. 2020, Figure 1: Psi = 7.5B, K = 12 (mixed-precision Adam), Nd = 64, in GB
    rounded to one decimal as the paper prints them."""
    per_gpu = {s: zero_model_state_bytes(7_500_000_000, s, 64, param_bytes=2, grad_bytes=2, optimizer_bytes=12)
               for s in ("ddp", "zero1", "zero2", "zero3")}
    assert {s: round(b / 1e9, 1) for s, b in per_gpu.items()} == {"ddp": 120.0, "zero1": 31.4, "zero2": 16.6,
                                                                  "zero3": 1.9}
    assert per_gpu == {"ddp": 16 * 7_500_000_000, "zero1": 4 * 7_500_000_000 + 12 * 7_500_000_000 // 64,
                       "zero2": 2 * 7_500_000_000 + 14 * 7_500_000_000 // 64, "zero3": 16 * 7_500_000_000 // 64}


def test_shard_is_rank_zeros_dim0_chunk():
    assert shard_bytes((5, 3), 5 * 3 * 4, 2) == 3 * 3 * 4           # ceil(5 / 2) rows
    assert shard_bytes((), 4, 8) == 4                               # 0-dim (Adam's step): whole
    assert shard_bytes((64,), 256, 1) == 256


@pytest.fixture(scope="module")
def debug_step(llama_debug):
    return llama_debug.policies["eager"]


def test_ddp_and_one_rank_are_the_single_device_step(debug_step):
    assert shard_memory(debug_step, "ddp", 64).peak_bytes == debug_step.peak_bytes
    for strategy in ("zero1", "zero2"):
        one = shard_memory(debug_step, strategy, 1)
        assert one.peak_bytes == debug_step.peak_bytes
        assert one.phases == {k: v.peak_bytes for k, v in debug_step.phases.items()}


def test_model_state_follows_the_zero_formula_on_a_real_step(debug_step):
    """fp32 AdamW: 4 + 4 + 8 bytes per parameter, plus one unsharded 4-byte `step` per parameter tensor.
    Every llama-debug dim 0 divides by 2, so nothing is padded."""
    graph = debug_step.graph
    n_params = sum(s.nbytes // 4 for s in graph.storages if s.role is StorageRole.PARAMETER)
    steps = sum(s.nbytes for s in graph.storages if s.role is StorageRole.OPTIMIZER_STATE and not s.shape)
    for strategy in STRATEGIES:
        state = shard_memory(debug_step, strategy, 2).model_state_bytes
        expected = zero_model_state_bytes(n_params, strategy if strategy != "fsdp" else "zero3", 2,
                                          param_bytes=4, grad_bytes=4, optimizer_bytes=8)
        assert sum(state.values()) == expected + steps, strategy


def test_more_sharding_never_costs_more_model_state(debug_step):
    totals = [sum(shard_memory(debug_step, s, 4).model_state_bytes.values()) for s in ("ddp", "zero1", "zero2", "zero3")]
    assert totals == sorted(totals, reverse=True)


def _two_block_step():
    """root param r (400 B), blocks.0 and blocks.1 with one 800 B param each; forward, backward, optimizer."""
    b = GraphBuilder()
    r = b.storage(400, StorageRole.PARAMETER, preexisting=True, persistent=True, name="embed.weight")
    w = [b.storage(800, StorageRole.PARAMETER, preexisting=True, persistent=True, name=f"blocks.{i}.w.weight")
         for i in range(2)]
    x = b.storage(80)
    b.op("forward", [r], [x], module="embed")                                   # 0
    h0 = b.storage(80)
    b.op("forward", [x, w[0]], [h0], module="blocks.0")                         # 1
    h1 = b.storage(80)
    b.op("forward", [h0, w[1]], [h1], module="blocks.1")                        # 2
    loss = b.storage(4, persistent=True)
    b.op("forward", [h1, r], [loss], module="")                                 # 3
    g = [b.storage(800, StorageRole.GRADIENT, persistent=True, name=f"blocks.{i}.w.weight.grad") for i in range(2)]
    gr = b.storage(400, StorageRole.GRADIENT, persistent=True, name="embed.weight.grad")
    b.op("backward", [loss, h1], [g[1]], module="blocks.1")                     # 4
    b.op("backward", [h0, x], [g[0]], module="blocks.0")                        # 5
    b.op("backward", [x], [gr], module="embed")                                 # 6
    b.op("optimizer", [r, w[0], w[1], g[0], g[1], gr])                          # 7
    return analyze_graph(b.build()).policies["eager"]


def test_fsdp_units_are_the_blocks_and_the_root():
    step = _two_block_step()
    units = find_units(step.graph, 2)
    assert [(u.name, u.forward_ops, u.backward_ops, u.padded_bytes) for u in units] == [
        ("", (0, 3), (6, 6), 400), ("blocks.0", (1, 1), (5, 5), 800), ("blocks.1", (2, 2), (4, 4), 800)]


def test_zero3_gathers_one_block_at_a_time():
    step = _two_block_step()
    sharded = (400 + 800 + 800) // 2
    for reshard, during_blocks_1_forward in ((True, 400 + 800), (False, 400 + 800 + 800)):
        m = shard_memory(step, "zero3", 2, reshard_after_forward=reshard)
        assert m.by_category_at_peak["parameter"] == sharded
        activations = 80 + 80 + 80                                    # x, h0, h1 live at op 2
        assert m.live_during[2] == sharded + during_blocks_1_forward + activations


def test_fsdp_adds_the_all_gather_output_until_the_next_copy_out():
    step = _two_block_step()
    zero3 = shard_memory(step, "zero3", 2)
    fsdp = shard_memory(step, "fsdp", 2)
    # blocks.1's pre-forward: its all-gather output and copy-out while blocks.0's output is still held
    before_op_2 = (400 + 800 + 800) // 2 + 400 + 800 + 80 + 80      # shards, root, blocks.0's output, x, h0
    assert fsdp.live_during[2] == before_op_2 + 800 + 800
    assert zero3.live_during[2] == before_op_2 - 800 + 800 + 80     # no buffers; h1 allocated by op 2
    assert fsdp.peak_bytes > zero3.peak_bytes


def test_unknown_strategy_and_world_size_are_usage_errors(debug_step):
    with pytest.raises(UsageError, match="valid: ddp, zero1, zero2, zero3, fsdp"):
        shard_memory(debug_step, "zero4", 2)
    with pytest.raises(UsageError, match="world size"):
        shard_memory(debug_step, "ddp", 0)
    with pytest.raises(UsageError, match="backend"):
        shard_memory(debug_step, "fsdp", 2, backend="mpi")


@pytest.mark.slow
def test_the_device_view_is_per_rank_under_sharding():
    """With --shard the allocated/reserved view and the out-of-memory check are rank 0's; the whole model's
    view is kept for reference but never checked against the device memory."""
    from tracer.passes.allocator import simulate_allocator

    analysis = tracer.analyze("llama-debug", batch=2, seq=64, shard="fsdp", world_size=4)
    result = analysis.policies["eager"]
    rank, whole = result.rank_device, result.device
    extras = sum(n for _, n in rank.extra)
    assert rank.peak_bytes == result.sharded.peak_bytes + extras
    assert rank.before_bytes == result.sharded.start_bytes + extras
    # the h100 (the default GPU): the total it reports, less the CUDA context and one NCCL communicator's buffers
    assert rank.capacity_bytes == (GPUS["h100"].memory_bytes - CUDA_CONTEXT_BYTES
                                   - GPUS["h100"].nccl_communicator_bytes) and whole.capacity_bytes is None
    replay = simulate_allocator(result.sharded.requests)          # the stream balances and its peak is the sweep's
    assert replay.requested_peak_bytes == result.sharded.peak_bytes
    assert rank.peak_bytes < whole.peak_bytes
    assert analysis.settings["shard"] == "fsdp" and analysis.settings["world_size"] == 4
    tight = tracer.analyze("llama-debug", batch=2, seq=64, shard="fsdp", world_size=4,
                           device_memory_bytes=rank.allocated_peak_bytes - 1).policies["eager"]
    assert tight.rank_device.oom is not None and tight.device.oom is None


def test_world_size_needs_a_shard_and_a_shard_needs_a_world_size():
    with pytest.raises(UsageError, match="--world-size needs --shard"):
        tracer.analyze("llama-debug", batch=1, seq=8, world_size=8)
    with pytest.raises(UsageError, match="needs --world-size"):
        tracer.analyze("llama-debug", batch=1, seq=8, shard="zero3")


@pytest.mark.slow
def test_compiled_fsdp_gathers_one_block_at_a_time():
    """The compiled forward ends with detaches of saved activations attributed to the blocks that made
    them; they do not keep every block gathered until the end of forward."""
    analysis = tracer.analyze("llama-debug", batch=2, seq=64, policies=("compiled",), shard="fsdp",
                              world_size=4, target="cpu")
    compiled = analysis.policies["compiled"].sharded
    blocks = [u for u in compiled.units if u.name]
    assert all(a.forward_ops[1] < b.forward_ops[0] for a, b in zip(blocks, blocks[1:]))
    root = compiled.units[0].padded_bytes
    assert compiled.by_category_at_peak["unsharded_parameter"] <= root + max(u.padded_bytes for u in blocks)


@pytest.mark.slow
def test_fsdp2_mixed_precision_keeps_fp32_shards_and_bf16_compute():
    """MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): the step computes as bf16-pure (gathered
    parameters and activations in bf16), while the sharded parameters, gradients and optimizer state are
    the fp32 ones an fp32 run shards, and the reduce-scatter input is fp32."""
    run = dict(batch=2, seq=64, shard="fsdp", world_size=4, target="cpu")
    mixed = tracer.analyze("llama-debug", fsdp_mixed_precision=True, **run).policies["eager"].sharded
    fp32 = tracer.analyze("llama-debug", **run).policies["eager"].sharded
    bf16 = tracer.analyze("llama-debug", precision="bf16-pure", **run).policies["eager"].sharded
    assert mixed.model_state_bytes == fp32.model_state_bytes
    assert mixed.model_state_bytes["parameter"] == 2 * bf16.model_state_bytes["parameter"]
    assert [u.padded_bytes for u in mixed.units] == [u.padded_bytes for u in bf16.units]          # gathered: bf16
    assert [u.padded_gradient_bytes for u in mixed.units] == [u.padded_gradient_bytes for u in fp32.units]
    assert bf16.peak_bytes < mixed.peak_bytes < fp32.peak_bytes
    with pytest.raises(UsageError, match="needs --shard fsdp"):
        tracer.analyze("llama-debug", fsdp_mixed_precision=True, batch=1, seq=8, shard="zero3", world_size=2)


@pytest.mark.slow
def test_fsdp_buffers_land_on_their_streams_and_reserve_their_own_segments():
    """FSDP2 allocates each all-gather output on the all-gather copy-in stream and each reduce-scatter output
    (the sharded gradients) on the reduce-scatter stream; what those streams free is not reused by the
    default stream's requests, so the reserved peak is at least the one-stream replay's."""
    from tracer.passes.allocator import simulate_allocator

    result = tracer.analyze("llama-debug", batch=2, seq=64, shard="fsdp", world_size=4).policies["eager"]
    requests = result.sharded.requests
    streams = {r[3] for r in requests if r[0] == "alloc" and len(r) == 4}
    assert streams == {1, 2}
    one_stream = simulate_allocator([r[:3] for r in requests])
    per_stream = simulate_allocator(requests)
    assert per_stream.requested_peak_bytes == one_stream.requested_peak_bytes == result.sharded.peak_bytes
    assert per_stream.reserved_peak_bytes > one_stream.reserved_peak_bytes
    assert result.rank_device.reserved_peak_bytes >= per_stream.reserved_peak_bytes
    zero3 = tracer.analyze("llama-debug", batch=2, seq=64, shard="zero3", world_size=4).policies["eager"]
    assert all(len(r) == 3 for r in zero3.sharded.requests)        # no FSDP2 buffers, one stream
