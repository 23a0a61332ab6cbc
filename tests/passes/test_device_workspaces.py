"""The cuBLAS/cuBLASLt workspaces are allocated by the first cuBLAS call: a CUDA step that runs a matmul
holds them (before a warm step), a step without one never allocates them."""
import os

import pytest

import tracer
from tracer.passes.device import runs_cublas

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def test_a_step_without_a_matmul_holds_no_cublas_workspace():
    result = tracer.analyze(os.path.join(FIXTURES, "elementwise_only.py"), batch=2, seq=16).policies["eager"]
    assert not runs_cublas(result.graph)
    assert result.device.extra == ()
    assert result.device.peak_bytes == result.peak_bytes


@pytest.mark.slow
def test_a_step_with_a_matmul_holds_both_workspaces_from_before_the_step():
    result = tracer.analyze("llama-debug", batch=1, seq=8, gpu="a100").policies["eager"]
    assert runs_cublas(result.graph)
    assert [n for _, n in result.device.extra] == [8_519_680, 8_519_680]        # PyTorch's default below sm90
    assert result.device.before_bytes == result.start_bytes + 2 * 8_519_680
