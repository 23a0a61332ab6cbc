"""An optimizer wrapper that moves the step to the host is the offload lever as people write it: torchao's
CPUOffloadOptimizer, returned by make_optimizer, is predicted for a CUDA target as its base optimizer with
`--offload optimizer` (state, a host copy and a pinned gradient buffer on the host for each parameter of at
least `minimal_size` elements; the smaller ones' optimizer on the device), and `offload_gradients` decides
whether each device gradient is freed once copied. For a CPU target the real class needs a GPU and the
capture refuses it with a hint (tests/capture/test_optimizer_errors.py)."""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "library_optimizer_net.py")       # big: Linear(1024, 1000), head: 3,000 weights


def _analysis(tmp_path, body: str, **options):
    path = tmp_path / "net.py"
    with open(FIXTURE) as f:
        path.write_text(f.read() + f"\n\ndef make_optimizer(params):\n    {body}\n")
    graph = capture_step(load_model_source(str(path)), CaptureOptions(batch=2, seq=8, target="cuda:h100", **options))
    return analyze_graph(graph).policies["eager"]


def _host_bytes(policy) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in policy.graph.storages:
        if s.host:
            out[s.role.value] = out.get(s.role.value, 0) + s.nbytes
    return out


def test_cpu_offload_optimizer_is_its_base_optimizer_offloaded(tmp_path):
    pytest.importorskip("torchao")
    wrapped = _analysis(tmp_path, "from torchao.optim import CPUOffloadOptimizer\n"
                                  "    return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True,\n"
                                  "                               minimal_size=0, fused=True)")
    lever = _analysis(tmp_path, "return torch.optim.AdamW(params, fused=True)", offload="optimizer")
    assert {p: v.peak_bytes for p, v in wrapped.phases.items()} == {p: v.peak_bytes for p, v in lever.phases.items()}
    assert _host_bytes(wrapped) == _host_bytes(lever)
    assert any("CPUOffloadOptimizer: modelled as --offload optimizer: 3 parameter(s)" in n
               for n in wrapped.graph.config.notes)


def test_small_parameters_keep_their_optimizer_on_the_device(tmp_path):
    """minimal_size=4096 (the default): the head's 3,000 weights and the large layer's 1,000 biases are
    stepped by an AdamW on the device, whose two fp32 moments stay there; the large weight's go to the host."""
    pytest.importorskip("torchao")
    policy = _analysis(tmp_path, "from torchao.optim import CPUOffloadOptimizer\n"
                                 "    return CPUOffloadOptimizer(params, offload_gradients=True)")
    device_state = sum(s.nbytes for s in policy.graph.storages if s.role.value == "optimizer_state" and not s.host)
    host_state = _host_bytes(policy)["optimizer_state"]
    assert 2 * 4000 * 4 <= device_state < 2 * 4000 * 4 + 64            # exp_avg, exp_avg_sq (+ the step counts)
    assert 2 * 1024 * 1000 * 4 <= host_state < 2 * 1024 * 1000 * 4 + 64


def test_offload_gradients_false_keeps_device_gradients_until_zero_grad(tmp_path):
    pytest.importorskip("torchao")
    body = ("from torchao.optim import CPUOffloadOptimizer\n"
            "    return CPUOffloadOptimizer(params, offload_gradients={})")
    kept, freed = (_analysis(tmp_path, body.format(flag)) for flag in (False, True))
    big_weight_grad = 1024 * 1000 * 4
    assert kept.phases["optimizer"].peak_bytes - freed.phases["optimizer"].peak_bytes >= big_weight_grad
    assert any("device gradients kept until zero_grad" in n for n in kept.graph.config.notes)


def test_the_wrapper_class_is_left_as_found(tmp_path):
    torchao_optim = pytest.importorskip("torchao.optim")
    _analysis(tmp_path, "from torchao.optim import CPUOffloadOptimizer\n    return CPUOffloadOptimizer(params)")
    assert vars(torchao_optim.CPUOffloadOptimizer)["__init__"].__module__ == "torchao.optim.cpu_offload"
    with pytest.raises(AssertionError, match="CUDA"):      # its own __init__ runs again: no GPU here
        torchao_optim.CPUOffloadOptimizer([torch.nn.Parameter(torch.zeros(8))])


def test_a_step_that_uses_no_wrapper_imports_none_of_their_libraries():
    """The registry is consulted only for modules the model file imported: the default optimizer's step
    does not pay for importing torchao (about a second)."""
    import subprocess
    import sys
    code = ("import sys, tracer\n"
            "tracer.analyze('llama-88m-debug', batch=1, seq=16, target='cuda')\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchao'))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]"
