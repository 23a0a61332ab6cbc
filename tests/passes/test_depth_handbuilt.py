"""Depth extrapolation on hand-built steps (no capture): a stack of k identical blocks analysed at 3, 4
and 5 blocks and extrapolated to 9 gives exactly the numbers of the 9-block step analysed in full; a stack
whose blocks differ is refused naming what broke. (tests/passes/test_depth.py checks it on captured models.)"""
import pytest

from graph_builder import GraphBuilder
from tracer.passes.analysis import analyze_graph
from tracer.passes.depth import DepthError, extrapolate_depth
from tracer.stepgraph import SourceLoc, StorageRole

LINEAR = SourceLoc("model.py", 10, "forward", "h = self.lin(x)")
ACT = SourceLoc("model.py", 11, "forward", "return torch.relu(h)")
LOSS = SourceLoc("model.py", 20, "forward", "loss = model(x).sum()")
STEP = SourceLoc("train.py", 30, "step", "optimizer.step()")
ACTIVATION_BYTES = 64


def stack_step(depth: int, *, odd_block: int | None = None):
    """x -> depth x (t = lin(h); h = act(t)) -> loss, backward in reverse, a foreach optimizer step.
    Each block: a 256 B weight and momentum, a 128 B temporary, a 64 B saved output. `odd_block` gets
    one more temporary (its blocks are then not identical)."""
    b, width = GraphBuilder(), ACTIVATION_BYTES
    x = b.storage(width, StorageRole.INPUT, preexisting=True, name="input 0")
    weights = [b.storage(4 * width, StorageRole.PARAMETER, preexisting=True, persistent=True,
                         name=f"blocks.{i}.lin.weight") for i in range(depth)]
    momenta = [b.storage(4 * width, StorageRole.OPTIMIZER_STATE, preexisting=True, persistent=True,
                         name=f"blocks.{i}.lin.weight.momentum_buffer") for i in range(depth)]
    h, block_io = x, []
    for i in range(depth):
        t, out = b.storage(2 * width), b.storage(width)
        b.op("forward", [h, weights[i]], [t], module=f"blocks.{i}.lin", source=LINEAR)
        if i == odd_block:
            b.op("forward", [t], [b.storage(3 * width)], module=f"blocks.{i}", source=ACT)
        b.op("forward", [t], [out], module=f"blocks.{i}", source=ACT)
        block_io.append((h, out))
        h = out
    loss = b.storage(4, persistent=True)
    b.op("forward", [h], [loss], source=LOSS)
    grad = b.storage(width)
    b.op("backward", [loss], [grad], source=LOSS)
    grads = [None] * depth
    for i in reversed(range(depth)):
        block_input, block_output = block_io[i]
        grads[i] = b.storage(4 * width, StorageRole.GRADIENT, persistent=True, name=f"blocks.{i}.lin.weight.grad")
        b.op("backward", [block_input, grad], [grads[i]], module=f"blocks.{i}.lin", source=LINEAR)
        grad_input = b.storage(width)
        b.op("backward", [grad, block_output], [grad_input], module=f"blocks.{i}", source=ACT)
        grad = grad_input
    b.op("optimizer", [tuple(momenta), tuple(grads)], momenta, source=STEP)
    b.op("optimizer", [tuple(weights), tuple(momenta)], weights, source=STEP)
    return b.build(model=f"stack-{depth}", optimizer="sgd", parameter_count=depth * width)


def _eager(graph):
    return analyze_graph(graph).policies["eager"]


def test_the_extrapolated_step_is_the_full_step():
    estimate = extrapolate_depth({k: _eager(stack_step(k)) for k in (3, 4, 5)}, 9)
    full = _eager(stack_step(9))
    assert full.peak_bytes > _eager(stack_step(5)).peak_bytes           # not the largest sample's peak
    assert estimate.peak_bytes == full.peak_bytes
    assert estimate.peak_phase == full.peak_phase
    assert estimate.phases == {name: p.peak_bytes for name, p in full.phases.items()}
    assert (estimate.start_bytes, estimate.end_bytes) == (full.start_bytes, full.end_bytes)
    assert (estimate.saved_bytes, estimate.saved_activation_bytes) == (full.saved.total_bytes,
                                                                      full.saved.activation_bytes)
    assert estimate.by_category_at_peak == dict(full.at_peak.by_category)
    assert estimate.parameter_count == 9 * ACTIVATION_BYTES


def test_the_numbers_grow_with_the_depth_as_the_structure_says():
    """Per block: a weight, a momentum and a gradient (3 x 256 B) and a saved output (64 B)."""
    shallow, deep = _eager(stack_step(5)), _eager(stack_step(6))
    assert deep.start_bytes - shallow.start_bytes == 2 * 4 * ACTIVATION_BYTES       # weight + momentum
    assert deep.saved.activation_bytes - shallow.saved.activation_bytes == ACTIVATION_BYTES


def test_blocks_that_differ_are_refused():
    samples = {k: _eager(stack_step(k, odd_block=1)) for k in (3, 4, 5)}
    with pytest.raises(DepthError, match=r"middle block\) runs in blocks \[1\] of the 4-block sample, not \[1, 2\]"):
        extrapolate_depth(samples, 9)


def test_too_few_or_too_shallow_samples_are_refused():
    samples = {k: _eager(stack_step(k)) for k in (2, 3, 4)}
    with pytest.raises(DepthError, match="three sample depths of at least 3 blocks"):
        extrapolate_depth(samples, 9)
    with pytest.raises(DepthError, match="analyse it in full"):
        extrapolate_depth({k: _eager(stack_step(k)) for k in (3, 4, 5)}, 2)
