"""The what-if table of `--levers` (tracer/levers.py): one row per lever, and with `--fit`, the largest
batch per lever; `levers_json` is the same table as JSON."""
from __future__ import annotations

from tracer.reports.units import format_bytes, format_flops


def render_levers(table, *, world_size: int | None = None) -> str:
    base = table.baseline
    lines = [f"what-if: one row per lever, each a full analysis of the step ({table.captures} captures)",
             f"  {'lever':<36} {'peak':>12} {'vs baseline':>12} {'saved act.':>12} {'state':>12} "
             f"{'recompute':>13} {'host':>11}  fits"]
    for row in table.rows:
        if row.options is None:
            lines.append(f"  {row.lever:<36} {'-':>12}   n/a: {row.reason}")
            continue
        change = (100.0 * (row.peak_bytes - base.peak_bytes) / base.peak_bytes) if base.peak_bytes else 0.0
        host = format_bytes(row.host_bytes) if row.host_bytes is not None else "-"
        fits = "-" if row.out_of_memory is None else ("OOM" if row.out_of_memory else "yes")
        lines.append(f"  {row.lever:<36} {format_bytes(row.peak_bytes):>12} {change:>+11.1f}% "
                     f"{format_bytes(row.saved_bytes):>12} {format_bytes(row.state_bytes):>12} "
                     f"{format_flops(row.recompute_flops):>13} {host:>11}  {fits}")
    lines.append("(peak: per rank under sharding; state: parameters, gradients and optimizer state on the device at "
                 "the peak; accumulation keeps the global batch: micro-batch = batch / steps)")
    return "\n".join(lines) + "\n"


def render_lever_fits(fits, *, budget_bytes: int, seq: int) -> str:
    lines = [f"largest batch per lever that fits {format_bytes(budget_bytes)} at seq {seq}",
             f"  {'lever':<36} {'batch':>8} {'peak':>12}"]
    for fit in fits:
        if fit.largest_batch is None:
            lines.append(f"  {fit.lever:<36} {'-':>8}   n/a: {fit.reason}")
        elif fit.largest_batch == 0:
            lines.append(f"  {fit.lever:<36} {'none':>8}")
        else:
            lines.append(f"  {fit.lever:<36} {fit.largest_batch:>8,} {format_bytes(fit.peak_bytes):>12}")
    lines.append("(accumulation: the largest micro-batch; sharding: per rank)")
    return "\n".join(lines) + "\n"


def levers_json(table) -> dict:
    return {"levers": [{"lever": row.lever, "applies": row.options is not None, "reason": row.reason,
                        "peak_bytes": row.peak_bytes, "saved_activation_bytes": row.saved_bytes,
                        "state_bytes": row.state_bytes, "host_bytes": row.host_bytes,
                        "recompute_flops": row.recompute_flops, "out_of_memory": row.out_of_memory,
                        "settings": row.options.settings() if row.options is not None else None}
                       for row in table.rows],
            "captures": table.captures}
