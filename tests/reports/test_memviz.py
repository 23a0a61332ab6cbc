"""memory_viz export: torch's `_memory_viz` accepts it; the snapshot reader reads back the analysis' numbers."""
from __future__ import annotations

import copy

import pytest
from torch.cuda import _memory_viz

from tracer.passes.liveness import BEFORE_STEP
from tracer.reports.memviz import predicted_snapshot, write_memviz_snapshot
from tracer.snapshots import load_snapshot_dict, read_snapshot, summarize_snapshot


def _identity(text):
    return text


@pytest.fixture(params=["synthetic", "llama_debug"])
def analysis(request):
    return request.getfixturevalue(request.param)


def test_reader_reads_back_the_predicted_numbers(analysis, tmp_path):
    result = analysis.policies["eager"]
    path = tmp_path / "predicted.pickle"
    write_memviz_snapshot(analysis, path)
    reading = read_snapshot(path)                                  # restricted unpickler: plain data only
    extra = result.device.extra_bytes if result.device is not None else 0   # a CUDA target's cuBLAS workspaces
    assert reading.peak_bytes == result.peak_bytes + extra
    assert reading.peak_phase == result.peak_phase
    assert reading.before_bytes == result.start_bytes + extra
    assert reading.end_bytes == result.end_bytes + extra == reading.end_bytes_from_segments
    assert reading.reserved_start_bytes <= reading.reserved_peak_bytes == reading.reserved_end_bytes
    alloc_phases = {op.phase.value for op in analysis.graph.ops
                    if any(iv.alloc_op == op.index and iv.nbytes for iv in result.liveness.intervals)}
    for phase in alloc_phases:                                     # per-phase peaks, from the frames alone
        assert reading.phases[phase] == result.phases[phase].peak_bytes + extra
    # the timeline after each op's last alloc is live_during of that op
    assert max(reading.timeline) == max(result.liveness.live_during) + extra


def test_the_device_view_settings_and_workspaces_reach_the_snapshot(llama_debug):
    """A CUDA target's snapshot replays the device view's stream: the cuBLAS workspaces are blocks before the
    step, and --alloc-conf's settings place the blocks (expandable segments) and are recorded."""
    import tracer

    default = predicted_snapshot(llama_debug)
    workspaces = [b for seg in default["segments"] for b in seg["blocks"]
                  if any("workspace" in f["name"].lower() for f in b["frames"])]
    device = llama_debug.policies["eager"].device
    assert len(workspaces) == len(device.extra) == 2 and {b["requested_size"] for b in workspaces} == {32 * 2**20}
    assert default["allocator_settings"]["expandable_segments"] is False
    expandable = tracer.analyze("llama-debug", batch=2, seq=32, alloc_conf="expandable_segments:True")
    data = predicted_snapshot(expandable)
    assert data["allocator_settings"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "max_split_size": -1,
                                          "garbage_collection_threshold": 0.0, "expandable_segments": True}
    assert all(seg["is_expandable"] for seg in data["segments"])
    assert len(data["segments"]) < len(default["segments"])      # one growing segment per pool


def test_memory_viz_functions_accept_it(analysis):
    data = predicted_snapshot(analysis)
    summary = _memory_viz.segsum(data)                             # asserts the segment accounting adds up
    assert f"segments: {len(data['segments'])}" in summary
    trace = _memory_viz.trace(data)
    allocs = sum(1 for e in data["device_traces"][0] if e["action"] == "alloc")
    assert f"{len(data['device_traces'][0])} entries" in trace and trace.count(" = ") >= allocs
    assert _memory_viz.memory(data, format_flamegraph=_identity).strip()
    assert _memory_viz.segments(data, format_flamegraph=_identity).strip()
    _memory_viz.compare(data["segments"], data["segments"], format_flamegraph=_identity)
    html = _memory_viz.trace_plot(copy.deepcopy(data))
    assert "Active Memory Timeline" in html
    assert "Allocator State History" in _memory_viz.segment_plot(data)
    filtered = _memory_viz.filter_alloc_free_pairs(copy.deepcopy(data))
    live_at_end = sum(1 for iv in analysis.policies["eager"].liveness.intervals
                      if iv.alloc_op not in (None, BEFORE_STEP) and iv.free_op is None and iv.nbytes)
    assert sum(1 for e in filtered["device_traces"][0] if e["action"] == "alloc") == live_at_end


def test_trace_is_a_valid_allocator_stream(analysis):
    data = predicted_snapshot(analysis)
    result = analysis.policies["eager"]
    graph = analysis.graph
    trace = data["device_traces"][0]
    live: dict[int, int] = {}
    for k, e in enumerate(trace):
        assert set(e) >= {"action", "addr", "size", "stream", "time_us", "frames"}
        if e["action"] == "alloc":
            assert e["addr"] not in live
            assert not any(a < e["addr"] + e["size"] and e["addr"] < a + s for a, s in live.items())   # no overlap
            live[e["addr"]] = e["size"]
        elif e["action"] == "free_requested":
            assert trace[k + 1]["action"] == "free_completed" and trace[k + 1]["addr"] == e["addr"]
            live.pop(e["addr"], None)
    step_allocs = [iv for iv in result.liveness.intervals if iv.alloc_op not in (None, BEFORE_STEP) and iv.nbytes]
    assert sum(1 for e in trace if e["action"] == "alloc") == len(step_allocs)
    assert sorted(e["time_us"] for e in trace) == [e["time_us"] for e in trace]
    # frames: the user line of the op, innermost first; backward ops name the autograd engine
    for e in trace:
        if e["action"] != "alloc":
            continue
        op = graph.ops[e["time_us"]]
        if op.source is not None:
            assert e["frames"][0] == {"filename": op.source.file, "line": op.source.line, "name": op.source.function}
        assert ("torch::autograd::Engine::" in e["frames"][-1]["name"]) == (op.phase.value == "backward")
    # segments tile exactly and hold the storages live at the end
    for seg in data["segments"]:
        assert sum(b["size"] for b in seg["blocks"]) == seg["total_size"]
        starts = [b["address"] for b in seg["blocks"]]
        assert starts[0] == seg["address"] and starts == sorted(starts)
    active = sum(b["requested_size"] for s in data["segments"] for b in s["blocks"] if b["state"] == "active_allocated")
    assert active == result.end_bytes + (result.device.extra_bytes if result.device is not None else 0)


def test_round_trip_through_pickle_keeps_the_dict(synthetic, tmp_path):
    path = tmp_path / "p.pickle"
    data = write_memviz_snapshot(synthetic, path)
    assert load_snapshot_dict(path) == data
    assert summarize_snapshot(data).peak_bytes == synthetic.policies["eager"].peak_bytes
