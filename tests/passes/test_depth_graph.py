"""A deep step graph synthesized from the model cut to 4 blocks (tracer/passes/depth_graph.py) is the step
captured at that depth: the same ops in the same order with the same module paths, and the same analysis
(live bytes at every op, phase peaks, saved bytes, the bill and lines at the peak, the device view)."""
import collections
import dataclasses
import os

import pytest

from tracer.capture import capture_steps
from tracer.depth_capture import first_difference
from tracer.passes.depth import DepthError
from tracer.passes.depth_graph import synthesize_depth
from tracer.pipeline import analyze_captured, load_source, options_from_keywords
from tracer.depth_capture import cut_source

LLAMA6 = os.path.join(os.path.dirname(__file__), "..", "fixtures", "llama6_debug.py")


def _captured(depths, **keywords):
    """{depth: {policy label: StepGraph}} of the 6-block fixture cut to each depth, and the options."""
    options = options_from_keywords(**{"batch": 2, "seq": 16, **keywords})
    source = load_source(LLAMA6, options)
    specs = options.policy_specs(model_save_policy=source.save_policy)
    return {k: capture_steps(cut_source(source, k, {}), options.capture_options(), specs) for k in depths}, options


def _analysis(graph, options):
    return analyze_captured({"policy": graph}, options).policies["policy"]


def _structure(graph):
    return [(op.phase, op.target, op.module, op.recomputed, op.micro_batch,
             tuple(v.shape for v in op.outputs)) for op in graph.ops]


@pytest.fixture(scope="module")
def eager_policies():
    return _captured((4, 6), policies=("eager", "selective", "full"), target="cuda")


@pytest.mark.parametrize("policy", ["eager", "selective", "full"])
def test_six_blocks_synthesized_from_four_are_the_captured_six(eager_policies, policy):
    graphs, options = eager_policies
    synthesized = synthesize_depth(graphs[4][policy], 6)
    captured = graphs[6][policy]
    assert _structure(synthesized) == _structure(captured)
    assert collections.Counter(s.name for s in synthesized.storages) == collections.Counter(s.name for s in captured.storages)
    assert (synthesized.parameter_count, synthesized.loss_storage_id is not None) == (captured.parameter_count, True)
    a, b = _analysis(synthesized, options), _analysis(captured, options)
    assert a.liveness.live_during == b.liveness.live_during
    assert first_difference(a, b) is None
    assert a.device.reserved_peak_bytes == b.device.reserved_peak_bytes > 0


def test_the_graph_at_its_own_depth_is_returned_as_it_is(eager_policies):
    graphs, _ = eager_policies
    assert synthesize_depth(graphs[4]["eager"], 4) is graphs[4]["eager"]


@pytest.mark.slow
def test_compiled_buffers_reused_by_every_block_stay_shared():
    """Inductor's planned buffers serve every block (one storage touched by blocks 0 ... 3): the copies
    share them, and the compiled step synthesized at 6 blocks is the captured one."""
    graphs, options = _captured((4, 6), policies=("compiled",), target="cuda")
    synthesized = synthesize_depth(graphs[4]["compiled"], 6)
    assert first_difference(_analysis(synthesized, options), _analysis(graphs[6]["compiled"], options)) is None


@pytest.mark.slow
@pytest.mark.parametrize("keywords", [dict(accumulate=2), dict(foreach=False, optimizer="sgd-momentum"),
                                      dict(offload="optimizer+params"), dict(lora_rank=4)],
                         ids=["accumulate", "for-loop-sgd", "offload", "lora"])
def test_micro_batches_for_loop_optimizers_offload_and_lora_survive(keywords):
    graphs, options = _captured((4, 6), policies=("eager",), target="cpu", **keywords)
    synthesized = synthesize_depth(graphs[4]["eager"], 6)
    assert first_difference(_analysis(synthesized, options), _analysis(graphs[6]["eager"], options)) is None


@pytest.mark.slow
def test_blocks_that_differ_are_refused():
    """Every second block checkpointed: blocks 1 and 2 run different ops (the fast tier refuses hand-edited
    blocks: test_a_block_edited_to_differ_is_refused)."""
    graphs, _ = _captured((4,), policies=("full",), target="cpu", checkpoint_every=2)
    with pytest.raises(DepthError, match="not identical"):
        synthesize_depth(graphs[4]["full"], 8)


@pytest.mark.parametrize("edit", ["another op", "one op fewer"])
def test_a_block_edited_to_differ_is_refused(eager_policies, edit):
    """Block 2 of the captured 4-block step runs another op at one place, or one op fewer (moved out of
    the block): the two refusals of the block alignment."""
    graph = eager_policies[0][4]["eager"]
    op = next(op for op in graph.ops if op.module == "blocks.2.mlp.w1" and op.target == "aten.mm.default")
    changed = (dataclasses.replace(op, target="aten.addmm.default") if edit == "another op"
               else dataclasses.replace(op, module="tail"))
    edited = dataclasses.replace(graph, ops=graph.ops[:op.index] + (changed,) + graph.ops[op.index + 1:])
    with pytest.raises(DepthError, match="the blocks are not identical"):
        synthesize_depth(edited, 8)


def test_too_few_blocks_are_refused(eager_policies):
    graphs, _ = eager_policies
    three = synthesize_depth(graphs[4]["eager"], 4)
    with pytest.raises(DepthError, match="at least 4"):
        synthesize_depth(_cut_graph_to_three(three), 8)
    with pytest.raises(DepthError, match="cannot synthesize 3 blocks"):
        synthesize_depth(three, 3)


def _cut_graph_to_three(graph):
    """The graph with block 3's ops renamed outside the blocks: repeated_blocks then sees three."""
    ops = tuple(dataclasses.replace(op, module=op.module.replace("blocks.3", "tail")) for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)


def test_a_difference_is_named_by_its_op(eager_policies):
    graphs, options = eager_policies
    captured = graphs[6]["eager"]
    storages = list(captured.storages)
    op = next(op for op in captured.ops if op.module.startswith("blocks.4.mlp") and op.target == "aten.mm.default")
    sid = op.outputs[0].storage_id
    storages[sid] = dataclasses.replace(storages[sid], nbytes=storages[sid].nbytes + 512)
    tampered = dataclasses.replace(captured, storages=tuple(storages))
    difference = first_difference(_analysis(tampered, options), _analysis(captured, options))
    assert difference.startswith(f"live bytes during op {op.index} (aten.mm.default in blocks.4.mlp")
