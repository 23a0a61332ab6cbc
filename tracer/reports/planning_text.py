"""Terminal tables for the planning answers: what fits a budget (`render_fit`), per-rank memory under data
parallelism (`render_sharding`), and a deep model extrapolated from shallow copies (`render_depth`)."""
from __future__ import annotations

from tracer.reports.units import format_bytes, format_flops
from tracer.stepgraph import PHASE_NAMES


def render_fit(report) -> str:
    """One row per policy: the largest size, its peak (full analysis), the next size and its overflow; above
    the table, what the budget is made of and which peak it is judged by (on a CUDA target the caching
    allocator's reserved peak, with the requested one beside it)."""
    if report.dimension == "batch":
        what, fixed = "batch", f"seq {report.seq}"
    else:
        what, fixed = "seq", f"batch {report.batch}"
    target = report.budget_bytes - report.margin_bytes
    judged = "reserved" if report.cuda else "peak"
    lines = [f"largest {what} that fits {format_bytes(target)} ({target:,} B) at {fixed}",
             "  " + _fit_budget_words(report),
             "  " + _fit_peak_words(report),
             f"  {'policy':<12} {what:>8} {judged:>12} {'headroom':>12}   {'next':>8} {'its ' + judged:>12} {'over':>12}"
             + (f" {'requested':>12}" if report.cuda else "")]
    for label, r in report.results.items():
        value = r.reserved_bytes if report.cuda else r.peak_bytes
        next_value = r.next_reserved_bytes if report.cuda else r.next_peak_bytes
        if r.largest:
            fit = f"{r.largest:>8,} {format_bytes(value):>12} {format_bytes(target - value):>12}"
        else:
            fit = f"{'none':>8} {'':>12} {'':>12}"
        requested = f" {format_bytes(r.peak_bytes) if r.largest else '':>12}" if report.cuda else ""
        said = [*(["phase-peak fit"] if not r.per_op else []),
                *([f"corrected by {r.corrections}"] if r.corrections else []),
                *_reserved_search_words(r)]
        note = f"  ({', '.join(said)})" if said else ""
        lines.append(f"  {label:<12} {fit}   {r.next_size:>8,} {format_bytes(next_value):>12} "
                     f"{format_bytes(next_value - target):>12}{requested}{note}")
    lines.append(f"({report.analyses_run} analyses: {what} {', '.join(map(str, report.sample_sizes))} to fit each op's "
                 f"bytes, then each answer and the next {what} checked in full)")
    return "\n".join(lines) + "\n"


def _reserved_search_words(result) -> list[str]:
    """How the reserved peak's answer was searched: on steps synthesized from the samples first (then its
    answer and the next size analysed in full), and in full analyses beyond those two."""
    synthesized, searched = getattr(result, "reserved_synthesized", 0), result.reserved_searches
    if synthesized:
        return [f"reserved peak searched on {synthesized} steps synthesized from the samples"
                + (f", then in {searched} more analyses" if searched else "")]
    return [f"reserved peak searched in {searched} more analyses"] if searched else []


def _fit_budget_words(report) -> str:
    margin = f", less the {format_bytes(report.margin_bytes)} margin (--fit-margin)" if report.margin_bytes else ""
    if report.context_bytes is not None:
        nccl = (f" and {format_bytes(report.nccl_bytes)} for NCCL's buffers (--nccl-memory)"
                if report.nccl_bytes else "")
        total = report.budget_bytes + report.context_bytes + report.nccl_bytes
        return (f"budget: the GPU's reported total {format_bytes(total)} less "
                f"{format_bytes(report.context_bytes)} for the CUDA context (--cuda-context){nccl}{margin}")
    context = (" (for a whole GPU: its reported total less the CUDA context, about 512 MiB; --fit gpu takes it "
               "from --gpu)" if report.cuda else "")
    return f"budget: {format_bytes(report.budget_bytes)} as given{context}{margin}"


def _fit_peak_words(report) -> str:
    extra = f" + {format_bytes(report.extra_bytes)} of cuBLAS workspaces" if report.extra_bytes else ""
    if report.cuda:
        return ("judged by the reserved peak: the caching allocator's segments (what runs out on the device; "
                f"--alloc-conf changes it); requested: the bytes the step's tensors ask for at its peak{extra}")
    return f"judged by the peak: the bytes the step's tensors hold at its peak{extra}"


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
