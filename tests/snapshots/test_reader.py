"""Snapshot reader: restricted load, timeline, pre-trace blocks, phases, reserved memory, attribution, report.

Real data: the two shared CUDA snapshots (skipped when /work/shared is missing). Every number asserted on
them is recomputed here from the raw trace with a few lines of independent code. Format coverage: small
snapshots built here as dicts, with every number worked out by hand in the comments.
"""
from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from tracer.errors import ExitCode, TracerError
from tracer.reports.snapshot_text import render_snapshot, snapshot_json
from tracer.snapshots import (
    AUTOGRAD_ENGINE,
    BEFORE_TRACE,
    NO_USER_FRAME,
    SnapshotError,
    classify_frames,
    is_user_frame,
    load_snapshot_dict,
    read_snapshot,
    summarize_snapshot,
)
from tracer.stepgraph import SourceLoc

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "snapshots"
SNAPSHOTS = ["cs336-medium-ctx128-fp32-train-step.pickle", "cs336-medium-ctx512-bf16-train-step.pickle"]
MIB = 2**20


def _shared(name: str) -> Path:
    path = SHARED / name
    if not path.exists():
        pytest.skip(f"shared snapshot {path} is not present (the shared folder sits beside the repository)")
    return path


@pytest.fixture(scope="module", params=[SNAPSHOTS[0], *(pytest.param(name, marks=pytest.mark.slow) for name in SNAPSHOTS[1:])])
def real(request):
    path = _shared(request.param)
    return path, load_snapshot_dict(path), read_snapshot(path)


# ---------------------------------------------------------------------------------------------- real data

def _recompute(data: dict) -> tuple[int, int, int, int]:
    """Independent: (before, peak, peak_index, end) from a plain walk that frees at free_completed."""
    trace = data["device_traces"][0]
    live: dict[int, int] = {}
    pre_freed = 0
    sums, current = [], 0
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e["size"]
            current += e["size"]
        elif e["action"] == "free_completed":
            if e["addr"] in live:
                current -= live.pop(e["addr"])
            else:                                    # allocated before recording started
                pre_freed += e["size"]
                current -= e["size"]
        sums.append(current)
    pre_live = sum(b["requested_size"] for s in data["segments"] for b in s["blocks"]
                   if b["state"] == "active_allocated" and b["address"] not in live)
    before = pre_freed + pre_live
    best = max(range(len(sums)), key=lambda i: (sums[i], -i))
    return before, before + sums[best], best, before + sums[-1]


def test_real_peak_and_before_match_independent_sum(real):
    _, data, reading = real
    before, peak, peak_index, end = _recompute(data)
    assert reading.before_bytes == before
    assert reading.peak_bytes == peak
    assert reading.peak_index == peak_index
    assert reading.end_bytes == end == reading.end_bytes_from_segments
    assert len(reading.timeline) == len(data["device_traces"][0])
    assert max(reading.timeline) == peak
    # the live set at the peak is exactly the peak
    assert sum(b.requested_bytes for b in reading.live_at_peak) == reading.peak_bytes
    # parameters + two AdamW states of a ~423M-parameter fp32 model were live before the step (~4.75 GiB)
    assert 4.6 * 2**30 < reading.before_bytes < 4.9 * 2**30


def test_real_free_requested_mode_agrees_when_frees_are_immediate(real):
    path, data, reading = real
    assert reading.delayed_frees == 0
    other = summarize_snapshot(data, free_at="free_requested")
    assert (other.peak_bytes, other.before_bytes, other.end_bytes) == \
           (reading.peak_bytes, reading.before_bytes, reading.end_bytes)


