"""Synthesis in units of several blocks (tracer/passes/depth_graph.py, `group`), on hand-built steps: compiled
code can hand a buffer from block to block, as Inductor gives a block's weight gradient the buffer a block
`reach` later used as a temporary in backward. One-block units cannot place such a buffer; units of `reach`
blocks can, and the deep step synthesized from them is the step built at that depth."""
import collections

import pytest

from graph_builder import GraphBuilder
from tracer.depth_capture import cut_depths, first_difference
from tracer.passes.analysis import analyze_graph
from tracer.passes.depth import DepthError
from tracer.passes.depth_graph import block_reach, synthesize_depth
from tracer.stepgraph import SourceLoc, StorageRole

LINEAR = SourceLoc("model.py", 10, "forward", "h = self.lin(x)")
LOSS = SourceLoc("model.py", 20, "forward", "loss = model(x).sum()")
STEP = SourceLoc("train.py", 30, "step", "optimizer.step()")
WIDTH = 64                     # bytes of an activation; a weight, its gradient and its momentum are 4 x that


def handed_on_step(depth: int, reach: int):
    """x -> depth x lin -> loss; backward in reverse, where block j first writes a temporary into the buffer
    that becomes block j - reach's weight gradient (a fresh one when there is no such block), then block
    j's gradient is written into its own buffer; a foreach SGD step with momentum."""
    b = GraphBuilder()
    x = b.storage(WIDTH, StorageRole.INPUT, preexisting=True, name="input 0")
    weights = [b.storage(4 * WIDTH, StorageRole.PARAMETER, preexisting=True, persistent=True,
                         name=f"blocks.{i}.lin.weight") for i in range(depth)]
    momenta = [b.storage(4 * WIDTH, StorageRole.OPTIMIZER_STATE, preexisting=True, persistent=True,
                         name=f"blocks.{i}.lin.weight.momentum_buffer") for i in range(depth)]
    h, inputs = x, []
    for i in range(depth):
        out = b.storage(WIDTH)
        b.op("forward", [h, weights[i]], [out], module=f"blocks.{i}.lin", source=LINEAR)
        inputs.append(h)
        h = out
    loss = b.storage(4, persistent=True)
    b.op("forward", [h], [loss], source=LOSS)
    grad = b.storage(WIDTH)
    b.op("backward", [loss], [grad], source=LOSS)
    grads: dict[int, object] = {}
    for j in reversed(range(depth)):
        if j not in grads:
            grads[j] = b.storage(4 * WIDTH, StorageRole.GRADIENT, persistent=True, name=f"blocks.{j}.lin.weight.grad")
        handed = j - reach
        if handed >= 0:
            grads[handed] = b.storage(4 * WIDTH, StorageRole.GRADIENT, persistent=True,
                                      name=f"blocks.{handed}.lin.weight.grad")
            scratch = grads[handed]
        else:
            scratch = b.storage(4 * WIDTH)
        b.op("backward", [grad, inputs[j]], [scratch], module=f"blocks.{j}.lin", source=LINEAR)
        b.op("backward", [scratch, inputs[j]], [grads[j]], module=f"blocks.{j}.lin", source=LINEAR)
        grad_input = b.storage(WIDTH)
        b.op("backward", [grad, weights[j]], [grad_input], module=f"blocks.{j}.lin", source=LINEAR)
        grad = grad_input
    ordered = tuple(grads[i] for i in range(depth))
    b.op("optimizer", [tuple(momenta), ordered], momenta, source=STEP)
    b.op("optimizer", [tuple(weights), tuple(momenta)], weights, source=STEP)
    return b.build(model=f"handed-{depth}", optimizer="sgd", parameter_count=depth * WIDTH)


def _eager(graph):
    return analyze_graph(graph).policies["eager"]


def _structure(graph):
    return [(op.phase, op.target, op.module, tuple(v.shape for v in op.outputs)) for op in graph.ops]


def test_the_reach_is_how_many_blocks_a_buffer_is_handed_across():
    assert block_reach(handed_on_step(12, reach=3)) == 3
    assert block_reach(handed_on_step(12, reach=1)) == 1


def test_one_block_units_miss_a_buffer_handed_three_blocks_on():
    """With 4 blocks, only blocks 3 and 0 hand a buffer on (a pool to one-block units), so the 6-block
    synthesis lacks the copies' handed buffers: the depth capture's check against a 6-block capture refuses
    it, and the 6-block capture's reach says which units to cut in again."""
    synthesized = synthesize_depth(handed_on_step(4, reach=3), 6)
    assert first_difference(_eager(synthesized), _eager(handed_on_step(6, reach=3))) is not None
    assert block_reach(handed_on_step(6, reach=3)) == 3


@pytest.mark.parametrize("depth", [18, 30, 31, 80], ids=lambda d: f"{d}-blocks")
def test_units_of_the_reach_synthesize_the_step_built_at_that_depth(depth):
    base_depth, check_depth = cut_depths(depth, 3)
    synthesized = synthesize_depth(handed_on_step(base_depth, reach=3), depth, group=3)
    built = handed_on_step(depth, reach=3)
    assert _structure(synthesized) == _structure(built)
    assert collections.Counter(s.name for s in synthesized.storages) == collections.Counter(s.name for s in built.storages)
    assert synthesized.parameter_count == built.parameter_count
    assert first_difference(_eager(synthesized), _eager(built)) is None
    assert _eager(built).peak_bytes > _eager(handed_on_step(base_depth, reach=3)).peak_bytes


def test_the_cut_depths_leave_the_units_whole_and_reach_the_depth():
    assert cut_depths(80) == (4, 6)
    assert cut_depths(80, 3) == (14, 20)           # 4 units of 3 and 2 blocks left over in the last unit
    assert cut_depths(126, 3) == (12, 18)
    for depth in (40, 41, 42, 80, 126):
        base, check = cut_depths(depth, 3)
        assert (depth - base) % 3 == 0 and (check - base) == 6


def test_a_depth_the_units_do_not_reach_is_refused():
    with pytest.raises(DepthError, match="in units of 3"):
        synthesize_depth(handed_on_step(12, reach=3), 17, group=3)
