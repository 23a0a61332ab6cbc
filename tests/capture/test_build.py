"""The fake build (tracer/capture/build.py): the model tracer builds has the real build's metadata, values
the build determines are exact, values it cannot know are noted, and nothing real is allocated at model size."""
import os
import resource

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

from tracer.capture.build import build_fake
from tracer.capture.model_input import ModelSource, load_model_source

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
BUILD_FIXTURES = ["build_cs336_trunc_normal.py", "build_clones.py", "build_transformer_encoder.py",
                  "build_peft_lora.py", "handover_hf_dict_batch.py"]


def _metadata(model: nn.Module) -> dict:
    params = {name: (tuple(p.shape), p.stride(), p.dtype, p.requires_grad)
              for name, p in model.named_parameters(remove_duplicate=False)}
    buffers = {name: (tuple(b.shape), b.stride(), b.dtype) for name, b in model.named_buffers(remove_duplicate=False)}
    ids = [id(p) for _, p in model.named_parameters(remove_duplicate=False)]
    tying = [ids.index(i) for i in ids]              # which names share one tensor
    return {"params": params, "buffers": buffers, "tying": tying}


@pytest.mark.parametrize("fixture", BUILD_FIXTURES)
def test_fake_build_has_the_real_builds_metadata(fixture):
    if fixture == "build_peft_lora.py":
        pytest.importorskip("peft", reason="peft is not installed")
    if fixture.startswith("handover_hf"):
        pytest.importorskip("transformers", reason="the hf extra is not installed")
    source = load_model_source(os.path.join(FIXTURES, fixture))
    mode = FakeTensorMode()
    built = build_fake(source, 2, 8, "fp32", mode)
    assert all(isinstance(p, FakeTensor) and p.fake_mode is mode for p in built.model.parameters())
    assert _metadata(built.model) == _metadata(source.build_model())


def test_values_the_build_determines_are_exact():
    """timm's drop-path schedule reads linspace values with .item(): computed, not assumed (no note)."""
    source = load_model_source(os.path.join(FIXTURES, "build_clones.py"))
    built = build_fake(source, 2, 8, "fp32", FakeTensorMode())
    assert built.model.rates == [x.item() for x in torch.linspace(0, 0.0, 3)]
    assert built.notes == ()
    blocks = list(built.model.blocks)
    assert len({id(b.fc.weight) for b in blocks}) == 3               # deep copies, not one shared block


class _Reads(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.steps = int(torch.tensor([2, 3]).prod().item())              # known: 6
        self.picked = torch.nonzero(torch.rand(5) > 2).shape[0]           # random values: no element
        self.flag = bool(torch.randn(3).sum() > 0)                        # random values: False

    def forward(self, x):
        return self.lin(x).sum()


def test_value_reads_of_unknown_values_are_noted_with_their_line():
    source = ModelSource(name="reads", path=None, build_model=_Reads, example_batch=lambda b, s: torch.randn(b, 4))
    built = build_fake(source, 2, 8, "fp32", FakeTensorMode())
    assert (built.model.steps, built.model.picked, built.model.flag) == (6, 0, False)
    assert len(built.notes) == 2
    assert any("nonzero" in n and "test_build.py" in n and "no element" in n for n in built.notes)
    assert any("_local_scalar_dense" in n and "test_build.py" in n and "False" in n for n in built.notes)


class _Big(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16384, 16384, bias=False)                  # 1 GiB in fp32
        nn.init.trunc_normal_(self.lin.weight, std=0.02)
        self.twin = nn.ModuleList(nn.Linear(4096, 4096) for _ in range(2)).to(torch.bfloat16)


def test_nothing_real_is_allocated_at_model_size():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    source = ModelSource(name="big", path=None, build_model=_Big, example_batch=lambda b, s: torch.randn(b, 4))
    built = build_fake(source, 1, 1, "fp32", FakeTensorMode())
    assert built.model.twin[0].weight.dtype == torch.bfloat16
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 200_000      # KiB: far below 1 GiB


def test_a_tensor_made_from_a_list_of_computed_tensors_has_their_values(tmp_path):
    """torchtune's RoPE scaling loops over a small computed tensor and calls torch.tensor(new_freqs) on the
    0-dim tensors it made; the build knows their values, so the new tensor is made and its value is known
    (here it sizes a layer, so the parameter count shows it)."""
    import textwrap

    import tracer
    path = tmp_path / "scaled_rope.py"
    path.write_text(textwrap.dedent("""
        import math

        import torch
        from torch import nn


        class ScaledRope(nn.Module):
            def __init__(self, dim=16, base=500000.0, scale=8.0, low=1.0, high=4.0, old_len=8192):
                super().__init__()
                freqs = 1.0 / (base ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
                new_freqs = []
                for freq in freqs:
                    wavelen = 2 * math.pi / freq
                    if wavelen < old_len / high:
                        new_freqs.append(freq)
                    elif wavelen > old_len / low:
                        new_freqs.append(freq / scale)
                    else:
                        smooth = (old_len / wavelen - low) / (high - low)
                        new_freqs.append((1 - smooth) * freq / scale + smooth * freq)
                theta = torch.tensor(new_freqs, dtype=freqs.dtype, device=freqs.device)
                self.register_buffer("theta", theta, persistent=False)
                self.lin = nn.Linear(dim, 1 + int((theta > 0.01).sum()))        # sized by the values

            def forward(self, x):
                return self.lin(x).pow(2).mean()


        def build_model():
            return ScaledRope()


        def example_batch(batch, seq):
            return (torch.randn(batch, seq, 16),)
    """))
    namespace = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)
    real = namespace["build_model"]()
    assert real.lin.out_features == 4
    analysis = tracer.analyze(str(path), seq=8, target="cpu")
    assert analysis.graph.parameter_count == sum(p.numel() for p in real.parameters())
    assert not [n for n in analysis.graph.config.notes if "taken as" in n]