def test_real_phases_follow_frames_and_optimizer_annotation(real):
    _, data, reading = real
    trace = data["device_traces"][0]
    spans = reading.phase_spans
    assert [p for p, _, _ in spans] == ["forward", "backward", "optimizer"]
    # backward starts at the first allocation made under loss.backward()
    first_bwd = next(i for i, e in enumerate(trace) if e["action"] == "alloc" and any(
        f["name"] == "backward" and f["filename"].endswith("torch/_tensor.py") for f in e["frames"]))
    assert spans[1][1] == first_bwd
    # the optimizer span is the Optimizer.step record_function annotation, by timestamps (independent)
    ann = {a["stage"]: a["time_us"] for a in data["external_annotations"]}
    first_opt = next(i for i, e in enumerate(trace) if e["time_us"] >= ann["START"])
    assert spans[2][1] == first_opt
    assert max(i for i, e in enumerate(trace) if e["time_us"] <= ann["END"]) == spans[2][2] == len(trace) - 1
    # per-phase peaks are the maxima of the timeline over each span
    for phase, lo, hi in spans:
        assert reading.phases[phase] == max(reading.timeline[lo:hi + 1])
    assert reading.peak_bytes == max(reading.phases.values())


@pytest.mark.slow
def test_real_peak_phase_is_where_the_frames_say():
    fp32 = read_snapshot(_shared(SNAPSHOTS[0]))
    bf16 = read_snapshot(_shared(SNAPSHOTS[1]))
    trace32 = load_snapshot_dict(_shared(SNAPSHOTS[0]))["device_traces"][0]
    trace16 = load_snapshot_dict(_shared(SNAPSHOTS[1]))["device_traces"][0]
    # fp32: the peak is an AdamW temporary (torch/optim wrapper on the stack)
    assert fp32.peak_phase == "optimizer"
    assert any("/torch/optim/" in f["filename"] for f in trace32[fp32.peak_index]["frames"])
    # bf16: the peak is an allocation of the autograd engine thread
    assert bf16.peak_phase == "backward"
    assert any("torch::autograd::Engine::" in f["name"] for f in trace16[bf16.peak_index]["frames"])
    assert not any(f["filename"].endswith(".py") for f in trace16[bf16.peak_index]["frames"])


def test_real_reserved_timeline(real):
    _, data, reading = real
    trace = data["device_traces"][0]
    total = sum(s["total_size"] for s in data["segments"])
    grown = sum(e["size"] for e in trace if e["action"] == "segment_alloc")
    assert reading.reserved_end_bytes == reading.segments.reserved_bytes == total
    assert reading.reserved_start_bytes == total - grown
    assert reading.reserved_peak_bytes == total
    assert reading.segments.count == len(data["segments"])


def test_real_top_lines_are_user_lines(real):
    _, _, reading = real
    for row in reading.top_lines:
        assert "/torch/" not in row.file and "site-packages" not in row.file and row.file != "??"
        assert row.file == NO_USER_FRAME or (row.file.endswith(".py") and row.line > 0)
    rows = {(r.file.rsplit("/", 1)[-1], r.function): r for r in reading.top_lines}
    # everything live before the trace is grouped, and equals before_bytes (nothing was freed before the peak)
    assert rows[("<no user frame>", BEFORE_TRACE)].bytes_at_peak == reading.before_bytes
    assert sum(r.bytes_at_peak for r in reading.top_lines) <= reading.peak_bytes


@pytest.mark.slow
def test_real_top_lines_measured():
    fp32 = read_snapshot(_shared(SNAPSHOTS[0]))
    bf16 = read_snapshot(_shared(SNAPSHOTS[1]))
    # fp32 peak inside AdamW: the gradients (AccumulateGrad, backward engine) are the largest in-step bytes
    grads = next(r for r in fp32.top_lines if r.function == "AccumulateGrad")
    assert 1.5 * 2**30 < grads.bytes_at_peak < 1.6 * 2**30          # ~423M fp32 gradients
    # bf16 peak at the start of backward: forward activations of model.py dominate
    second = bf16.top_lines[1]
    assert (second.file.rsplit("/", 1)[-1], second.line, second.function) == ("model.py", 39, "forward")


# ---------------------------------------------------------------------------------------------- loading

