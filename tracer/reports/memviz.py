"""Export the predicted step as a CUDA memory snapshot, the pickle `torch.cuda.memory._dump_snapshot` writes.

Contract:
    predicted_snapshot(analysis, policy="eager") -> dict
        {"segments": [...], "device_traces": [[...]], "allocator_settings": {...}, "external_annotations": []}
        in the format of `torch.cuda.memory._snapshot()` (one device, stream 0), so PyTorch's memory viewer
        (pytorch.org/memory_viz) and `torch/cuda/_memory_viz.py` read it, and so does
        `tracer.snapshots.read_snapshot`:
        * the trace has, op by op, one `alloc` per storage the op allocates (storage id order), then a
          `free_requested` + `free_completed` pair per storage freed after it; sizes are the storages'
          bytes (requested bytes, as in real traces). So the live bytes after the last alloc of op i are
          the liveness pass' `live_during[i]`, and the snapshot's peak is the analysis' peak (plus, for a
          CUDA target, the device view's allocations outside the step graph: the cuBLAS workspaces).
        * storages that exist before the step are allocated before recording starts: they are blocks of
          `segments` (if still live at the end) or frees of addresses the trace never allocated, which is
          how real snapshots show them.
        * addresses and segments come from `tracer.passes.allocator.simulate_allocator` replaying the
          request stream of the device view (passes/device.py: its extras, the pre-step storages, then the
          step) with its allocator settings (`--alloc-conf`; the defaults without a device view, as for a
          CPU target), which `allocator_settings` records; a `segment_alloc` entry precedes the
          first alloc that lands in a segment created during the step. Block sizes in `segments` are the
          rounded sizes plus, in the large pool, an unsplit tail of at most 1 MiB (as the allocator hands
          out a whole block when the rest would be <= 1 MiB).
        * frames (innermost first): the op's user line {filename, line, name} (for backward ops, the
          forward line that caused them), then one frame that names the op and its phase; for backward
          ops that frame names `torch::autograd::Engine::evaluate_function`, as real backward allocations
          do, so stack-based phase readers classify it. Blocks that exist before the step carry one frame
          naming their category and storage ("parameter blocks.0.attn.wq.weight (allocated before the step)").
        * `time_us` is the op index (ops are not timed).
    snapshot_bytes(snapshot) -> bytes                                 the snapshot pickled, as its file holds it
    write_memviz_snapshot(analysis, path, policy="eager") -> dict    pickles it to `path` and returns it.

Not modelled: several devices or streams, `record_stream` delays (frees complete at once), CUDA-graph pools,
and memory outside the allocator.
"""
from __future__ import annotations

import bisect
import pickle

from tracer.passes.allocator import AllocatorConfig, is_unsplit_tail, round_size, simulate_allocator
from tracer.passes.analysis import Analysis
from tracer.passes.device import step_requests
from tracer.passes.liveness import BEFORE_STEP, intervals_by_op
from tracer.reports.policy_view import policy_graph, policy_result
from tracer.stepgraph import OpNode

BACKWARD_ENGINE_FRAME = "torch::autograd::Engine::evaluate_function"


def predicted_snapshot(analysis: Analysis, policy: str = "eager") -> dict:
    result = policy_result(analysis, policy)
    graph = policy_graph(analysis, result)
    n = len(result.liveness.live_during)
    intervals = [iv for iv in result.liveness.intervals if iv.alloc_op is not None and iv.nbytes > 0]
    before = [iv for iv in intervals if iv.alloc_op == BEFORE_STEP]
    allocs_at, frees_at = intervals_by_op(intervals)

    device = result.device
    config = device.config if device is not None else AllocatorConfig()
    extras = device.extra if device is not None else ()
    requests = step_requests(result.liveness, [nbytes for _, nbytes in extras])   # the device prediction's stream
    replay = simulate_allocator(requests, config)
    addresses = iter(replay.alloc_addresses)
    address = {sid: next(addresses) for action, sid, _ in requests if action == "alloc"}
    extra_ids = [sid for action, sid, _ in requests[:len(extras)]]

    segments = sorted(replay.segments, key=lambda s: s.address)
    starts = [s.address for s in segments]
    seg_of = {sid: segments[bisect.bisect_right(starts, address[sid]) - 1]
              for sid in [iv.storage_id for iv in intervals] + extra_ids}
    pre_segments = {seg_of[sid].address for sid in [iv.storage_id for iv in before] + extra_ids}
    opened: set[int] = set()

    trace: list[dict] = []
    for i in range(n):
        op = graph.ops[i] if i < len(graph.ops) else None
        frames = _frames(op)
        for iv in allocs_at.get(i, ()):
            seg = seg_of[iv.storage_id]
            if seg.address not in pre_segments and seg.address not in opened:
                opened.add(seg.address)
                trace.append(_entry("segment_alloc", seg.address, seg.size_bytes, i, frames))
            trace.append(_entry("alloc", address[iv.storage_id], iv.nbytes, i, frames))
        for iv in frees_at.get(i, ()):
            trace.append(_entry("free_requested", address[iv.storage_id], iv.nbytes, i, frames))
            trace.append(_entry("free_completed", address[iv.storage_id], iv.nbytes, i, frames))

    live_at_end = {iv.storage_id: iv for iv in intervals if iv.free_op is None}
    block_frames = {}
    for iv in live_at_end.values():
        if iv.alloc_op == BEFORE_STEP:
            storage = graph.storage(iv.storage_id)
            what = f"{result.categories[iv.storage_id]} {storage.name}".strip()
            block_frames[iv.storage_id] = [{"filename": "<predicted by tracer>", "line": 0,
                                            "name": f"{what} (allocated before the step)"}]
        elif iv.alloc_op < len(graph.ops):
            block_frames[iv.storage_id] = _frames(graph.ops[iv.alloc_op])
    live = [(iv.storage_id, iv.nbytes) for iv in live_at_end.values()]
    for sid, (label, nbytes) in zip(extra_ids, extras):      # never freed: live at the end
        live.append((sid, nbytes))
        block_frames[sid] = [{"filename": "<predicted by tracer>", "line": 0, "name": f"{label} (allocated before the step)"}]
    live_by_segment: dict[int, list] = {}
    for sid, nbytes in live:
        live_by_segment.setdefault(seg_of[sid].address, []).append((sid, nbytes))
    out_segments = [_segment(seg, live_by_segment.get(seg.address, []), address, block_frames, config)
                    for seg in segments]
    return {"segments": out_segments, "device_traces": [trace],
            "allocator_settings": _allocator_settings(config, analysis.settings.get("alloc_conf", "")),
            "external_annotations": []}


