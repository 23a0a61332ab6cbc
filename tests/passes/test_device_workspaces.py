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


CONV = os.path.join(FIXTURES, "conv_channels_last_input.py")


def test_convolution_workspaces_are_noted_when_their_size_is_not_known():
    """Each cuDNN convolution call (one forward, one convolution_backward here) allocates a workspace whose
    size cuDNN picks at run time: without a cap nothing is counted, and the view says so."""
    from tracer.reports.compare_text import render_device_memory
    from tracer.reports.json_report import device_json

    result = tracer.analyze(CONV, batch=2, seq=16).policies["eager"]
    assert result.device.conv_calls == 2 and result.device.conv_workspace_cap_bytes is None
    assert result.device.peak_bytes == result.peak_bytes + result.device.extra_bytes
    assert "2 cuDNN convolution calls" in render_device_memory(result.device) and "lower bounds" in \
        render_device_memory(result.device)
    assert device_json(result.device)["cudnn_convolution_calls"] == 2
    assert "cudnn_convolution_calls" not in device_json(
        tracer.analyze(os.path.join(FIXTURES, "elementwise_only.py"), batch=2, seq=16).policies["eager"].device)


def test_a_workspace_cap_is_counted_during_every_convolution_call():
    """With the run's cap (CUDNN_CONV_WSCAP_DBG) each call holds the cap while it runs: the requested peak is
    the largest of the step's own peak and (live bytes during a convolution + the cap), an upper bound;
    the allocated and reserved peaks come from the same requests."""
    cap = 64 * 2**20
    plain = tracer.analyze(CONV, batch=2, seq=16).policies["eager"]
    capped = tracer.analyze(CONV, batch=2, seq=16, cudnn_workspace_cap_bytes=cap).policies["eager"]
    convs = [op.index for op in capped.graph.ops if op.target.split(".")[1] in ("convolution", "convolution_backward")]
    assert len(convs) == 2
    expected = max(capped.peak_bytes, max(capped.liveness.live_during[i] for i in convs) + cap)
    assert capped.device.peak_bytes == expected + capped.device.extra_bytes
    assert capped.device.conv_workspace_cap_bytes == cap
    for peak in ("allocated_peak_bytes", "reserved_peak_bytes"):       # the cap is the largest block here
        assert getattr(capped.device, peak) > getattr(plain.device, peak)
        assert getattr(capped.device, peak) >= capped.device.extra_bytes + cap