class _Evil:
    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def test_malicious_pickle_is_refused_before_running(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": _Evil(str(marker))}))
    with pytest.raises(SnapshotError) as info:
        load_snapshot_dict(path)
    assert not marker.exists()
    message = str(info.value)
    assert str(path) in message and "untrusted" in message and "plain data" in message
    assert isinstance(info.value, TracerError) and info.value.exit_code == ExitCode.USAGE
    # a protocol-0 GLOBAL opcode to builtins.eval is refused too, and so is read_snapshot
    path.write_bytes(b"cbuiltins\neval\n(S'1+1'\ntR.")
    with pytest.raises(SnapshotError, match="builtins.eval"):
        read_snapshot(path)


def test_unreadable_inputs(tmp_path):
    with pytest.raises(SnapshotError, match="cannot read"):
        load_snapshot_dict(tmp_path / "missing.pickle")
    (tmp_path / "text.pickle").write_text("not a pickle")
    with pytest.raises(SnapshotError, match="not a readable pickle"):
        load_snapshot_dict(tmp_path / "text.pickle")
    (tmp_path / "int.pickle").write_bytes(pickle.dumps(3))
    with pytest.raises(SnapshotError, match="not a CUDA memory snapshot"):
        load_snapshot_dict(tmp_path / "int.pickle")
    with pytest.raises(SnapshotError, match="free_at"):
        summarize_snapshot({}, free_at="free")


# ---------------------------------------------------------------------------------------------- hand-made

def _f(file: str, line: int, name: str) -> dict:
    return {"filename": file, "line": line, "name": name}


CPP = "??"
FWD = [_f("/home/u/train.py", 11, "forward"), _f("/venv/lib/python3.11/site-packages/torch/nn/modules/module.py",
                                                   1790, "_call_impl"), _f("/home/u/train.py", 40, "main")]
ENGINE = [_f(CPP, 0, "at::empty_cuda(...)"), _f(CPP, 0, "torch::autograd::Engine::evaluate_function(...)")]
MUL_BWD = [_f(CPP, 0, "at::mul(...)"), _f("Functions.cpp", 0, "torch::autograd::generated::MulBackward0::apply(x)"),
           _f(CPP, 0, "torch::autograd::Engine::thread_main(...)")]
OPT = [_f("/venv/lib/python3.11/site-packages/torch/optim/adamw.py", 100, "_single_tensor_adamw"),
       _f("/home/u/train.py", 30, "step_all"), _f("/home/u/train.py", 41, "main")]
A, B, C, E = 0x10000000, 0x20000000, 0x30000000, 20 * MIB


def _handmade() -> dict:
    """Final state + trace, worked out by hand.

    Pre-trace: P1 (4,194,304 B at A, still live at the end, only in `segments`) and P2 (2,097,152 B at
    A+4 MiB, freed at entries 1-2). before = 6,291,456.
    Timeline at free_completed: 0 +100 -> 6,291,556 | 2 -P2 -> 4,194,404 | 3 +3,000,000 -> 7,194,404 |
    4 free_requested (delayed) | 5 +1,000 -> 7,195,404 | 6 -3,000,000 -> 4,195,404 | 7 map 40 MiB |
    8 +5,000,000 -> 9,195,404 (peak, optimizer) | 9 snapshot | 10-11 -5,000,000 -> 4,195,404 | 12 unmap
    20 MiB | 13 oom | 14-15 -1,000 -> 4,194,404 = P1 + 100.
    Reserved: end 20+2+20 = 42 MiB; before 12 (unmap 20) 62 MiB; before 7 (map 40) 22 MiB.
    """
    segments = [
        {"device": 0, "address": A, "total_size": E, "segment_type": "large", "is_expandable": False,
         "blocks": [{"address": A, "size": 4 * MIB, "requested_size": 4 * MIB, "state": "active_allocated",
                     "frames": []},
                    {"address": A + 4 * MIB, "size": 16 * MIB, "requested_size": 0, "state": "inactive",
                     "frames": []}]},
        {"device": 0, "address": B, "total_size": 2 * MIB, "segment_type": "small", "is_expandable": False,
         "blocks": [{"address": B, "size": 512, "requested_size": 100, "state": "active_allocated",
                     "frames": FWD},
                    {"address": B + 512, "size": 2 * MIB - 512, "requested_size": 0, "state": "inactive",
                     "frames": []}]},
        {"device": 0, "address": C, "total_size": E, "segment_type": "large", "is_expandable": True,
         "blocks": [{"address": C, "size": E, "requested_size": 0, "state": "inactive", "frames": []}]},
    ]

    def entry(action, addr, size, frames=()):
        return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": 0, "frames": list(frames)}

    trace = [
        entry("alloc", B, 100, FWD),                          # 0
        entry("free_requested", A + 4 * MIB, 2 * MIB, OPT),   # 1  P2, allocated before the trace
        entry("free_completed", A + 4 * MIB, 2 * MIB, OPT),   # 2
        entry("alloc", A + 4 * MIB, 3_000_000, ENGINE),       # 3
        entry("free_requested", A + 4 * MIB, 3_000_000),      # 4  delayed (record_stream)
        entry("alloc", B + 512, 1000, MUL_BWD),               # 5
        entry("free_completed", A + 4 * MIB, 3_000_000),      # 6
        entry("segment_map", C, 40 * MIB),                    # 7
        entry("alloc", C, 5_000_000, OPT),                    # 8
        entry("snapshot", 0, 9_195_404),                      # 9
        entry("free_requested", C, 5_000_000, OPT),           # 10
        entry("free_completed", C, 5_000_000, OPT),           # 11
        entry("segment_unmap", C + E, E),                     # 12
        entry("oom", 1234, 999),                              # 13 addr = device free bytes
        entry("free_requested", B + 512, 1000),               # 14
        entry("free_completed", B + 512, 1000),               # 15
    ]
    return {"segments": segments, "device_traces": [trace]}


def test_handmade_timeline_at_free_completed(tmp_path):
    path = tmp_path / "hand.pickle"
    path.write_bytes(pickle.dumps(_handmade()))
    r = read_snapshot(path)
    assert r.before_bytes == 6_291_456 and r.pre_trace_blocks == 2
    assert r.timeline == (6_291_556, 6_291_556, 4_194_404, 7_194_404, 7_194_404, 7_195_404, 4_195_404,
                          4_195_404, 9_195_404, 9_195_404, 9_195_404, 4_195_404, 4_195_404, 4_195_404,
                          4_195_404, 4_194_404)
    assert (r.peak_bytes, r.peak_index, r.peak_phase) == (9_195_404, 8, "optimizer")
    assert r.phases == {"forward": 6_291_556, "backward": 7_195_404, "optimizer": 9_195_404}
    assert r.end_bytes == r.end_bytes_from_segments == 4 * MIB + 100
    assert r.delayed_frees == 1
    assert (r.reserved_start_bytes, r.reserved_peak_bytes, r.reserved_end_bytes) == (22 * MIB, 62 * MIB, 42 * MIB)
    assert r.reserved_timeline[6] == 22 * MIB and r.reserved_timeline[7] == 62 * MIB
    assert r.reserved_timeline[12] == 42 * MIB
    assert [(o.index, o.requested_bytes, o.device_free_bytes) for o in r.ooms] == [(13, 999, 1234)]
    assert r.snapshot_indices == (9,)
    assert r.segments.count == 3 and r.segments.expandable_count == 1 and r.segments.small_count == 1
    assert r.segments.free_bytes == 16 * MIB + 2 * MIB - 512 + E
    lines = [(row.file.rsplit("/", 1)[-1], row.line, row.function, row.bytes_at_peak) for row in r.top_lines]
    assert lines == [("train.py", 30, "step_all", 5_000_000), (NO_USER_FRAME, 0, BEFORE_TRACE, 4 * MIB),
                     (NO_USER_FRAME, 0, "MulBackward0", 1000), ("train.py", 11, "forward", 100)]


def test_handmade_timeline_at_free_requested():
    r = summarize_snapshot(_handmade(), free_at="free_requested")
    # P2 leaves at entry 1 and the delayed block at entry 4, not at their free_completed
    assert r.timeline[1] == 4_194_404 and r.timeline[2] == 4_194_404
    assert r.timeline[4] == 4_194_404 and r.timeline[5] == 4_195_404 and r.timeline[6] == 4_195_404
    assert r.phases["backward"] == 7_194_404
    assert r.peak_bytes == 9_195_404 and r.end_bytes == 4 * MIB + 100


def test_handmade_pre_trace_block_without_free_requested():
    data = _handmade()
    trace = data["device_traces"][0]
    del trace[1]                          # skip_actions dropped free_requested: free_completed alone frees
    r = summarize_snapshot(data)
    assert r.before_bytes == 6_291_456 and r.timeline[1] == 4_194_404


def test_legacy_history_blocks_without_addresses_or_traces(tmp_path):
    legacy = [  # torch.cuda.memory_snapshot() list: no device_traces, blocks carry `history`, no `address`
        {"device": 0, "address": 0x1000_0000, "total_size": 2 * MIB, "segment_type": "small",
         "blocks": [{"size": 1024, "state": "active_allocated",
                     "history": [{"addr": 0x1000_0000, "real_size": 1000,
                                  "frames": [_f("/home/u/train.py", 5, "init")]}]},
                    {"size": 2 * MIB - 1024, "state": "inactive"}]},
        {"device": 0, "address": 0x2000_0000, "total_size": E,
         "blocks": [{"size": 4 * MIB, "state": "inactive"},
                    {"size": 4 * MIB, "state": "active_allocated", "history": [{"real_size": 4_000_000}]},
                    {"size": 12 * MIB, "state": "inactive"}]},
    ]
    path = tmp_path / "legacy.pickle"
    path.write_bytes(pickle.dumps(legacy))
    r = read_snapshot(path)
    assert r.before_bytes == r.peak_bytes == r.end_bytes == 4_001_000
    assert (r.peak_index, r.peak_phase, r.phases, r.timeline) == (-1, None, {}, ())
    assert r.reserved_peak_bytes == r.reserved_start_bytes == 22 * MIB
    assert sorted(b.address for b in r.live_at_peak) == [0x1000_0000, 0x2000_0000 + 4 * MIB]
    assert [(row.function, row.bytes_at_peak) for row in r.top_lines] == [(BEFORE_TRACE, 4_000_000), ("init", 1000)]
    assert r.segments.small_count == 1 and r.segments.large_count == 1


def test_trace_without_frames_or_times_has_unknown_phase():
    data = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 10},
                                               {"action": "future_action", "addr": 0, "size": 0},
                                               {"action": "free_completed", "addr": 1, "size": 10}]]}
    r = summarize_snapshot(data)
    assert (r.peak_bytes, r.peak_index, r.peak_phase, r.phases) == (10, 0, None, {})
    assert r.ignored_actions == ("future_action",)


