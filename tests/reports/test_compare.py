"""Prediction vs snapshot: the device view (tracer.passes.device), the comparison (tracer.passes.compare),
its text/JSON rendering and the CLI glue (tracer.cli.compare).

The measured side is a snapshot our own code writes (tracer.reports.memviz) of the same prediction, so
every difference is known exactly: zero, or the extra device allocations added on one side.
"""
from __future__ import annotations

import argparse
import json

import pytest

from graph_builder import GraphBuilder
from tracer.errors import UsageError
from tracer.passes.allocator import simulate_allocator
from tracer.passes.analysis import analyze_graph
from tracer.passes.compare import BEFORE_ROW, Quantity, compare_with_snapshot, snapshot_allocated_peak
from tracer.passes.device import predict_device_memory, step_requests
from tracer.reports.compare_text import comparison_json, device_memory_json, render_comparison, render_device_memory
from tracer.reports.memviz import predicted_snapshot, write_memviz_snapshot
from tracer.snapshots import summarize_snapshot
from tracer.stepgraph import StepGraph, StorageRole


@pytest.fixture(params=["synthetic", "llama_debug"])
def analysis(request):
    return request.getfixturevalue(request.param)


def _measured(analysis):
    data = predicted_snapshot(analysis)
    return data, summarize_snapshot(data, source="predicted.pickle")


def test_a_prediction_matches_its_own_snapshot_exactly(analysis):
    result = analysis.policies["eager"]
    extra = result.device.extra if result.device is not None else ()    # a CUDA target's cuBLAS workspaces
    device = predict_device_memory(result, extra=extra, warm_steps=1)
    data, reading = _measured(analysis)
    cmp = compare_with_snapshot(result, device, reading, measured_allocated_peak_bytes=snapshot_allocated_peak(data))
    assert cmp.ok and cmp.failures == ()
    assert cmp.peak.error_bytes == cmp.before.error_bytes == 0
    assert cmp.phases and all(q.error_bytes == 0 and q.gated for q in cmp.phases)
    assert cmp.same_peak_phase and cmp.predicted_peak_phase == result.peak_phase
    assert cmp.allocated.error_bytes == 0 and cmp.reserved.error_bytes == 0   # same stream, same allocator model
    assert all(q.error_bytes == 0 for q in cmp.by_origin)
    assert sum(q.measured_bytes for q in cmp.by_origin) == reading.peak_bytes
    assert cmp.lines and all(r.difference_bytes == 0 for r in cmp.lines)
    assert device.allocated_peak_bytes >= device.peak_bytes                  # blocks are rounded up


def test_extra_device_allocations_and_the_tolerance(synthetic):
    result = synthetic.policies["eager"]
    device = predict_device_memory(result, extra=[("workspace", 1000)] * 2, warm_steps=1)
    assert (device.before_bytes, device.peak_bytes) == (result.start_bytes + 2000, result.peak_bytes + 2000)
    assert device.phases == {name: p.peak_bytes + 2000 for name, p in result.phases.items()}
    _, reading = _measured(synthetic)
    strict = compare_with_snapshot(result, device, reading, tolerance=0.0)
    assert not strict.ok and {"peak", "live before the step"} <= set(strict.failures)
    assert strict.peak.error_bytes == 2000 and strict.allocated is None
    assert next(r for r in strict.lines if r.label == BEFORE_ROW).difference_bytes == 2000
    assert strict.lines[0].label == BEFORE_ROW                               # the largest difference comes first
    assert compare_with_snapshot(result, device, reading, tolerance=10.0).ok            # 2,000 B on a ~0.5 KB step
    text = render_comparison(strict)
    assert "FAILED: beyond 0%: peak" in text and "workspace (2 x 1,000 B)" in text and BEFORE_ROW in text
    assert "workspace" in render_device_memory(device)
    data = json.loads(json.dumps(comparison_json(strict)))
    assert data["ok"] is False and data["peak"]["error_bytes"] == 2000 and data["peak"]["gated"] is True
    assert data["peak_phase"]["predicted"] == data["peak_phase"]["measured"] == result.peak_phase
    assert set(data["phases"]) == set(result.phases) & set(reading.phases)    # phases with allocations on both sides
    assert data["extra"] == [{"label": "workspace", "bytes": 1000}] * 2
    assert json.loads(json.dumps(device_memory_json(device)))["before_bytes"] == result.start_bytes + 2000
    with pytest.raises(ValueError):
        compare_with_snapshot(result, device, reading, tolerance=-0.1)


def test_quantity_errors():
    assert Quantity("x", 102, 100).error_fraction == pytest.approx(0.02)
    assert Quantity("x", 102, 100).within(0.02) and not Quantity("x", 103, 100).within(0.02)
    assert Quantity("x", 0, 0).error_fraction == 0.0 and Quantity("x", 1, 0).error_fraction == float("inf")


def test_line_aliases_rename_predicted_rows(synthetic):
    result = synthetic.policies["eager"]
    _, reading = _measured(synthetic)
    device = predict_device_memory(result, warm_steps=1)
    plain = compare_with_snapshot(result, device, reading, top=50)
    renamed = compare_with_snapshot(result, device, reading, top=50, line_aliases={"model.py:11": "original.py:7"})
    before = {r.label: r for r in plain.lines}
    after = {r.label: r for r in renamed.lines}
    relu = before["model.py:11"]
    assert relu.predicted_bytes == relu.measured_bytes > 0
    assert after["original.py:7"].predicted_bytes == relu.predicted_bytes and after["original.py:7"].measured_bytes == 0
    assert after["model.py:11"].predicted_bytes == 0 and after["model.py:11"].measured_bytes == relu.measured_bytes


