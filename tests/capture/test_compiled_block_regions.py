"""How tracer.capture.compiled_blocks cuts each repeated block out of the whole-model joint graph, as
`block.compile()` makes the block a joint graph of its own."""
import operator
import os

import pytest

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.compiled_blocks import _block_nodes, region_joint
from tracer.capture.joint import export_joint
from tracer.capture.policies import find_blocks
from tracer.errors import UsageError
from tracer.passes.analysis import analyze_graphs
from tracer.stepgraph import Phase

BLOCK_CALLED_TWICE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "block_called_twice.py")


@pytest.fixture(scope="module")
def llama_joint():
    cap = export_joint(load_model_source("llama-debug"), 2, 16, "fp32", direct=True)
    cap.exit_stack.close()         # the joint's fake mode stays active until then
    return cap.joint


def test_each_block_is_a_joint_of_its_own(llama_joint):
    """llama-debug's block reads its 9 parameters, its input x and RoPE's cos and sin (computed once, outside
    the blocks); it receives one gradient (of its output) and returns its output, the gradient of x and its 9
    parameters' gradients (cos and sin need none)."""
    blocks = find_blocks(llama_joint, None)
    assert blocks == ["blocks.0", "blocks.1"]
    for block, (forward, backward) in _block_nodes(llama_joint, blocks).items():
        cut = region_joint(llama_joint, forward, backward)
        params = [p for p in cut.primals if type(p.meta.get("desc")).__name__ == "ParamAOTInput"]
        assert len(params) == 9 and all(f"{block}." in p.meta["desc"].target for p in params)
        assert cut.static_inputs == tuple(cut.primals.index(p) for p in params)
        assert len(cut.primals) == 12 and len(cut.tangents) == 1 and len(cut.forward_outputs) == 1
        assert len(cut.backward_outputs) == 10
        assert [p.name for p in cut.gm.graph.find_nodes(op="placeholder")] == \
            [f"primals_{i}" for i in range(1, 13)] + ["tangents_1"]


def test_the_sums_of_gradients_run_where_autograd_sums_them(llama_joint):
    """A value used several times inside a block (x: the residual add and RMSNorm's pow and mul) has its
    gradients summed inside the block's compiled backward, so the block returns one gradient of x; sums of
    values used outside the blocks (the final norm's input, the tied embedding's weight) stay eager."""
    blocks = find_blocks(llama_joint, None)
    regions = _block_nodes(llama_joint, blocks)
    accumulations = [n for n in llama_joint.graph.nodes if n.meta.get("is_gradient_acc")]
    for _, backward in regions.values():
        inside = [n for n in backward if n.meta.get("is_gradient_acc")]
        assert inside and all(any(a in backward for a in n.all_input_nodes) for n in inside)
    every_block = {n for _, backward in regions.values() for n in backward}
    outside = [n for n in accumulations if n not in every_block]
    assert len(outside) == 2 and not any(a in every_block for n in outside for a in n.all_input_nodes)


@pytest.mark.slow
def test_identical_blocks_share_one_compiled_graph_and_keep_their_own_names():
    """Dynamo runs one compiled graph for both blocks; each block's ops still name its own module."""
    graphs = capture_steps(load_model_source("llama-debug"), CaptureOptions(batch=2, seq=16, target="cpu"),
                           (PolicySpec(name="compiled-blocks"),))
    graph = analyze_graphs(graphs).policies["compiled-blocks"].graph
    for phase in (Phase.FORWARD, Phase.BACKWARD):
        per_block = [[op.target for op in graph.ops if op.phase is phase and op.module.startswith(b + ".")]
                     for b in ("blocks.0", "blocks.1")]
        assert per_block[0] and per_block[0] == per_block[1]


def test_a_block_called_twice_per_step_is_refused():
    with pytest.raises(UsageError, match="blocks.0 does not run as one call"):
        capture_steps(load_model_source(BLOCK_CALLED_TWICE), CaptureOptions(batch=2, seq=8, target="cpu"),
                      (PolicySpec(name="compiled-blocks"),))
