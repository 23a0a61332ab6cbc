"""An optimizer built without foreach=/fused= is traced as the target device runs it: for-loop kernels on
CPU, foreach kernels on CUDA (torch.optim's `_default_to_fused_or_foreach`)."""
import pytest
import os

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.stepgraph import Phase

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "default_adam.py")


def _optimizer_targets(target: str) -> set[str]:
    graph = capture_step(load_model_source(FIXTURE), CaptureOptions(batch=1, seq=16, target=target))
    return {op.target for op in graph.ops if op.phase is Phase.OPTIMIZER}


@pytest.mark.slow
def test_default_adam_runs_for_loop_kernels_on_cpu_and_foreach_kernels_on_cuda():
    cpu, cuda = _optimizer_targets("cpu"), _optimizer_targets("cuda:h100")
    assert not any(t.startswith("aten._foreach_") for t in cpu)
    assert "aten._foreach_sqrt.default" in cuda and "aten._foreach_mul_.Scalar" in cuda


@pytest.mark.slow
def test_the_cuda_default_leaves_torch_optim_as_it_was():
    import torch
    import torch.optim.optimizer as optimizer_module

    _optimizer_targets("cuda:h100")
    assert "cpu" not in optimizer_module._get_foreach_kernels_supported_devices()
    assert torch._subclasses.fake_tensor.FakeTensor not in optimizer_module._foreach_supported_types
