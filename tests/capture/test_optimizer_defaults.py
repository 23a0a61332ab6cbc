"""An optimizer built without foreach= takes torch's own default for the target's device: foreach kernels
on a CUDA target, the per-parameter loop on a CPU target (torch.optim picks foreach only for parameters on
a foreach-capable device); --foreach / --no-foreach set it."""
import pytest

import tracer


def _foreach_ops(**options) -> int:
    graph = tracer.analyze("llama-debug", batch=1, seq=16, **options).policies["eager"].graph
    return sum(op.target.startswith("aten._foreach_") for op in graph.ops)


@pytest.mark.parametrize("target, foreach", [("cuda", True), ("cpu", False)])
def test_the_default_is_torchs_for_the_targets_device(target, foreach):
    assert (_foreach_ops(target=target) > 0) is foreach


def test_the_flag_overrides_the_default():
    assert _foreach_ops(target="cpu", foreach=True) > 0
    assert _foreach_ops(target="cuda", foreach=False) == 0
