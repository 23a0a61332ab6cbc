"""The terminal report of `tracer check`: verdict, the gated numbers that moved, and the diff tables
(lines, layers, bill categories at the peak) that account for the change."""
from __future__ import annotations

from tracer.checks.baseline import CheckResult, NumberChange, RowChange
from tracer.reports.units import format_bytes


def render_check(result: CheckResult, *, baseline_path: str = "baseline", top: int = 10) -> str:
    cfg = dict(result.config)
    tol = f"{100 * result.tolerance:g}%"
    out = [f"tracer check: {cfg.get('model')}  batch {cfg.get('batch')}  seq {cfg.get('seq')}  {cfg.get('precision')}"
           f"  optimizer {cfg.get('optimizer')}  {cfg.get('step')} step  against {baseline_path} (tolerance {tol})"]
    out += [f"note: {note}" for note in result.notes]
    if result.ok:
        peaks = [n for n in result.numbers if n.metric == "peak_bytes"]
        out.append(f"ok: no number grew beyond {tol} ("
                   + ", ".join(f"{n.policy} peak {format_bytes(n.current)}, baseline {format_bytes(n.baseline)}"
                               for n in peaks) + ")")
    else:
        out.append(f"REGRESSION: {len(result.regressions)} number(s) grew beyond {tol}")
        out += _number_table(result.regressions)
    if result.improvements:
        out.append(f"improved beyond {tol} (lock it in with --update-baseline):")
        out += _number_table(result.improvements)
    moved = {n.policy for n in result.regressions + result.improvements}
    for diff in result.diffs:
        if diff.policy not in moved:
            continue
        out += _row_table(f"{diff.policy}: lines at the peak that changed", diff.lines, top, with_code=True)
        out += _row_table(f"{diff.policy}: layers at the peak that changed", diff.layers, top)
        out += _row_table(f"{diff.policy}: bill at the peak", diff.categories, top, with_saved=False)
    return "\n".join(out) + "\n"


def _number_table(numbers: tuple[NumberChange, ...]) -> list[str]:
    rows = [f"  {'number':<36} {'baseline':>14} {'now':>14} {'change':>14}"]
    for n in numbers:
        fmt = format_bytes if n.metric.endswith("bytes") else (lambda v: f"{v:,}")
        growth = "new" if n.baseline == 0 else f"{100 * n.growth:+.1f}%"
        rows.append(f"  {n.name:<36} {fmt(n.baseline):>14} {fmt(n.current):>14} {_signed(n.delta, fmt):>14} ({growth})")
    return rows


def _row_table(title: str, rows: tuple[RowChange, ...], top: int, *, with_code: bool = False,
               with_saved: bool = True) -> list[str]:
    if not rows:
        return []
    head = f"  {'change':>14} {'now':>12}" + (f" {'saved change':>14}" if with_saved else "")
    out = ["", title + ":", head + ("  line" if with_code else "")]
    for r in rows[:top]:
        text = f"  {_signed(r.delta_bytes, format_bytes):>14} {format_bytes(r.current_bytes):>12}"
        if with_saved:
            text += f" {_signed(r.delta_saved, format_bytes):>14}"
        text += f"  {r.label}" + (f"  {r.code}" if with_code and r.code else "")
        out.append(text)
    if len(rows) > top:
        out.append(f"  ... {len(rows) - top} more")
    return out


def _signed(value: int, fmt) -> str:
    return ("+" if value >= 0 else "-") + fmt(abs(value))
