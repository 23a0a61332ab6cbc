"""Compare a predicted step (one policy, on a device) with a real CUDA memory snapshot of that step.

Contract:
    compare_with_snapshot(result, device, reading, *, measured_allocated_peak_bytes=None, tolerance=0.02,
                          top=10) -> SnapshotComparison (frozen; `ok` is the verdict)
    snapshot_allocated_peak(data) -> int | None

`result` is a PolicyAnalysis, `device` its DeviceMemory (tracer.passes.device), `reading` a SnapshotReading
(tracer.snapshots). Both sides count requested bytes (trace sizes; the reader's convention), so:
  * gated (each must be within `tolerance` of the measured value, relative to it, for `ok`): the peak,
    every phase peak present on both sides, and the bytes live before the step;
  * reported only: the phase of the peak, allocated (rounded) peak when a measured one is given (e.g.
    `memory_stats()["allocated_bytes.all.peak"]`, or `snapshot_allocated_peak` of the snapshot), reserved
    peak (the allocator model runs against a cache warmed by replaying the predicted step, not the real
    warm-up steps, so expect a few percent), and the bytes live at the peak by the phase that allocated
    them (before the step / forward / backward / optimizer).
  * lines: bytes live at each side's own peak per `file:line` of the allocating op (file by base name, so
    a snapshot taken on another machine still lines up). Two rows group what cannot be matched by line on
    both sides: `(before the step)` (parameters, optimizer state, inputs, the extra device allocations)
    and `(allocated in backward)` (a snapshot's backward allocations carry only C++ frames, while the
    prediction knows the forward line behind each). Other blocks without a user frame are rows named by
    their label. Rows are sorted by |difference|; `top` are kept.
"""
from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping

from tracer.passes.device import DeviceMemory
from tracer.stepgraph import PHASE_NAMES
from tracer.snapshots.reader import BEFORE_TRACE, NO_USER_FRAME, SnapshotReading, is_user_frame

BEFORE_ROW = "(before the step)"
BACKWARD_ROW = "(allocated in backward)"
ORIGINS = ("before the step",) + PHASE_NAMES


@dataclasses.dataclass(frozen=True)
class Quantity:
    name: str
    predicted_bytes: int
    measured_bytes: int
    gated: bool = False               # counts toward `ok`

    @property
    def error_bytes(self) -> int:
        return self.predicted_bytes - self.measured_bytes

    @property
    def error_fraction(self) -> float:
        if self.measured_bytes:
            return self.error_bytes / self.measured_bytes
        return 0.0 if self.predicted_bytes == 0 else math.inf

    def within(self, tolerance: float) -> bool:
        return abs(self.error_fraction) <= tolerance


@dataclasses.dataclass(frozen=True)
class LineDifference:
    label: str                        # "file.py:123", BEFORE_ROW, or "<no user frame>: <autograd node>"
    predicted_bytes: int
    measured_bytes: int
    code: str                         # the predicted line's source, else the measured frame's function

    @property
    def difference_bytes(self) -> int:
        return self.predicted_bytes - self.measured_bytes


@dataclasses.dataclass(frozen=True)
class SnapshotComparison:
    policy: str
    snapshot: str
    tolerance: float
    peak: Quantity
    predicted_peak_phase: str | None
    measured_peak_phase: str | None
    phases: tuple[Quantity, ...]
    before: Quantity
    allocated: Quantity | None        # rounded block sizes; None without a measured value
    reserved: Quantity
    by_origin: tuple[Quantity, ...]   # bytes live at each side's peak, by the phase that allocated them
    lines: tuple[LineDifference, ...]
    extra: tuple[tuple[str, int], ...]
    failures: tuple[str, ...]         # gated quantities beyond the tolerance

    @property
    def ok(self) -> bool:
        return not self.failures

    @property
    def same_peak_phase(self) -> bool:
        return self.predicted_peak_phase == self.measured_peak_phase


