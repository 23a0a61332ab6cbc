"""The one builder of hand-made StepGraphs for pass and report tests.

    b = GraphBuilder()
    w = b.storage((4, 4), StorageRole.PARAMETER, preexisting=True)   # a shape (float32) ...
    t = b.storage(64)                                                 # ... or a size in bytes (1-D float32)
    b.op("forward", [w], [t])                                         # a placeholder op (aten.test.default)
    b.aten("forward", "aten.mm.default", [x, w], [h], source=...)     # a real aten target (FLOP formulas apply)
    graph = b.build(model="two-block", parameter_count=32)
"""
import math

from tracer.stepgraph import OpNode, Phase, StepConfig, StepGraph, Storage, StorageRole, TensorValue


class GraphBuilder:
    def __init__(self):
        self.storages: list[Storage] = []
        self.ops: list[OpNode] = []

    def storage(self, size, role=StorageRole.INTERMEDIATE, **fields) -> TensorValue:
        """`size`: bytes (an int: a 1-D float32 tensor) or a shape (a tuple: float32 of that shape)."""
        shape = tuple(size) if isinstance(size, tuple) else (size // 4,)
        nbytes = 4 * math.prod(shape) if isinstance(size, tuple) else size
        sid = len(self.storages)
        self.storages.append(Storage(sid, nbytes, role, "float32", shape, **fields))
        return TensorValue(sid, shape, "float32")

    def op(self, phase, inputs=(), outputs=(), name=None, autograd_node=None, module="", source=None, *,
           target="aten.test.default", is_view=False) -> int:
        index = len(self.ops)
        default_name = f"op{index}" if target == "aten.test.default" else f"{target.split('.')[1]}_{index}"
        self.ops.append(OpNode(index=index, name=name or default_name, target=target,
                               phase=Phase(phase), args=tuple(inputs), kwargs=(), outputs=tuple(outputs),
                               source=source, module=module, autograd_node=autograd_node, is_view=is_view))
        return index

    def aten(self, phase, target, args, outputs, **fields) -> int:
        """An op with a real aten target, e.g. "aten.mm.default"."""
        return self.op(phase, args, outputs, target=target, **fields)

    def build(self, *, model="hand-built", batch=1, seq=1, optimizer="none", parameter_count=0) -> StepGraph:
        cfg = StepConfig(model=model, batch=batch, seq=seq, precision="fp32", optimizer=optimizer, step="steady",
                         zero_grad_set_to_none=True, capture_path="hand-built")
        return StepGraph(config=cfg, ops=tuple(self.ops), storages=tuple(self.storages),
                         parameter_count=parameter_count)
