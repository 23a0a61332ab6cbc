"""A tiny builder of hand-made StepGraphs for pass tests."""
from tracer.stepgraph import OpNode, Phase, StepConfig, StepGraph, Storage, StorageRole, TensorValue


class GraphBuilder:
    def __init__(self):
        self.storages: list[Storage] = []
        self.ops: list[OpNode] = []

    def storage(self, nbytes, role=StorageRole.INTERMEDIATE, **fields) -> TensorValue:
        sid = len(self.storages)
        self.storages.append(Storage(sid, nbytes, role, "float32", (nbytes // 4,), **fields))
        return TensorValue(sid, (nbytes // 4,), "float32")

    def op(self, phase, inputs=(), outputs=(), name=None, autograd_node=None, module="", source=None):
        index = len(self.ops)
        self.ops.append(OpNode(index=index, name=name or f"op{index}", target="aten.test.default",
                               phase=Phase(phase), args=tuple(inputs), kwargs=(), outputs=tuple(outputs),
                               source=source, module=module, autograd_node=autograd_node))
        return index

    def build(self) -> StepGraph:
        cfg = StepConfig(model="hand-built", batch=1, seq=1, precision="fp32", optimizer="none", step="steady",
                         zero_grad_set_to_none=True, capture_path="hand-built")
        return StepGraph(config=cfg, ops=tuple(self.ops), storages=tuple(self.storages), parameter_count=0)
