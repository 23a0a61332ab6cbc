"""The optimizer step's kernels are the target's. For a CPU target, bitsandbytes' optimizers run their CPU
kernels (Python code registered through torch.library), which the recorder traces, so the fp32 copies of
each parameter's moments, gradient and value they make are in the prediction; torchao's optimizers compile
their per-parameter update, which Inductor plans (capture/compiled_calls.py). Ground truth is the CPU
allocator's own events of a real step (tests/truth.py `measure_step_at_allocator`): a dispatch-level
tracker sees neither inside a custom op's kernel nor inside compiled code."""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph
from truth import measure_step_at_allocator

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "library_optimizer_net.py")
LARGEST = 1_024_000             # elements of the largest parameter (big.weight)


def _model_file(tmp_path, optimizer: str) -> str:
    """The fixture training with `optimizer` ("module:Class"); skipped when the library is not installed."""
    pytest.importorskip(optimizer.partition(".")[0])
    with open(FIXTURE) as f:
        text = f.read().replace('OPTIMIZER = "bitsandbytes.optim:AdamW8bit"', f'OPTIMIZER = "{optimizer}"')
    path = tmp_path / f"net_{optimizer.rpartition(':')[2]}.py"
    path.write_text(text)
    return str(path)


def _predicted(path: str, target: str):
    return analyze_graph(capture_step(load_model_source(path), CaptureOptions(batch=2, seq=8, target=target))
                         ).policies["eager"]


def _assert_within_allocator(path: str, predicted) -> None:
    """Every phase's peak within 0.1% of the allocator's, and the peak in the same phase."""
    source = load_model_source(path)
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step_at_allocator(model, source.example_batch(2, 8), source.make_optimizer(model.parameters()))
    for phase, peak in measured.items():
        assert abs(predicted.phases[phase].peak_bytes - peak) <= peak * 0.001, (phase, predicted.phases[phase].peak_bytes, peak)
    assert predicted.peak_phase == max(measured, key=measured.get)


@pytest.mark.parametrize("optimizer", ["AdamW8bit", "PagedAdamW8bit", "AdamW", "Lion8bit"])
def test_bitsandbytes_cpu_kernels_are_exact_at_the_allocator(tmp_path, optimizer):
    path = _model_file(tmp_path, f"bitsandbytes.optim:{optimizer}")
    predicted = _predicted(path, "cpu")
    _assert_within_allocator(path, predicted)
    assert any("bitsandbytes.optimizer_update_" in note and "traced through their Python code" in note
               for note in predicted.graph.config.notes)


@pytest.mark.parametrize("optimizer", ["AdamW8bit", "AdamW4bit", "AdamWFp8", "_AdamW"])
def test_torchao_compiled_steps_are_exact_at_the_allocator(tmp_path, optimizer):
    """torchao compiles each parameter's update (fullgraph); its quantized moments are tensor subclasses
    whose codes and scales the optimizer's state reader and the compiled graph both see."""
    path = _model_file(tmp_path, f"torchao.optim:{optimizer}")
    predicted = _predicted(path, "cpu")
    _assert_within_allocator(path, predicted)
    assert any(note.startswith("compiled calls in the optimizer step planned by Inductor's C++ plan")
               and "single_param_adam" in note for note in predicted.graph.config.notes)


def test_the_cpu_kernels_hold_fp32_copies_the_cuda_kernel_does_not(tmp_path):
    """AdamW8bit's CPU kernel holds, for the largest parameter, its fp32 gradient, value and two moments
    (4 x 4 bytes an element) at once; the fused CUDA kernel holds none of them."""
    path = _model_file(tmp_path, "bitsandbytes.optim:AdamW8bit")
    cpu, cuda = _predicted(path, "cpu"), _predicted(path, "cuda")
    assert cpu.phases["optimizer"].peak_bytes - cuda.phases["optimizer"].peak_bytes >= 4 * 4 * LARGEST
    first = next(op.index for op in cuda.graph.ops if op.phase.value == "optimizer")
    assert cuda.phases["optimizer"].peak_bytes == cuda.liveness.live_after[first - 1]


KEYWORD_STEP = '''
import torch
from torch import nn


@torch.compile(fullgraph=True)
def scaled_update(*, grad, exp_avg_sq):
    exp_avg_sq.mul_(0.99).addcmul_(grad, grad, value=0.01)
    return grad / (exp_avg_sq.sqrt() + 1e-8)


class KeywordRMSprop(torch.optim.Optimizer):
    """Its compiled update takes every tensor by keyword, as heavyball's calls do."""

    def __init__(self, params, lr=1e-3):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                if not state:
                    state["exp_avg_sq"] = torch.zeros_like(p)
                p.add_(scaled_update(grad=p.grad, exp_avg_sq=state["exp_avg_sq"]), alpha=-group["lr"])


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(256, 512), nn.Linear(512, 8)

    def forward(self, x, y):
        return ((self.down(self.up(x)) - y) ** 2).mean()


def build_model():
    return Net()


def example_batch(batch, seq):
    return torch.randn(batch, 256), torch.randn(batch, 8)


def make_optimizer(params):
    return KeywordRMSprop(params)
'''


def test_a_compiled_call_with_tensors_by_keyword_is_planned_per_signature(tmp_path):
    """A compiled call whose tensors are all keyword arguments is one graph per shape: four parameters of
    four shapes are four plans, each with its own outputs (one plan for all returned the first one's)."""
    path = tmp_path / "keyword_step.py"
    path.write_text(KEYWORD_STEP)
    source = load_model_source(str(path))
    predicted = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=8, target="cpu"))).policies["eager"]
    note = next(n for n in predicted.graph.config.notes if n.startswith("compiled calls in the optimizer step"))
    assert "(4 distinct graph(s))" in note
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step_at_allocator(model, source.example_batch(2, 8), source.make_optimizer(model.parameters()))
    for phase, peak in measured.items():
        assert abs(predicted.phases[phase].peak_bytes - peak) <= peak * 0.001, (phase, predicted.phases[phase].peak_bytes, peak)