def test_frameless_alloc_among_framed_ones_is_backward():
    """stacks="python": the autograd engine thread has no Python frames, so its allocations have none."""
    data = {"segments": [], "device_traces": [[
        {"action": "alloc", "addr": 1, "size": 10, "frames": FWD},
        {"action": "alloc", "addr": 2, "size": 20, "frames": []},
        {"action": "alloc", "addr": 3, "size": 30, "frames": OPT}]]}
    r = summarize_snapshot(data)
    assert [p for p, _, _ in r.phase_spans] == ["forward", "backward", "optimizer"]
    assert r.phases == {"forward": 10, "backward": 30, "optimizer": 60}


# ---------------------------------------------------------------------------------------------- frame rules

def _locs(frames: list[dict]) -> list[SourceLoc]:
    return [SourceLoc(f["filename"], f["line"], f["name"], "") for f in frames]


def test_classify_frames_rules():
    assert classify_frames([]) is None
    assert classify_frames(_locs(FWD)) == "forward"
    assert classify_frames(_locs(ENGINE)) == "backward"
    assert classify_frames(_locs(MUL_BWD)) == "backward"
    assert classify_frames(_locs(OPT)) == "optimizer"
    # loss code outside any module is forward
    assert classify_frames(_locs([_f("/home/u/losses.py", 3, "cross_entropy"), _f("/home/u/train.py", 9, "main")])) \
        == "forward"
    # a hand-written optimizer: a user function named step, with no module frame inside it
    assert classify_frames(_locs([_f("/home/u/myopt.py", 7, "step"), _f("/home/u/train.py", 9, "main")])) \
        == "optimizer"
    # a training `step` that calls the model: the module frame inside it wins
    assert classify_frames(_locs(FWD[:2] + [_f("/home/u/train.py", 9, "step")])) == "forward"
    # checkpoint recomputation runs module forwards under the engine: backward
    assert classify_frames(_locs(FWD[:2] + ENGINE)) == "backward"
    # loss.backward() itself (Python frames only)
    assert classify_frames(_locs([_f("/venv/lib/python3.11/site-packages/torch/autograd/__init__.py", 200,
                                     "_make_grads"),
                                  _f("/venv/lib/python3.11/site-packages/torch/_tensor.py", 600, "backward"),
                                  _f("/home/u/train.py", 9, "main")])) == "backward"


