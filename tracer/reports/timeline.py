"""The peak timeline: live bytes while each op runs, stacked by bill category, one panel per policy.

Contract:
    build_timeline(analysis, policy) -> PolicyTimeline
        Pure. Bytes of each category (`tracer.passes.attribution.CATEGORIES`) live while op i runs, from
        the policy's liveness intervals and its category per storage: a storage counts at op i when
        alloc_op <= i <= free_op (pre-existing storages from op 0, persistent ones to the end), which is
        the liveness pass' own rule, so `total_bytes[i] == liveness.live_during[i]` and the maximum of the
        stack is the policy's peak. Phase bands are the runs of consecutive ops of one phase.
    timeline_figure(analysis, ...) -> matplotlib Figure
        One panel per policy (all of them unless `policies` names some), stacked areas, phase bands, the
        peak marked and labelled with its op and source line, a shared y axis in the unit that fits its top
        (`axis_unit`: MiB for a 44 MiB step, GiB for 3 GiB), and a dashed
        device-memory line when `device_memory_bytes` is given. Uses `matplotlib.figure.Figure` directly:
        no pyplot, no global state.
    render_timeline(analysis, path, ...) -> tuple[PolicyTimeline, ...]
        Writes PNG or SVG by the suffix of `path` (or `fmt`) and returns the data it plotted.
    timeline_svg(analysis, ...) -> str
        The figure as one `<svg>` element (text kept as text) for inlining into HTML.
    Long steps are drawn in bins of ops (at most `max_points` per panel), each bin at its op with the most
    live bytes, so the drawn maximum stays exactly the peak (`drawn_points`).

The x axis is the op index in execution order, not time: ops are not timed. Not shown: kernel-internal
scratch buffers (not modelled by the liveness pass), allocator rounding and caching (see the memory_viz
export for the allocator's view).
"""
from __future__ import annotations

import dataclasses
import io
import os

from tracer.errors import UsageError
from tracer.passes.analysis import Analysis
from tracer.passes.attribution import CATEGORIES
from tracer.passes.liveness import BEFORE_STEP
from tracer.reports.line_table import model_dir, short_path
from tracer.reports.policy_view import policy_graph, policy_result
from tracer.reports.units import byte_unit, format_bytes

CATEGORY_COLORS = {"parameter": "#4c72b0", "gradient": "#dd8452", "optimizer_state": "#8172b3",
                   "activation": "#c44e52", "temporary": "#ccb974", "input": "#64b5cd", "caller_held": "#8c8c8c"}
PHASE_COLORS = {"forward": "#e3ecf9", "backward": "#fbe9dc", "optimizer": "#ececec", "recompute": "#e2f4e4"}
FORMATS = ("png", "svg")


@dataclasses.dataclass(frozen=True)
class PhaseBand:
    phase: str
    first_op: int
    last_op: int                      # inclusive


@dataclasses.dataclass(frozen=True)
class PolicyTimeline:
    policy: str
    bytes_by_category: dict[str, tuple[int, ...]]   # category -> bytes live while op i runs
    total_bytes: tuple[int, ...]
    bands: tuple[PhaseBand, ...]
    peak_bytes: int
    peak_op_index: int
    peak_label: str                   # "peak 1.23 GiB in backward\n#186 aten.mm.default\nmodel.py:12  code"

    @property
    def op_count(self) -> int:
        return len(self.total_bytes)


def build_timeline(analysis: Analysis, policy: str = "eager") -> PolicyTimeline:
    result = policy_result(analysis, policy)
    graph = policy_graph(analysis, result)
    n = len(result.liveness.live_during)
    delta = {cat: [0] * (n + 1) for cat in CATEGORIES}
    for iv in result.liveness.intervals:
        if iv.alloc_op is None or iv.nbytes == 0 or n == 0:
            continue
        cat = result.categories[iv.storage_id]
        start = 0 if iv.alloc_op == BEFORE_STEP else iv.alloc_op
        stop = n if iv.free_op is None else iv.free_op + 1
        delta.setdefault(cat, [0] * (n + 1))
        delta[cat][start] += iv.nbytes
        delta[cat][stop] -= iv.nbytes
    by_category = {}
    for cat, steps in delta.items():
        running, series = 0, []
        for i in range(n):
            running += steps[i]
            series.append(running)
        by_category[cat] = tuple(series)
    total = tuple(sum(col) for col in zip(*by_category.values())) if n else ()
    op = result.peak_op
    where = f"\n{short_path(op.source.file, model_dir(analysis.graph.config.model))}:{op.source.line}  {_clip(op.source.code, 60)}" if op.source else ""
    label = f"peak {format_bytes(result.peak_bytes)} in {result.peak_phase}\n#{op.index} {op.target}{where}"
    return PolicyTimeline(policy=policy, bytes_by_category=by_category, total_bytes=total,
                          bands=phase_bands(graph.ops[:n]), peak_bytes=result.peak_bytes,
                          peak_op_index=op.index, peak_label=label)


