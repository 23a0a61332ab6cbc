"""bitsandbytes' 8-bit AdamW for a CUDA target, simulated: its state bytes are the published layout's (uint8
moments, one fp32 absmax per 256 values, fp32 moments below 4,096 elements, two shared 256-value qmaps), and
a user's make_optimizer returning a bitsandbytes optimizer is recognised by its class and simulated. (For a
CPU target the classes run with their CPU kernels traced: tests/accuracy/test_optimizer_kernels.py.)"""
import math
import textwrap

import pytest

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.capture.bnb8bit import BnbLayout, state_bytes_per_parameter
from tracer.errors import UsageError
from tracer.passes.analysis import analyze_graph

LINEAR = '''
import torch
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.big = nn.Linear(1024, 1000)         # 1,024,000 weights: 8-bit; 1,000 biases: fp32 state
        self.head = nn.Linear(1000, 3, bias=False)    # 3,000 weights: below 4,096, fp32 state

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head(self.big(x)), y)


def build_model():
    return Net()


def example_batch(batch, seq):
    return torch.randn(batch, 1024), torch.zeros(batch, dtype=torch.long)
'''


def _published_state_bytes(numels) -> int:
    """bitsandbytes 0.50 Optimizer2State.init_state, counted by hand."""
    total = 2 * 256 * 4                                            # qmap1 + qmap2, once per optimizer
    for n in numels:
        total += 2 * n * 4 if n < 4096 else 2 * n + 2 * math.ceil(n / 256) * 4
    return total


def _state(model_file, optimizer="adamw"):
    options = CaptureOptions(batch=2, seq=8, optimizer=optimizer, target="cuda")
    result = analyze_graph(capture_step(load_model_source(str(model_file)), options)).policies["eager"]
    states = [s for s in result.graph.storages if s.role.value == "optimizer_state"]
    return result, states


def test_adamw8bit_state_is_about_2_03_bytes_per_parameter():
    assert state_bytes_per_parameter(1_024_000, BnbLayout(states=2, eight_bit=True, paged=False)) / 1_024_000 == 2.03125


@pytest.mark.parametrize("name", ["adamw8bit", "paged-adamw8bit"])
def test_state_bytes_equal_the_published_layout(tmp_path, name):
    path = tmp_path / "net.py"
    path.write_text(LINEAR)
    result, states = _state(path, name)
    assert sum(s.nbytes for s in states) == _published_state_bytes([1_024_000, 1000, 3000])
    assert {s.dtype for s in states if s.name.startswith("big.weight.state")} == {"uint8"}
    assert {s.dtype for s in states if s.name.startswith("head.weight.state")} == {"float32"}
    # every state tensor exists before a steady step, and the step allocates nothing
    assert all(s.preexisting for s in states)
    first = next(op.index for op in result.graph.ops if op.phase.value == "optimizer")
    assert result.phases["optimizer"].peak_bytes == result.liveness.live_after[first - 1]
    notes = " ".join(result.graph.config.notes)
    assert "dequantises in registers" in notes
    assert ("unified memory" in notes) == (name == "paged-adamw8bit")


def test_first_step_creates_the_8bit_state_in_the_step(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(LINEAR)
    options = CaptureOptions(batch=2, seq=8, optimizer="adamw8bit", step="first", target="cuda")
    result = analyze_graph(capture_step(load_model_source(str(path)), options)).policies["eager"]
    created = [s for s in result.graph.storages if s.role.value == "optimizer_state"]
    assert created and not any(s.preexisting for s in created)
    assert sum(s.nbytes for s in created) == _published_state_bytes([1_024_000, 1000, 3000])


BNB_STUB = '''

class AdamW8bit(torch.optim.Optimizer):
    """Stands for bitsandbytes.optim.AdamW8bit (not installed): its step would run CUDA kernels."""
    __module__ = "bitsandbytes.optim.adamw"

    def __init__(self, params, lr=1e-3):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        raise RuntimeError("bitsandbytes kernels need CUDA")


def make_optimizer(params):
    return {cls}(params)
'''


def test_a_users_bitsandbytes_optimizer_is_simulated(tmp_path):
    path = tmp_path / "net_bnb.py"
    path.write_text(LINEAR + BNB_STUB.format(cls="AdamW8bit"))
    result, states = _state(path)
    assert sum(s.nbytes for s in states) == _published_state_bytes([1_024_000, 1000, 3000])
    assert any("bitsandbytes.AdamW8bit" in note for note in result.graph.config.notes)


def test_a_32bit_bitsandbytes_optimizer_keeps_fp32_moments_and_says_so(tmp_path):
    """bitsandbytes' AdamW32bit (and AdamW with optim_bits=32) keeps two fp32 moments per parameter, no
    absmax, no qmaps; the report's note names that layout, not the 8-bit one."""
    path = tmp_path / "net_bnb32.py"
    path.write_text(LINEAR + BNB_STUB.replace("class AdamW8bit", "class AdamW32bit").format(cls="AdamW32bit"))
    result, states = _state(path)
    assert sum(s.nbytes for s in states) == 2 * 4 * (1_024_000 + 1000 + 3000)
    note = next(n for n in result.graph.config.notes if "bitsandbytes.AdamW32bit" in n)
    assert "fp32 moments" in note and "uint8" not in note


def test_an_unmodelled_bitsandbytes_optimizer_is_refused(tmp_path):
    path = tmp_path / "net_ademamix.py"
    stub = BNB_STUB.replace("class AdamW8bit", "class AdEMAMix8bit").format(cls="AdEMAMix8bit")
    path.write_text(LINEAR + stub)
    with pytest.raises(UsageError, match="AdEMAMix8bit"):
        _state(path)
