"""benchmarks/gpu_validate.py --smoke: the GPU validation script's prediction and report side, on CPU."""
from __future__ import annotations

import importlib.util
import os
import sys

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "gpu_validate.py")


@pytest.fixture(scope="module")
def gpu_validate():
    spec = importlib.util.spec_from_file_location("gpu_validate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module                     # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_smoke_mode_runs_every_row_with_zero_error(gpu_validate, capsys, tmp_path):
    assert gpu_validate.main(["--smoke", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith(("llama-debug b2 s32 ", "resnet50 b2 s32 "))]
    # {fp32, bf16} x {eager, compiled, blocks} x {plain, +ckpt}, fp16 eager {plain, +ckpt}; ResNet-50 {fp32, bf16}
    assert len(rows) == 16
    assert all(" +0.00% " in row for row in rows)
    assert "0 of 16 configs beyond 2% at the peak" in out
    assert len(list(tmp_path.glob("*.json"))) == 16 and len(list(tmp_path.glob("*.pickle"))) == 16


def test_matrix_and_block_wrapping(gpu_validate):
    configs = gpu_validate.matrix(["llama-debug"], 2, 32, ["examples/vgg16.py"], 32)
    assert {(c.precision, c.mode, c.checkpoint) for c in configs if c.model == "llama-debug"} == {
        (p, m, k) for p in ("fp32", "bf16") for m in ("eager", "compiled", "blocks") for k in (False, True)
    } | {("fp16", "eager", False), ("fp16", "eager", True)}
    assert {(c.precision, c.mode, c.checkpoint, c.seq) for c in configs if c.model != "llama-debug"} == {
        ("fp32", "eager", False, 32), ("bf16", "eager", False, 32)}
    assert {c.policy for c in configs} == {"eager", "full", "compiled", "compiled+full", "compiled-blocks",
                                           "compiled-blocks+full"}
    eager_ckpt = next(c for c in configs if (c.mode, c.checkpoint) == ("eager", True))
    step, model = gpu_validate.build_real_step(eager_ckpt, "cpu")
    assert sum(isinstance(m, gpu_validate.Checkpointed) for m in model.modules()) == 2
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    blocks_ckpt = next(c for c in configs if (c.mode, c.checkpoint) == ("blocks", True))
    step, model = gpu_validate.build_real_step(blocks_ckpt, "cpu")      # compiles lazily: nothing runs here
    wrapped = [m for m in model.modules() if isinstance(m, CheckpointWrapper)]
    assert len(wrapped) == 2 and all(m._compiled_call_impl is not None for m in wrapped)
    step()                                              # the checkpointed real step runs
