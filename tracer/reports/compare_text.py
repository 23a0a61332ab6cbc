"""Render the device view of a prediction and its comparison with a real CUDA snapshot (text and JSON).

No analysis happens here: numbers come from `tracer.passes.device.DeviceMemory` and
`tracer.passes.compare.SnapshotComparison`. Errors are predicted minus measured, in bytes and as a
percentage of the measured value.
"""
from __future__ import annotations

from tracer.passes.compare import Quantity, SnapshotComparison
from tracer.passes.device import DeviceMemory
from tracer.reports.units import format_bytes


def render_device_memory(device: DeviceMemory, *, target: str = "cuda") -> str:
    """Requested peak (what a snapshot shows), allocated (rounded) and reserved peaks, and the extras."""
    lines = [f"on {target} ({device.policy}): peak {format_bytes(device.peak_bytes)} requested "
             f"({device.peak_bytes:,} B) in {device.peak_phase}, "
             f"allocated {format_bytes(device.allocated_peak_bytes)} (512 B blocks), "
             f"reserved {format_bytes(device.reserved_peak_bytes)} in {device.segment_count:,} segments "
             f"(allocator model, cache warmed by {device.warm_steps} step{'s' if device.warm_steps > 1 else ''})"]
    for label, nbytes in _grouped(device.extra):
        lines.append(f"  + {label}: {format_bytes(nbytes)} before the step")
    if device.conv_calls and device.conv_workspace_cap_bytes is not None:
        lines.append(f"  + cuDNN convolution workspaces: {format_bytes(device.conv_workspace_cap_bytes)} "
                     f"(--cudnn-workspace-cap) during each of {device.conv_calls:,} convolution calls: an upper bound")
    elif device.conv_calls:
        lines.append(f"  note: {device.conv_calls:,} cuDNN convolution calls each allocate a workspace for the call, "
                     "sized by the plan cuDNN picks at run time: not counted, so these peaks are lower bounds "
                     "(--cudnn-workspace-cap SIZE, the run's CUDNN_CONV_WSCAP_DBG, counts the cap: an upper bound)")
    system = (f" and {format_bytes(device.system_bytes)} the operating system holds of the unified memory "
              "(an assumption: --device-memory gives what is free)" if device.system_bytes else "")
    communicators = device.nccl_communicators
    owner = "communicators'" if communicators > 1 else "communicator's"
    nccl = (f" and {format_bytes(device.nccl_bytes)} for {communicators} NCCL {owner} buffers (--nccl-memory, per "
            "communicator)" if device.nccl_bytes else "")
    total = device.capacity_bytes + device.context_bytes + device.system_bytes + device.nccl_bytes \
        if device.capacity_bytes is not None else 0
    context = (f", the device's {format_bytes(total)} less {format_bytes(device.context_bytes)} for the CUDA context "
               f"(--cuda-context){system}{nccl}"
               if (device.context_bytes or device.nccl_bytes) and device.capacity_bytes is not None else "")
    if device.capacity_bytes is not None and device.oom is None:
        lines.append(f"  fits in {format_bytes(device.capacity_bytes)} of device memory "
                     f"({format_bytes(device.capacity_bytes - device.reserved_peak_bytes)} left at the reserved peak"
                     f"{context})")
    elif device.capacity_bytes is not None and context:
        lines.append(f"  device memory: {format_bytes(device.capacity_bytes)}{context}")
    if device.oom is not None:
        o = device.oom
        lines.append(f"  out of memory at request {o.event_index}: {format_bytes(o.requested_bytes)} asked, "
                     f"{format_bytes(o.device_free_bytes)} free on the device, {format_bytes(o.cached_free_bytes)} "
                     f"cached in {o.cached_free_blocks} free blocks "
                     f"(largest {format_bytes(o.largest_cached_free_bytes)})")
    return "\n".join(lines) + "\n"


