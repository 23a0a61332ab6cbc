"""An optimizer that cannot be built or stepped in the capture is refused with one line naming the error,
and a hint that fits it: code that needs a GPU (torchao's CPUOffloadOptimizer asserts CUDA or XPU) is told
that the capture runs on the CPU and which option models it; any other error is the model file's to fix."""
import textwrap

import pytest

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.errors import ModelRunError

MODEL = textwrap.dedent('''
    import torch
    from torch import nn

    def build_model():
        return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16))

    def example_batch(batch, seq):
        return torch.randn(batch, 16), torch.randn(batch, 16)

    def loss_fn(out, y):
        return ((out - y) ** 2).mean()

    def make_optimizer(params):
        {body}
''')


def _refusal(tmp_path, body: str) -> ModelRunError:
    path = tmp_path / "net.py"
    path.write_text(MODEL.format(body=body))
    with pytest.raises(ModelRunError) as info:
        capture_steps(load_model_source(str(path)), CaptureOptions(batch=2, seq=8), (PolicySpec(name="eager"),))
    return info.value


def test_a_cuda_only_optimizer_is_told_the_capture_runs_on_the_cpu(tmp_path):
    pytest.importorskip("torchao")
    error = _refusal(tmp_path, "from torchao.optim import CPUOffloadOptimizer\n"
                               "    return CPUOffloadOptimizer(params, torch.optim.AdamW, offload_gradients=True)")
    assert "CUDA" in str(error) and "--offload optimizer" in error.hint and "runs on the CPU" in error.hint


def test_any_other_failure_is_the_model_files_to_fix(tmp_path):
    error = _refusal(tmp_path, "raise ValueError('no learning rate given')")
    assert "no learning rate given" in str(error) and "fix what the error names" in error.hint


def test_a_second_order_step_without_create_graph_is_told_to_declare_it(tmp_path):
    """A step that differentiates the gradients (SophiaH, AdaHessian) needs the loop's
    loss.backward(create_graph=True); without the declaration the gradients have no graph."""
    error = _refusal(tmp_path, "class Hutchinson(torch.optim.SGD):\n"
                               "        def step(self):\n"
                               "            ps = [p for g in self.param_groups for p in g['params']]\n"
                               "            torch.autograd.grad([p.grad for p in ps], ps, [torch.ones_like(p) for p in ps])\n"
                               "            return super().step()\n"
                               "    return Hutchinson(params, lr=0.1)")
    assert "differentiates the gradients" in str(error) and "create_graph = True" in error.hint