def test_user_frames_match_what_real_snapshots_contain():
    user = SourceLoc("/home/u/cs336_basics/model.py", 54, "forward", "")
    assert is_user_frame(user)
    for file, line in [("??", 0), ("", 0), ("RegisterCUDA_0.cpp", 0), ("memory_snapshot.cpp", 0),
                       ("/x/.venv/lib/python3.12/site-packages/torch/nn/modules/module.py", 1790),
                       ("/x/.venv/lib/python3.12/site-packages/einops/einops.py", 900),
                       ("/usr/lib/python3.12/contextlib.py", 81), ("<eval_with_key>.3", 5), ("<string>", 1),
                       ("/x/torch/_tensor.py", 600)]:
        assert not is_user_frame(SourceLoc(file, line, "f", "")), file


# ---------------------------------------------------------------------------------------------- report

def test_render_and_json_of_handmade():
    r = summarize_snapshot(_handmade(), source="hand.pickle")
    text = render_snapshot(r, top=3)
    assert "peak live: 8.77 MiB (9,195,404 B) in optimizer, at trace entry 8" in text
    assert "forward 6.00 MiB  |  backward 6.86 MiB  |  optimizer 8.77 MiB" in text
    assert "live before the trace: 6.00 MiB (6,291,456 B) in 2 blocks" in text
    assert "reserved: peak 62.00 MiB (65,011,712 B)" in text
    assert "train.py:30 step_all" in text and "<no user frame>: allocated before the trace" in text
    assert "train.py:11" not in text                              # top=3 cuts the 4th line
    assert "entry 13 asked 999 B with 1.21 KiB free" in text
    js = snapshot_json(r)
    assert js["peak_bytes"] == 9_195_404 and js["peak_phase"] == "optimizer"
    assert js["phases"] == {"forward": {"peak_bytes": 6_291_556}, "backward": {"peak_bytes": 7_195_404},
                            "optimizer": {"peak_bytes": 9_195_404}}
    assert js["before_bytes"] == 6_291_456 and js["reserved_bytes"] == 62 * MIB
    assert js["top_lines"][0] == {"file": "/home/u/train.py", "line": 30, "function": "step_all", "code": None,
                                  "bytes_at_peak": 5_000_000, "blocks": 1}


def test_render_without_frames_says_unknown():
    r = summarize_snapshot({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 10}]]})
    text = render_snapshot(r)
    assert "unknown phase" in text and "per phase: unknown" in text


def test_engine_allocation_without_autograd_node_is_labelled():
    r = summarize_snapshot({"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4096,
                                                                 "frames": ENGINE}]]})
    assert [(row.file, row.function, row.bytes_at_peak) for row in r.top_lines] == \
           [(NO_USER_FRAME, AUTOGRAD_ENGINE, 4096)]


def test_reader_and_report_do_not_import_torch():
    import subprocess
    import sys

    code = ("import sys, tracer.snapshots, tracer.reports.snapshot_text; "
            "sys.exit(1 if 'torch' in sys.modules else 0)")
    root = Path(__file__).resolve().parents[2]
    assert subprocess.run([sys.executable, "-c", code], cwd=root).returncode == 0