def render_comparison(cmp: SnapshotComparison, *, top: int | None = None) -> str:
    """Predicted vs measured, side by side, with the verdict against the tolerance."""
    tol = f"{cmp.tolerance * 100:g}%"
    rows = [cmp.peak, *cmp.phases, cmp.before, *( [cmp.allocated] if cmp.allocated else []), cmp.reserved]
    out = [f"compare ({cmp.policy}) with {cmp.snapshot}", "",
           f"  {'':<28} {'predicted':>14} {'measured':>14} {'error':>13} {'':>8}"]
    for q in rows:
        out.append(_row(q, cmp.tolerance))
    same = "same" if cmp.same_peak_phase else "DIFFERS"
    out.append(f"  {'phase of the peak':<28} {cmp.predicted_peak_phase or '?':>14} {cmp.measured_peak_phase or '?':>14}"
               f" {same:>13}")
    if cmp.extra:
        extras = ", ".join(f"{label} {format_bytes(n)}" for label, n in _grouped(cmp.extra))
        out.append(f"  predicted includes {extras}")
    out += ["", "  live at each side's peak, by the phase that allocated it:"]
    out += [_row(q, None) for q in cmp.by_origin]
    rows = cmp.lines if top is None else cmp.lines[:top]
    out += ["", "  largest differences by line at the peak (predicted - measured):",
            f"  {'predicted':>12} {'measured':>12} {'difference':>12}  line"]
    for r in rows:
        code = f"  {r.code}" if r.code else ""
        out.append(f"  {format_bytes(r.predicted_bytes):>12} {format_bytes(r.measured_bytes):>12} "
                   f"{_signed(r.difference_bytes):>12}  {r.label}{code}")
    verdict = (f"OK: peak, phase peaks and bytes before the step within {tol}" if cmp.ok else
               f"FAILED: beyond {tol}: {', '.join(cmp.failures)}")
    return "\n".join(out + ["", verdict]) + "\n"


def comparison_json(cmp: SnapshotComparison) -> dict:
    """JSON-ready comparison: {ok, tolerance, policy, snapshot, peak, phases, before, allocated, reserved,
    peak_phase: {predicted, measured}, by_origin, lines, extra}; each quantity is
    {predicted_bytes, measured_bytes, error_bytes, error_fraction, gated}."""
    return {
        "ok": cmp.ok, "failures": list(cmp.failures), "tolerance": cmp.tolerance, "policy": cmp.policy,
        "snapshot": cmp.snapshot,
        "peak": _quantity(cmp.peak),
        "peak_phase": {"predicted": cmp.predicted_peak_phase, "measured": cmp.measured_peak_phase},
        "phases": {q.name.removesuffix(" peak"): _quantity(q) for q in cmp.phases},
        "before": _quantity(cmp.before),
        "allocated": _quantity(cmp.allocated) if cmp.allocated else None,
        "reserved": _quantity(cmp.reserved),
        "by_origin": {q.name: _quantity(q) for q in cmp.by_origin},
        "lines": [{"line": r.label, "code": r.code, "predicted_bytes": r.predicted_bytes,
                   "measured_bytes": r.measured_bytes, "difference_bytes": r.difference_bytes} for r in cmp.lines],
        "extra": [{"label": label, "bytes": n} for label, n in cmp.extra],
    }


def device_memory_json(device: DeviceMemory) -> dict:
    return {"policy": device.policy, "peak_bytes": device.peak_bytes, "peak_phase": device.peak_phase,
            "phases": {k: {"peak_bytes": v} for k, v in device.phases.items()}, "before_bytes": device.before_bytes,
            "allocated_peak_bytes": device.allocated_peak_bytes, "reserved_peak_bytes": device.reserved_peak_bytes,
            "segments": device.segment_count, "warm_steps": device.warm_steps,
            "extra": [{"label": label, "bytes": n} for label, n in device.extra],
            "oom": None if device.oom is None else {"requested_bytes": device.oom.requested_bytes,
                                                    "device_free_bytes": device.oom.device_free_bytes,
                                                    "cached_free_bytes": device.oom.cached_free_bytes}}


def _quantity(q: Quantity) -> dict:
    frac = q.error_fraction
    return {"predicted_bytes": q.predicted_bytes, "measured_bytes": q.measured_bytes, "error_bytes": q.error_bytes,
            "error_fraction": None if frac in (float("inf"), float("-inf")) else frac, "gated": q.gated}


def _row(q: Quantity, tolerance: float | None) -> str:
    frac = q.error_fraction
    pct = "n/a" if frac in (float("inf"), float("-inf")) else f"{frac * 100:+.2f}%"
    mark = ""
    if tolerance is not None:
        mark = ("ok" if q.within(tolerance) else "BEYOND") if q.gated else "(info)"
    return (f"  {q.name:<28} {format_bytes(q.predicted_bytes):>14} {format_bytes(q.measured_bytes):>14} "
            f"{pct:>13} {mark:>8}")


def _signed(nbytes: int) -> str:
    return ("+" if nbytes > 0 else "-" if nbytes < 0 else "") + format_bytes(abs(nbytes))


def _grouped(extra: tuple[tuple[str, int], ...]) -> list[tuple[str, int]]:
    out: dict[str, list[int]] = {}
    for label, n in extra:
        out.setdefault(label, []).append(n)
    return [(f"{label} ({len(ns)} x {format_bytes(ns[0])})" if len(ns) > 1 else label, sum(ns))
            for label, ns in out.items()]