def phase_bands(ops) -> tuple[PhaseBand, ...]:
    bands: list[PhaseBand] = []
    for op in ops:
        phase = getattr(op.phase, "value", op.phase)
        if bands and bands[-1].phase == phase and bands[-1].last_op == op.index - 1:
            bands[-1] = PhaseBand(phase, bands[-1].first_op, op.index)
        else:
            bands.append(PhaseBand(phase, op.index, op.index))
    return tuple(bands)


def timeline_figure(analysis: Analysis, *, policies: list[str] | None = None,
                    device_memory_bytes: int | None = None, max_points: int = 2000, width_in: float = 12.0,
                    panel_height_in: float = 3.6):
    """A matplotlib Figure with one panel per policy; returns (figure, timelines). Panels with more than
    `max_points` ops draw bins of ops, each at its op with the most live bytes (`drawn_points`)."""
    from matplotlib.figure import Figure

    names = list(policies) if policies else list(analysis.policies)
    timelines = tuple(build_timeline(analysis, name) for name in names)
    fig = Figure(figsize=(width_in, panel_height_in * len(timelines) + 0.6), layout="constrained")
    axes = fig.subplots(len(timelines), 1, sharey=True, squeeze=False)[:, 0]
    unit = axis_unit(timelines, device_memory_bytes)
    for ax, tl in zip(axes, timelines):
        _draw_panel(ax, tl, device_memory_bytes, max_points, unit)
    top_bytes = max([t.peak_bytes for t in timelines] + [device_memory_bytes or 0])
    axes[0].set_ylim(0, top_bytes / unit[1] * PEAK_HEADROOM or 1.0)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(len(labels), 8), fontsize=8, frameon=False)
    cfg = analysis.graph.config
    fig.suptitle(f"{cfg.model}: live memory over one training step (batch {cfg.batch}, {cfg.size_words}, "
                 f"{cfg.precision}, optimizer {cfg.optimizer})", fontsize=10)
    return fig, timelines


def axis_unit(timelines, device_memory_bytes: int | None = None) -> tuple[str, int]:
    """(name, bytes per unit) of the shared y axis: the unit of the largest value drawn (format_bytes' rule)."""
    return byte_unit(max([t.peak_bytes for t in timelines] + [device_memory_bytes or 0]))