def _valid_stream(events) -> None:
    live = set()
    for action, block, _ in events:
        if action == "alloc":
            assert block not in live
            live.add(block)
        else:
            assert block in live
            live.remove(block)


def test_step_requests_stream(analysis):
    result = analysis.policies["eager"]
    one = step_requests(result.liveness)
    assert simulate_allocator(one).requested_peak_bytes == result.peak_bytes
    three = step_requests(result.liveness, extra_nbytes=(4096, 4096), steps=3)
    _valid_stream(three)
    replay = simulate_allocator(three)
    assert replay.requested_peak_bytes == result.peak_bytes + 8192
    assert predict_device_memory(result, warm_steps=2).reserved_peak_bytes >= \
        predict_device_memory(result, warm_steps=1).reserved_peak_bytes


def _replacing_optimizer_step() -> StepGraph:
    """w (param), m (state, replaced): forward y = w*2; optimizer m_new = m*0.9 + g; m freed after op 2."""
    b = GraphBuilder()
    w = b.storage((256, 256), StorageRole.PARAMETER, preexisting=True, persistent=True, name="w")
    m = b.storage((256, 256), StorageRole.OPTIMIZER_STATE, preexisting=True, persistent=True, released_after_op=2,
                  name="w.m")
    y = b.storage((256, 256), persistent=True)
    g = b.storage((256, 256), StorageRole.GRADIENT, released_after_op=3)
    m_new = b.storage((256, 256), StorageRole.OPTIMIZER_STATE, persistent=True, name="w.m")
    b.aten("forward", "aten.mul.Tensor", [w, 2], [y])
    b.aten("backward", "aten.ones_like.default", [y], [g])
    b.aten("optimizer", "aten.add.Tensor", [m, g], [m_new])
    b.aten("optimizer", "aten.add_.Tensor", [w, m_new], [w], is_view=True)
    return b.build(model="replacing", optimizer="custom", parameter_count=65536)


def test_warm_replay_frees_the_replacement_of_replaced_state():
    result = analyze_graph(_replacing_optimizer_step()).policies["eager"]
    events = step_requests(result.liveness, steps=3)
    _valid_stream(events)                                   # copy k frees copy k-1's new moment, not the old one
    replay = simulate_allocator(events)
    state = 256 * 256 * 4
    assert replay.requested_end_bytes == 3 * state          # w, the last new moment and the last y (the "loss")
    assert replay.requested_peak_bytes == result.peak_bytes


def _args(**kw):
    fields = dict(target="cuda", gpu=None, alloc_conf="", cublas_workspace_config=None, compare=None, tolerance="2%",
                  compare_json=None, top=5, device_memory=None)
    fields.update(kw)
    return argparse.Namespace(**fields)


def test_target_cli_glue(synthetic, tmp_path):
    from tracer.passes.analysis import Analysis, with_device_view
    from tracer.passes.device import DeviceSetup
    from tracer.reports.compare_text import render_device_memory
    from tracer.cli.compare import add_target_arguments, run_target_outputs

    parser = argparse.ArgumentParser()
    add_target_arguments(parser)
    args = parser.parse_args(["--compare", "x.pickle", "--tolerance", "1%"])
    assert args.compare == "x.pickle" and args.alloc_conf == "" and args.tolerance == "1%"
    workspaces = (("cuBLAS/cuBLASLt workspaces", 8_519_680),) * 2
    on_a100 = Analysis(policies={name: with_device_view(p, DeviceSetup("cuda:a100", extra=workspaces))
                                 for name, p in synthetic.policies.items()})

    path = tmp_path / "step.pickle"
    write_memviz_snapshot(synthetic, path)
    out: list[str] = []
    assert run_target_outputs(_args(target="cpu"), synthetic, "eager", out.append) == 0 and out == []
    report = tmp_path / "cmp.json"
    assert run_target_outputs(_args(target="cpu", compare=str(path), compare_json=str(report)), synthetic, "eager",
                              out.append) == 0
    assert "OK: peak" in out[-1] and json.loads(report.read_text())["ok"] is True
    out.clear()                                             # cuda adds 2 x 8.1 MiB of cuBLAS workspace to a tiny step
    assert run_target_outputs(_args(compare=str(path)), on_a100, "eager", out.append) == 1
    assert "cuBLAS/cuBLASLt workspaces (2 x 8.12 MiB)" in out[-1] and "FAILED" in out[-1]
    with pytest.raises(UsageError, match="not found"):
        run_target_outputs(_args(compare=str(tmp_path / "missing.pickle")), synthetic, "eager", out.append)
    with pytest.raises(UsageError, match="tolerance"):
        run_target_outputs(_args(compare=str(path), tolerance="lots"), synthetic, "eager", out.append)
    tiny = with_device_view(synthetic.policies["eager"], DeviceSetup("cuda:a100", extra=workspaces,
                                                                      capacity_bytes=8 * 1024))
    assert "out of memory" in render_device_memory(tiny.device)      # an 8 KiB device cannot hold the workspaces
    assert tiny.device.allocated_peak_bytes == on_a100.policies["eager"].device.allocated_peak_bytes
