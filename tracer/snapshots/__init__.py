"""Real CUDA memory snapshots (`torch.cuda.memory._dump_snapshot()` pickles), read without torch.

`read_snapshot(path)` gives a frozen `SnapshotReading` (peak, phases, pre-step bytes, reserved memory, top
lines); `load_snapshot_dict(path)` is the restricted load underneath it. See `tracer.snapshots.reader`.
"""
from tracer.snapshots.reader import (
    AUTOGRAD_ENGINE,
    BEFORE_TRACE,
    FREE_ACTIONS,
    NO_USER_FRAME,
    InitialBlock,
    InitialSegment,
    LineBytes,
    LiveBlock,
    OomEvent,
    ReplayInputs,
    SegmentSummary,
    SnapshotError,
    SnapshotReading,
    classify_frames,
    is_user_frame,
    load_snapshot_dict,
    read_snapshot,
    replay_inputs,
    summarize_snapshot,
)

__all__ = [
    "AUTOGRAD_ENGINE", "BEFORE_TRACE", "FREE_ACTIONS", "NO_USER_FRAME", "InitialBlock", "InitialSegment",
    "LineBytes", "LiveBlock", "OomEvent", "ReplayInputs", "SegmentSummary", "SnapshotError", "SnapshotReading",
    "classify_frames", "is_user_frame", "load_snapshot_dict", "read_snapshot", "replay_inputs",
    "summarize_snapshot",
]