def drawn_points(tl: PolicyTimeline, max_points: int) -> tuple[list[int], dict[str, list[int]]]:
    """What a panel draws: bin edges and, per category, the bytes of the op with the largest total in each
    bin (all ops when there are at most `max_points`), so the drawn maximum is exactly the peak."""
    n = tl.op_count
    width = max(1, -(-n // max(1, max_points)))
    edges, picks = [], []
    for start in range(0, n, width):
        stop = min(n, start + width)
        picks.append(max(range(start, stop), key=lambda i: (tl.total_bytes[i], -i)))
        edges.append(start)
    edges.append(n)
    return edges, {cat: [series[i] for i in picks] for cat, series in tl.bytes_by_category.items()}


# the y axis reaches this multiple of the highest peak (or the device line): the peak's label box sits above
# its marker and below the phases' names at the top of the panel
PEAK_HEADROOM = 1.5


def _draw_panel(ax, tl: PolicyTimeline, device_memory_bytes: int | None, max_points: int,
                unit: tuple[str, int]) -> None:
    n = tl.op_count
    unit_name, unit_bytes = unit
    xs, drawn = drawn_points(tl, max_points)                 # bin k spans [xs[k], xs[k + 1])
    ys = [[v / unit_bytes for v in values] + [values[-1] / unit_bytes if values else 0.0] for values in drawn.values()]
    for band in tl.bands:
        ax.axvspan(band.first_op, band.last_op + 1, color=PHASE_COLORS.get(band.phase, "#f5f5f5"), lw=0, zorder=0)
    seen = set()
    for band in sorted(tl.bands, key=lambda b: b.first_op - b.last_op):   # label each phase once, widest run
        if band.phase not in seen and (band.last_op - band.first_op + 1) >= 0.04 * max(n, 1):
            seen.add(band.phase)
            ax.text((band.first_op + band.last_op + 1) / 2, 0.97, band.phase, transform=ax.get_xaxis_transform(),
                    ha="center", va="top", fontsize=8, color="#555555")
    ax.stackplot(xs, ys, labels=[c.replace("_", " ") for c in drawn],
                 colors=[CATEGORY_COLORS.get(c, "#999999") for c in drawn],
                 step="post", lw=0, zorder=2)
    peak_x, peak_y = tl.peak_op_index + 0.5, tl.peak_bytes / unit_bytes
    ax.plot([peak_x], [peak_y], marker="v", color="black", ms=7, zorder=4, label="peak")
    ax.annotate(tl.peak_label, xy=(peak_x, peak_y), xytext=(0.5 if peak_x < 0.6 * n else -0.5, 0.0),
                textcoords="offset fontsize", ha="left" if peak_x < 0.6 * n else "right", va="bottom",
                fontsize=7.5, zorder=5, bbox={"boxstyle": "round,pad=0.3", "fc": "white", "ec": "#888888",
                                               "alpha": 0.9})
    if device_memory_bytes:
        ax.axhline(device_memory_bytes / unit_bytes, color="#d62728", ls="--", lw=1.2, zorder=3,
                   label=f"device memory {format_bytes(device_memory_bytes)}")
    ax.set_xlim(0, max(n, 1))
    ax.set_title(f"policy {tl.policy}", fontsize=9, loc="left")
    ax.set_ylabel(f"live memory ({unit_name})", fontsize=8)
    ax.set_xlabel("op index (execution order)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.yaxis.set_major_formatter("{x:.3g}")


def render_timeline(analysis: Analysis, path, *, device_memory_bytes: int | None = None,
                    policies: list[str] | None = None, fmt: str | None = None, dpi: int = 120):
    """Write the timeline to `path` as PNG or SVG (from the suffix unless `fmt` is given).

    Returns the `PolicyTimeline`s plotted. Raises UsageError for another suffix or an unwritable path.
    """
    from tracer.outputs import write_output

    fmt = (fmt or os.path.splitext(str(path))[1].lstrip(".")).lower()
    if fmt not in FORMATS:
        raise UsageError(f"cannot write the timeline as {path}: use a .png or .svg file name")
    data, timelines = timeline_image(analysis, fmt, device_memory_bytes=device_memory_bytes, policies=policies,
                                     dpi=dpi)
    write_output(path, data, what="the timeline")
    return timelines


def timeline_image(analysis: Analysis, fmt: str, *, device_memory_bytes: int | None = None,
                   policies: list[str] | None = None, dpi: int = 120) -> tuple[bytes, list]:
    """The timeline as PNG or SVG bytes, and the `PolicyTimeline`s plotted."""
    fig, timelines = timeline_figure(analysis, policies=policies, device_memory_bytes=device_memory_bytes)
    buf = io.BytesIO()
    _save(fig, buf, fmt, dpi)
    return buf.getvalue(), timelines


def timeline_svg(analysis: Analysis, *, device_memory_bytes: int | None = None,
                 policies: list[str] | None = None, max_points: int = 400) -> str:
    fig, _ = timeline_figure(analysis, policies=policies, device_memory_bytes=device_memory_bytes,
                             max_points=max_points)
    buf = io.BytesIO()
    _save(fig, buf, "svg", 100)
    text = buf.getvalue().decode("utf-8")
    return text[text.index("<svg"):]


def _save(fig, target, fmt: str, dpi: int) -> None:
    import matplotlib

    metadata = {"Date": None} if fmt == "svg" else {"Software": None}
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "tracer"}):
        fig.savefig(target, format=fmt, dpi=dpi, metadata=metadata)


def _clip(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[:width - 3] + "..."
