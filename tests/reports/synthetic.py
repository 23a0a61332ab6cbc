"""A hand-built two-block step (forward, backward, optimizer) for renderer goldens.

    x (input, 2x4) -> blocks.0: h0 = x @ w0 ; a0 = relu(h0) -> blocks.1: h1 = a0 @ w1 ; a1 = relu(h1)
    loss = a1.sum() ; backward through both blocks ; optimizer: m += g ; w += m (foreach)

Real aten targets and 2-D shapes, so FLOP formulas apply (one made-up op has none). Sources: model.py
lines 10 (matmul), 11 (relu), 20 (loss); train.py line 30 (optimizer). Every number in the goldens
follows from these sizes.
"""
from __future__ import annotations

import dataclasses

from graph_builder import GraphBuilder
from tracer.stepgraph import SourceLoc, StepGraph, StorageRole, TensorValue

MATMUL = SourceLoc("model.py", 10, "forward", "h = x @ self.w")
RELU = SourceLoc("model.py", 11, "forward", "return torch.relu(h)  # <keep> & \"quote\"")
LOSS = SourceLoc("model.py", 20, "forward", "loss = model(x).sum()")
STEP = SourceLoc("train.py", 30, "step", "optimizer.step()")


def two_block_step() -> StepGraph:
    b = GraphBuilder()
    w0 = b.storage((4, 4), StorageRole.PARAMETER, preexisting=True, persistent=True, name="blocks.0.lin.weight")
    w1 = b.storage((4, 4), StorageRole.PARAMETER, preexisting=True, persistent=True, name="blocks.1.lin.weight")
    x = b.storage((2, 4), StorageRole.INPUT, preexisting=True, name="input 0")
    m0, m1 = (b.storage((4, 4), StorageRole.OPTIMIZER_STATE, preexisting=True, persistent=True,
                        name=f"blocks.{k}.lin.weight.momentum_buffer") for k in (0, 1))
    h0, a0, h1, a1 = (b.storage((2, 4)) for _ in range(4))
    loss = b.storage((1,), persistent=True)
    # forward
    b.aten("forward", "aten.mm.default", [x, w0], [h0], module="blocks.0.lin", source=MATMUL)
    b.aten("forward", "aten.relu.default", [h0], [a0], module="blocks.0", source=RELU)
    b.aten("forward", "aten.view.default", [a0, (2, 4)], [a0], module="blocks.0", source=RELU, is_view=True)
    b.aten("forward", "aten.mm.default", [a0, w1], [h1], module="blocks.1.lin", source=MATMUL)
    b.aten("forward", "aten.relu.default", [h1], [a1], module="blocks.1", source=RELU)
    b.aten("forward", "aten.sum.default", [a1], [loss], source=LOSS)
    b.aten("forward", "aten.my_check.default", [loss], [], source=LOSS)      # no FLOP formula: flagged with *
    # backward (each op points at the forward line and module that caused it)
    seed, g_a1 = b.storage((1,)), b.storage((2, 4))
    gh1, gw1, ga0, gh0 = b.storage((2, 4)), b.storage((4, 4), StorageRole.GRADIENT, persistent=True), \
        b.storage((2, 4)), b.storage((2, 4))
    gw0 = b.storage((4, 4), StorageRole.GRADIENT, persistent=True)
    b.aten("backward", "aten.ones_like.default", [loss], [seed], name="loss_grad_seed")
    b.aten("backward", "aten.expand.default", [seed, (2, 4)], [g_a1], source=LOSS)
    b.aten("backward", "aten.threshold_backward.default", [g_a1, a1, 0], [gh1], module="blocks.1", source=RELU)
    b.aten("backward", "aten.mm.default", [TensorValue(a0.storage_id, (4, 2), "float32"), gh1], [gw1],
         module="blocks.1.lin", source=MATMUL)
    b.aten("backward", "aten.mm.default", [gh1, TensorValue(w1.storage_id, (4, 4), "float32")], [ga0],
         module="blocks.1.lin", source=MATMUL)
    b.aten("backward", "aten.threshold_backward.default", [ga0, a0, 0], [gh0], module="blocks.0", source=RELU)
    b.aten("backward", "aten.mm.default", [TensorValue(x.storage_id, (4, 2), "float32"), gh0], [gw0],
         module="blocks.0.lin", source=MATMUL)
    # optimizer
    b.aten("optimizer", "aten._foreach_add_.List", [(m0, m1), (gw0, gw1)], [m0, m1], source=STEP)
    b.aten("optimizer", "aten._foreach_add_.List", [(w0, w1), (m0, m1)], [w0, w1], source=STEP)
    return b.build(model="two-block", batch=2, optimizer="sgd", parameter_count=32)


def two_policies(analysis, second: str):
    """The analysis with its eager result also listed as policy `second` (for multi-policy layouts)."""
    eager = analysis.policies["eager"]
    return dataclasses.replace(analysis, policies={"eager": eager, second: dataclasses.replace(eager, policy=second)})


class WithRecompute:
    """A policy result that reports recompute FLOPs per line (whatever the PolicyAnalysis of the day has)."""

    def __init__(self, inner, by_line: dict[str, int] | None):
        self._inner = inner
        self._by_line = by_line

    def __getattr__(self, name):
        if name == "recompute_flops_by_line":
            if self._by_line is None:
                raise AttributeError(name)
            return self._by_line
        if name == "recompute_flops" and self._by_line is not None:
            return sum(self._by_line.values())
        if name == "recompute_flops":
            raise AttributeError(name)
        return getattr(self._inner, name)


def with_recompute(analysis, by_line: dict[str, int] | None, policy: str = "eager"):
    """`by_line=None`: a policy without the attribute (the column must be left out)."""
    return dataclasses.replace(analysis, policies={**analysis.policies,
                                                   policy: WithRecompute(analysis.policies[policy], by_line)})