def compare_with_snapshot(result, device: DeviceMemory, reading: SnapshotReading, *,
                          measured_allocated_peak_bytes: int | None = None, tolerance: float = 0.02,
                          top: int = 10, line_aliases: Mapping[str, str] | None = None) -> SnapshotComparison:
    """Predicted vs measured, see the module docstring. `line_aliases` maps a predicted row ("file.py:12")
    to the measured row it stands for, when the prediction ran on a rewrite of the measured code.
    Raises ValueError on a negative tolerance."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    peak = Quantity("peak", device.peak_bytes, reading.peak_bytes, gated=True)
    phases = tuple(Quantity(f"{name} peak", device.phases[name], reading.phases[name], gated=True)
                   for name in device.phases if name in reading.phases)
    before = Quantity("live before the step", device.before_bytes, reading.before_bytes, gated=True)
    allocated = (Quantity("allocated peak (rounded)", device.allocated_peak_bytes, measured_allocated_peak_bytes)
                 if measured_allocated_peak_bytes is not None else None)
    reserved = Quantity("reserved peak", device.reserved_peak_bytes, reading.reserved_peak_bytes)
    predicted_origin = _predicted_by_origin(result, device)
    measured_origin = _measured_by_origin(reading)
    by_origin = tuple(Quantity(name, predicted_origin.get(name, 0), measured_origin.get(name, 0)) for name in ORIGINS)
    failures = tuple(q.name for q in (peak, *phases, before) if q.gated and not q.within(tolerance))
    return SnapshotComparison(
        policy=result.policy, snapshot=reading.source, tolerance=tolerance, peak=peak,
        predicted_peak_phase=device.peak_phase, measured_peak_phase=reading.peak_phase, phases=phases,
        before=before, allocated=allocated, reserved=reserved, by_origin=by_origin,
        lines=_line_differences(result, device, reading, top, dict(line_aliases or {})), extra=device.extra,
        failures=failures)


def _predicted_by_origin(result, device: DeviceMemory) -> dict[str, int]:
    from tracer.passes.liveness import BEFORE_STEP
    out = dict.fromkeys(ORIGINS, 0)
    out["before the step"] = device.extra_bytes
    for sid in result.liveness.live_storages_at(result.peak_op.index):
        iv = result.liveness.intervals[sid]
        origin = "before the step" if iv.alloc_op == BEFORE_STEP else result.graph.ops[iv.alloc_op].phase.value
        out[origin] += iv.nbytes
    return out


def _measured_by_origin(reading: SnapshotReading) -> dict[str, int]:
    out = dict.fromkeys(ORIGINS, 0)
    for block in reading.live_at_peak:
        origin = "before the step" if block.alloc_index < 0 else (block.phase or "forward")
        out[origin] = out.get(origin, 0) + block.requested_bytes
    return out


def _line_differences(result, device: DeviceMemory, reading: SnapshotReading, top: int,
                      aliases: dict[str, str]) -> tuple[LineDifference, ...]:
    from tracer.passes.liveness import BEFORE_STEP
    predicted: dict[str, list] = {BEFORE_ROW: [device.extra_bytes, ""]}
    for sid in result.liveness.live_storages_at(result.peak_op.index):
        iv = result.liveness.intervals[sid]
        op = None if iv.alloc_op == BEFORE_STEP else result.graph.ops[iv.alloc_op]
        if op is None:
            key, code = BEFORE_ROW, ""
        elif op.phase.value == "backward":
            key, code = BACKWARD_ROW, ""
        elif op.source is not None and is_user_frame(op.source):
            key, code = f"{os.path.basename(op.source.file)}:{op.source.line}", op.source.code
        elif op.source is not None:                       # e.g. torch/optim: the snapshot reader sees no user frame
            key, code = NO_USER_FRAME, ""
        else:
            key, code = f"({op.target})", ""
        key = aliases.get(key, key)
        entry = predicted.setdefault(key, [0, code])
        entry[0] += iv.nbytes
    measured: dict[str, list] = {}
    for block in reading.live_at_peak:
        if block.alloc_index < 0 or block.label == BEFORE_TRACE:
            key, code = BEFORE_ROW, ""
        elif block.phase == "backward":
            key, code = BACKWARD_ROW, ""
        elif block.source is not None:
            key, code = f"{os.path.basename(block.source.file)}:{block.source.line}", block.source.function
        else:
            key, code = f"{NO_USER_FRAME}: {block.label}" if block.label else NO_USER_FRAME, ""
        entry = measured.setdefault(key, [0, code])
        entry[0] += block.requested_bytes
    rows = [LineDifference(key, predicted.get(key, [0])[0], measured.get(key, [0])[0],
                           (predicted.get(key) or [0, ""])[1] or (measured.get(key) or [0, ""])[1])
            for key in dict.fromkeys([*predicted, *measured])]
    rows = [r for r in rows if r.predicted_bytes or r.measured_bytes]
    rows.sort(key=lambda r: (-abs(r.difference_bytes), -max(r.predicted_bytes, r.measured_bytes), r.label))
    return tuple(rows[:top])


def snapshot_allocated_peak(data: dict) -> int | None:
    """Peak of allocated (rounded block) bytes of a loaded snapshot: its own request stream replayed from
    its recorded starting state through the allocator model (exact on both shared snapshots, see
    tests/passes/test_allocator.py). None when the start state cannot be rebuilt (segments freed or
    mapped in the trace)."""
    from tracer.passes.allocator import SeedBlock, SeedSegment, simulate_allocator
    from tracer.snapshots.reader import SnapshotError, replay_inputs

    try:
        inputs = replay_inputs(data)
    except SnapshotError:
        return None
    seed = [SeedSegment(s.address, s.size_bytes, s.is_small,
                        tuple(SeedBlock(b.block_id, b.address, b.size_bytes, b.requested_bytes) for b in s.blocks))
            for s in inputs.segments]
    replay = simulate_allocator(inputs.events, seed=seed, segment_addresses=inputs.segment_addresses)
    return replay.allocated_peak_bytes
