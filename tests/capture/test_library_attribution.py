"""Memory made inside a tensor utility library (einops, opt_einsum, a library's helper functions) belongs
to the model's line that called it; a library's own module code (transformers' modeling files, timm's
layers) keeps its lines; torch.optim keeps the optimizer step's lines."""
import textwrap

import pytest

import tracer
from tracer.capture.source import model_code_frames

SITE = "/venv/lib/python3.11/site-packages"


def test_a_library_helper_goes_to_the_model_line_that_called_it():
    frames = [("/home/me/model.py", "forward"), (f"{SITE}/einops/einops.py", "rearrange"),
              (f"{SITE}/einops/_backends.py", "reshape")]
    assert model_code_frames(frames) == [0]


def test_a_libraries_module_code_keeps_its_lines_and_its_helpers_go_to_them():
    frames = [(f"{SITE}/transformers/models/llama/modeling_llama.py", "forward"),
              (f"{SITE}/transformers/models/llama/modeling_llama.py", "forward"),
              (f"{SITE}/transformers/integrations/sdpa_attention.py", "sdpa_attention_forward")]
    assert model_code_frames(frames) == [0, 1]


def test_a_stack_of_library_code_alone_falls_back_to_its_innermost_frame():
    frames = [(f"{SITE}/somelib/train.py", "step"), (f"{SITE}/somelib/ops.py", "fused_thing")]
    assert model_code_frames(frames) == [0, 1]


def test_the_optimizer_steps_own_lines_stay_in_torch_optim():
    import os

    import torch
    adamw = os.path.join(os.path.dirname(torch.__file__), "optim", "adamw.py")
    assert model_code_frames([("/home/me/model.py", "train_step"), (adamw, "_multi_tensor_adamw")]) == [0, 1]


def test_a_copy_einops_makes_is_billed_to_the_rearrange_line(tmp_path):
    pytest.importorskip("einops")
    path = tmp_path / "einops_model.py"
    path.write_text(textwrap.dedent("""
        import torch
        from einops import rearrange
        from torch import nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(64, 64)

            def forward(self, x):
                h = rearrange(self.lin(x), "b s (h d) -> b h s d", h=4)
                y = rearrange(h.softmax(-1), "b h s d -> b s (h d)")      # a copy: the heads interleave
                return (y * y).sum()


        def build_model():
            return Net()


        def example_batch(batch, seq):
            return (torch.randn(batch, seq, 64),)
    """))
    lines = tracer.analyze(str(path), seq=64, target="cpu").policies["eager"].at_peak.lines
    by_line = {row.source.line: row for row in lines if row.source is not None}
    assert {row.source.file for row in lines if row.source is not None} == {str(path)}
    # softmax's output and the copy of y, each (2, 64, 64) fp32 and saved for backward
    assert by_line[14].saved_bytes == by_line[14].bytes_at_peak == 2 * (2 * 64 * 64 * 4)
