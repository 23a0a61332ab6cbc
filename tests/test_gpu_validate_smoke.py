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
    rows = [line for line in out.splitlines() if line.startswith("llama-debug b2 s32 ")]
    assert len(rows) == 7                               # {fp32, bf16} x {eager, eager +ckpt, compiled}, fp16 eager
    assert all(" +0.00% " in row for row in rows)
    assert "0 of 7 configs beyond 2% at the peak" in out
    assert len(list(tmp_path.glob("*.json"))) == 7 and len(list(tmp_path.glob("*.pickle"))) == 7


def test_matrix_and_block_wrapping(gpu_validate):
    configs = gpu_validate.matrix(["llama-debug"], 2, 32)
    assert {(c.precision, c.mode, c.checkpoint) for c in configs} == {
        (p, m, k) for p in ("fp32", "bf16") for m, k in (("eager", False), ("eager", True), ("compiled", False))
    } | {("fp16", "eager", False)}
    assert {c.policy for c in configs} == {"eager", "full", "compiled"}
    step, model = gpu_validate.build_real_step(configs[1], "cpu")
    assert sum(isinstance(m, gpu_validate.Checkpointed) for m in model.modules()) == 2
    step()                                              # the checkpointed real step runs
