"""Peak timeline: per-op stacked bytes equal the liveness sums; the drawn maximum is the analysis' peak."""
from __future__ import annotations

import pytest
from synthetic import two_policies

from tracer.errors import UsageError
from tracer.passes.attribution import CATEGORIES
from tracer.reports.timeline import (PEAK_HEADROOM, axis_unit, build_timeline, drawn_points, render_timeline, timeline_figure,
                                     timeline_svg)


def _drawn_max_bytes(ax, unit_bytes: int) -> float:
    """Top of the stacked areas as drawn (data coordinates, in the axis unit -> bytes)."""
    tops = [path.vertices[:, 1].max() for coll in ax.collections for path in coll.get_paths() if len(path.vertices)]
    return max(tops) * unit_bytes


def test_stack_equals_live_bytes_per_op(synthetic):
    result = synthetic.policies["eager"]
    tl = build_timeline(synthetic)
    assert set(tl.bytes_by_category) == set(CATEGORIES)
    assert tl.total_bytes == result.liveness.live_during
    assert max(tl.total_bytes) == tl.peak_bytes == result.peak_bytes
    for i in range(tl.op_count):                 # each category: its storages live at op i, counted directly
        live = result.liveness.live_storages_at(i)
        for cat in CATEGORIES:
            expected = sum(synthetic.graph.storage(s).nbytes for s in live if result.categories[s] == cat)
            assert tl.bytes_by_category[cat][i] == expected
    assert [(b.phase, b.first_op, b.last_op) for b in tl.bands] == [
        ("forward", 0, 6), ("backward", 7, 13), ("optimizer", 14, 15)]


def test_binned_drawing_keeps_the_exact_peak(synthetic):
    tl = build_timeline(synthetic)
    for max_points in (1, 2, 3, 5, 100):
        edges, drawn = drawn_points(tl, max_points)
        totals = [sum(col) for col in zip(*drawn.values())]
        assert max(totals) == tl.peak_bytes
        assert edges[0] == 0 and edges[-1] == tl.op_count and len(edges) == len(totals) + 1


def test_llama_debug_plot_peak_equals_analysis_peak(llama_debug, tmp_path):
    result = llama_debug.policies["eager"]
    fig, (tl,) = timeline_figure(llama_debug, device_memory_bytes=3 * 2**20)
    ax = fig.axes[0]
    unit_name, unit_bytes = axis_unit((tl,), 3 * 2**20)
    assert ax.get_ylabel() == f"live memory ({unit_name})"
    assert _drawn_max_bytes(ax, unit_bytes) == result.peak_bytes      # a power of two: the division is exact
    assert max(tl.total_bytes) == result.peak_bytes
    device_lines = [line for line in ax.lines if list(line.get_ydata()) == [3 * 2**20 / unit_bytes] * 2]
    assert len(device_lines) == 1
    labels = [t.get_text() for t in ax.texts]
    peak_label = next(t for t in labels if t.startswith("peak "))
    op = result.peak_op
    assert op.target in peak_label and f"llama.py:{op.source.line}" in peak_label
    assert {"forward", "backward", "optimizer"} <= set(labels)

    # the peak's label and the phases' names never cover each other
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    renderer = FigureCanvasAgg(fig).get_renderer()
    fig.draw(renderer)
    label_box = next(t for t in ax.texts if t.get_text().startswith("peak ")).get_window_extent(renderer)
    for name in (t for t in ax.texts if t.get_text() in ("forward", "backward", "optimizer")):
        assert not label_box.overlaps(name.get_window_extent(renderer)), name.get_text()

    png, svg = tmp_path / "t.png", tmp_path / "t.svg"
    (written,) = render_timeline(llama_debug, png)
    assert written.peak_bytes == result.peak_bytes
    render_timeline(llama_debug, svg)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert svg.read_text().lstrip().startswith("<?xml") and "<svg" in svg.read_text()


def test_one_panel_per_policy_on_a_shared_y_axis(synthetic):
    two = two_policies(synthetic, "full")
    fig, timelines = timeline_figure(two)
    assert [t.policy for t in timelines] == ["eager", "full"]
    assert len(fig.axes) == 2
    assert fig.axes[0].get_shared_y_axes().joined(fig.axes[0], fig.axes[1])
    for ax, tl in zip(fig.axes, timelines):
        assert _drawn_max_bytes(ax, axis_unit(timelines)[1]) == tl.peak_bytes
        assert ax.get_title(loc="left") == f"policy {tl.policy}"


def test_svg_for_html_is_one_element_with_text(synthetic):
    svg = timeline_svg(synthetic)
    assert svg.startswith("<svg") and svg.rstrip().endswith("</svg>")
    assert "peak 452 B in backward" in svg                       # text kept as text (svg.fonttype none)


def test_unknown_suffix_and_policy_are_usage_errors(synthetic, tmp_path):
    with pytest.raises(UsageError, match=r"\.png or \.svg"):
        render_timeline(synthetic, tmp_path / "t.jpg")
    with pytest.raises(UsageError, match="unknown policy 'full'; this analysis has: eager"):
        build_timeline(synthetic, "full")


@pytest.mark.parametrize("peak_bytes, device_bytes, unit", [
    (44 * 2**20, None, "MiB"),             # a 44 MiB step: a 0..52 MiB axis, not 0.01..0.05 GiB
    (3 * 2**30, None, "GiB"),
    (44 * 2**20, 80 * 2**30, "GiB"),       # the device-memory line is drawn too: the axis must reach it
    (452, None, "B"),
    (1024, None, "KiB"),
])
def test_the_axis_unit_fits_the_largest_value_drawn(peak_bytes, device_bytes, unit):
    class Drawn:                            # axis_unit reads only the peak of each timeline
        pass
    timeline = Drawn()
    timeline.peak_bytes = peak_bytes
    assert axis_unit((timeline,), device_bytes)[0] == unit


def test_the_synthetic_step_is_plotted_in_bytes(synthetic):
    fig, (tl,) = timeline_figure(synthetic)
    ax = fig.axes[0]
    assert tl.peak_bytes == 452 and ax.get_ylabel() == "live memory (B)"
    assert _drawn_max_bytes(ax, 1) == 452 and ax.get_ylim()[1] == pytest.approx(452 * PEAK_HEADROOM)