def _allocator_settings(config: AllocatorConfig, alloc_conf: str) -> dict:
    """The snapshot's `allocator_settings`, as torch records them."""
    return {"PYTORCH_CUDA_ALLOC_CONF": alloc_conf,
            "max_split_size": -1 if config.max_split_size_bytes is None else config.max_split_size_bytes,
            "garbage_collection_threshold": config.garbage_collection_threshold,
            "expandable_segments": config.expandable_segments}


def _segment(seg, live, address: dict[int, int], block_frames: dict[int, list], config: AllocatorConfig) -> dict:
    """`live`: (block id, requested bytes) of the blocks live in `seg` at the end."""
    live = sorted(live, key=lambda block: address[block[0]])
    blocks, cursor = [], seg.address
    end = seg.address + seg.size_bytes
    for k, (sid, nbytes) in enumerate(live):
        start = address[sid]
        if start > cursor:
            blocks.append(_block(cursor, start - cursor, 0, "inactive", []))
        size = round_size(nbytes)
        following = address[live[k + 1][0]] if k + 1 < len(live) else end
        if is_unsplit_tail(seg.is_small, following - (start + size)):
            size = following - start                        # unsplit tail: the allocator handed out the whole block
        blocks.append(_block(start, size, nbytes, "active_allocated", block_frames.get(sid, [])))
        cursor = start + size
    if cursor < end:
        blocks.append(_block(cursor, end - cursor, 0, "inactive", []))
    allocated = sum(b["size"] for b in blocks if b["state"] == "active_allocated")
    requested = sum(b["requested_size"] for b in blocks if b["state"] == "active_allocated")
    return {"device": 0, "address": seg.address, "total_size": seg.size_bytes, "allocated_size": allocated,
            "active_size": allocated, "requested_size": requested, "stream": 0,
            "segment_type": "small" if seg.is_small else "large", "segment_pool_id": (0, 0),
            "is_expandable": seg.expandable, "frames": [], "blocks": blocks}


def _block(address: int, size: int, requested: int, state: str, frames: list) -> dict:
    return {"address": address, "size": size, "requested_size": requested, "state": state, "frames": frames}


def _entry(action: str, addr: int, size: int, op_index: int, frames: list) -> dict:
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": op_index, "frames": frames,
            "compile_context": "N/A", "user_metadata": ""}


def _frames(op: OpNode | None) -> list[dict]:
    if op is None:
        return []
    phase = getattr(op.phase, "value", op.phase)
    frames = []
    if op.source is not None:
        frames.append({"filename": op.source.file, "line": op.source.line, "name": op.source.function})
    name = f"{BACKWARD_ENGINE_FRAME} [{op.target}]" if phase == "backward" else f"{op.target} [{phase}]"
    frames.append({"filename": "<predicted by tracer>", "line": 0, "name": name})
    return frames


def snapshot_bytes(snapshot: dict) -> bytes:
    return pickle.dumps(snapshot, protocol=pickle.HIGHEST_PROTOCOL)


def write_memviz_snapshot(analysis: Analysis, path, policy: str = "eager") -> dict:
    data = predicted_snapshot(analysis, policy)
    from tracer.outputs import write_output
    write_output(path, snapshot_bytes(data), what="the snapshot")
    return data
