"""Render a `SnapshotReading` (a real CUDA memory snapshot) as a terminal report or a JSON-ready dict.

No analysis happens here: every number comes from `tracer.snapshots.read_snapshot`.
"""
from __future__ import annotations

from tracer.reports.units import format_bytes
from tracer.snapshots.reader import NO_USER_FRAME, LineBytes, SnapshotReading


def render_snapshot(reading: SnapshotReading, *, top: int = 10) -> str:
    """Peak (with its phase and trace index), live bytes before the step, reserved memory, per-phase
    peaks, segments and the top user lines at the peak."""
    r = reading
    where = f"trace entry {r.peak_index}" if r.peak_index >= 0 else "before the first trace entry"
    phase = r.peak_phase or "unknown phase (no stack frames recorded)"
    seg = r.segments
    lines = [
        f"snapshot: {r.source}  (device {r.device}, {len(r.timeline):,} trace entries, frees counted at {r.free_at})",
        "",
        f"peak live: {_both(r.peak_bytes)} in {phase}, at {where}",
        "per phase: " + ("  |  ".join(f"{name} {format_bytes(nbytes)}" for name, nbytes in r.phases.items())
                         or "unknown (no stack frames recorded)"),
        f"live before the trace: {_both(r.before_bytes)} in {r.pre_trace_blocks:,} blocks   "
        f"at the end: {format_bytes(r.end_bytes)}",
        f"reserved: peak {_both(r.reserved_peak_bytes)}   start {format_bytes(r.reserved_start_bytes)}   "
        f"end {format_bytes(r.reserved_end_bytes)}",
        f"segments at the end: {seg.count:,} ({seg.small_count} small, {seg.large_count} large"
        + (f", {seg.expandable_count} expandable" if seg.expandable_count else "")
        + f"), cached free {format_bytes(seg.free_bytes)}, largest free block "
          f"{format_bytes(seg.largest_free_block_bytes)}",
    ]
    if r.ooms:
        lines.append("out of memory: " + ", ".join(
            f"entry {o.index} asked {format_bytes(o.requested_bytes)} with {format_bytes(o.device_free_bytes)} free"
            for o in r.ooms))
    if r.delayed_frees:
        lines.append(f"delayed frees (free_requested before free_completed): {r.delayed_frees:,}")
    if r.ignored_actions:
        lines.append("ignored unknown trace actions: " + ", ".join(r.ignored_actions))
    lines += ["", f"top {top} lines at the peak:", f"  {'at peak':>12} {'blocks':>7}  line"]
    for row in r.top_lines[:top]:
        share = 100.0 * row.bytes_at_peak / r.peak_bytes if r.peak_bytes else 0.0
        lines.append(f"  {format_bytes(row.bytes_at_peak):>12} {row.blocks:>7}  {_label(row)}  ({share:.1f}%)")
    return "\n".join(lines) + "\n"


def snapshot_json(reading: SnapshotReading, *, top: int | None = None) -> dict:
    """JSON-ready summary. Keys: peak_bytes, peak_index, peak_phase, phases {name: {peak_bytes}},
    top_lines [{file, line, function, code, bytes_at_peak, blocks}], before_bytes, reserved_bytes (peak),
    reserved_end_bytes, end_bytes, segments {count, reserved_bytes, sizes}, source, device, free_at."""
    r = reading
    rows = r.top_lines if top is None else r.top_lines[:top]
    return {
        "source": r.source,
        "device": r.device,
        "free_at": r.free_at,
        "peak_bytes": r.peak_bytes,
        "peak_index": r.peak_index,
        "peak_phase": r.peak_phase,
        "phases": {name: {"peak_bytes": nbytes} for name, nbytes in r.phases.items()},
        "top_lines": [{"file": row.file, "line": row.line, "function": row.function, "code": None,
                       "bytes_at_peak": row.bytes_at_peak, "blocks": row.blocks} for row in rows],
        "before_bytes": r.before_bytes,
        "end_bytes": r.end_bytes,
        "reserved_bytes": r.reserved_peak_bytes,
        "reserved_end_bytes": r.reserved_end_bytes,
        "segments": {"count": r.segments.count, "reserved_bytes": r.segments.reserved_bytes,
                     "sizes": list(r.segments.sizes)},
    }


def _both(nbytes: int) -> str:
    return f"{format_bytes(nbytes)} ({nbytes:,} B)"


def _label(row: LineBytes) -> str:
    if row.file == NO_USER_FRAME:
        return f"{NO_USER_FRAME}: {row.function}" if row.function else NO_USER_FRAME
    return f"{row.file.rsplit('/', 1)[-1]}:{row.line} {row.function}"
