"""Terminal tables for the planning answers: what fits a budget (`render_fit`), per-rank memory under data
parallelism (`render_sharding`), and a deep model extrapolated from shallow copies (`render_depth`)."""
from __future__ import annotations

from tracer.reports.units import format_bytes, format_flops
from tracer.stepgraph import PHASE_NAMES


def render_fit(report) -> str:
    """One row per policy: the largest size, its peak (full analysis), the next size and its overflow."""
    if report.dimension == "batch":
        what, fixed = "batch", f"seq {report.seq}"
    else:
        what, fixed = "seq", f"batch {report.batch}"
    lines = [f"largest {what} that fits {format_bytes(report.budget_bytes)} ({report.budget_bytes:,} B) at {fixed}",
             f"  {'policy':<12} {what:>8} {'peak':>12} {'headroom':>12}   {'next':>8} {'its peak':>12} {'over':>12}"]
    for label, r in report.results.items():
        if r.largest:
            fit = f"{r.largest:>8,} {format_bytes(r.peak_bytes):>12} {format_bytes(report.budget_bytes - r.peak_bytes):>12}"
        else:
            fit = f"{'none':>8} {'':>12} {'':>12}"
        over = format_bytes(r.next_peak_bytes - report.budget_bytes)
        note = "" if r.per_op and not r.corrections else "  (phase-peak fit" + (
            f", corrected by {r.corrections}" if r.corrections else "") + ")"
        lines.append(f"  {label:<12} {fit}   {r.next_size:>8,} {format_bytes(r.next_peak_bytes):>12} {over:>12}{note}")
    lines.append(f"({report.analyses_run} analyses: {what} {', '.join(map(str, report.sample_sizes))} to fit each op's "
                 f"bytes, then each answer and the next {what} checked in full)")
    return "\n".join(lines) + "\n"


def render_sharding(sharded: dict, *, single_device_peaks: dict[str, int] | None = None) -> str:
    """One row per policy: rank 0's peak, its phase, the model state per rank and the bill at the peak."""
    first = next(iter(sharded.values()))
    lines = [f"per rank: {first.strategy} on {first.world_size} ranks (rank 0, the largest shard)",
             f"  {'policy':<12} {'peak':>12} {'phase':<10} {'params':>12} {'grads':>12} {'opt state':>12}"
             + (f" {'1 device':>12}" if single_device_peaks else "")]
    for label, m in sharded.items():
        state = m.model_state_bytes
        single = f" {format_bytes(single_device_peaks[label]):>12}" if single_device_peaks else ""
        lines.append(f"  {label:<12} {format_bytes(m.peak_bytes):>12} {m.peak_phase:<10} "
                     f"{format_bytes(state['parameter']):>12} {format_bytes(state['gradient']):>12} "
                     f"{format_bytes(state['optimizer_state']):>12}{single}")
    for label, m in sharded.items():
        bill = "  ".join(f"{name} {format_bytes(b)}" for name, b in m.by_category_at_peak.items() if b)
        lines.append(f"  at the {label} peak: {bill}")
    return "\n".join(lines) + "\n"


def render_depth(report, *, top: int = 5) -> str:
    """The extrapolated step per policy, with the bill and top lines at the peak."""
    lines = [f"{report.model}: {report.depth} blocks in {report.block_list}, extrapolated from the model cut to "
             f"{', '.join(map(str, report.sample_depths))} blocks",
             f"  {'policy':<12} {'peak':>12} {'phase':<10} {'forward':>12} {'backward':>12} {'optimizer':>12} "
             f"{'saved':>12} {'recompute':>10}"]
    for label, e in report.policies.items():
        phases = [format_bytes(e.phases[p]) if p in e.phases else "-" for p in PHASE_NAMES]
        lines.append(f"  {label:<12} {format_bytes(e.peak_bytes):>12} {e.peak_phase:<10} "
                     + " ".join(f"{p:>12}" for p in phases)
                     + f" {format_bytes(e.saved_activation_bytes):>12} {format_flops(e.recompute_flops):>10}")
    for label, e in report.policies.items():
        where = f" in {e.peak_block}" if e.peak_block else ""
        lines.append(f"  {label} peak at {e.peak_op.target}{where}: "
                     + "  ".join(f"{name} {format_bytes(b)}" for name, b in e.by_category_at_peak.items() if b))
        for label_, nbytes in e.lines_at_peak[:top]:
            lines.append(f"      {format_bytes(nbytes):>12}  {label_}")
    return "\n".join(lines) + "\n"
