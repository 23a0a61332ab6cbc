"""Every output of one analysis, in one table: the files `--report DIR` writes and the single flag
(`--lines`, `--plot`, `--graph`, `--export-snapshot`) that writes one output alone. Adding an output is
one entry of OUTPUTS (and, when it has a flag, the flag in tracer.cli.args).

Contract:
    Rendering(analysis, *, policy="eager", layer=None, device_memory_bytes=None, top=None)
        One analysis and the settings its outputs are rendered with: the policy of the line table, the
        layer graph and the snapshot; the layer of the graph (None: the one holding most at the peak); the
        device-memory line of the timeline; the number of lines (None: every line). What several outputs
        share (the line table, the layer graph's DOT and SVG) is made once, when the first asks for it.
    OUTPUTS: tuple[Output, ...], in the order they are written
        Output.files     its files in the report folder: ReportFile(key, name, render), render(rendering)
                         -> the file's text or bytes, or None when it is not written
        Output.flag      the single flag that writes it alone, or None (only in the report);
                         Output.write(rendering, value): what the flag does with its value, write the PATH
                         given (or print, for a flag that is a switch: Output.switch)
        The outputs, with the file names of the report folder:
        report.html            self-contained HTML (tracer.reports.html_report)
        lines.txt, lines.json  the per-line table of `policy` (tracer.reports.line_table); --lines prints
                               lines.txt after an empty line
        timeline.png, .svg     the peak timeline, every policy (tracer.reports.timeline); --plot PATH writes
                               the same bytes as the file of PATH's suffix
        layer.dot              the layer graph (tracer.reports.layer_graph); --graph PATH.dot (or .gv) writes
                               the same bytes; --graph PATH.svg/.png/.pdf is graphviz's whole file (not in
                               the report)
        layer.svg              the layer graph's `<svg>` element, the one the HTML inlines; only when
                               graphviz `dot` is installed
        predicted_snapshot.pickle   the memory_viz export of `policy` (tracer.reports.memviz);
                               --export-snapshot PATH writes the same bytes
    write_report_dir(analysis, out_dir, *, policy="eager", layer=None, device_memory_bytes=None, top=None)
        -> dict[str, Path]
    creates `out_dir` if needed and writes every file of OUTPUTS, returning {key: path}. Existing files of
    those names are overwritten; nothing else in `out_dir` is touched. Every file is made in memory first
    (a failing graphviz writes nothing), then the folder is written whole or not at all
    (tracer.outputs.write_output_dir: a full disk leaves it as it was).
Raises UsageError when the directory cannot be created or written.
"""
from __future__ import annotations

import dataclasses
import functools
import json
import sys
from pathlib import Path
from typing import Any, Callable

from tracer.errors import UsageError
from tracer.outputs import write_output_dir
from tracer.passes.analysis import Analysis
from tracer.reports.html_report import render_html
from tracer.reports.layer_graph import dot_to_svg, render_layer_graph, write_layer_graph
from tracer.reports.line_table import LineTable, build_line_table, line_table_json, render_line_table
from tracer.reports.memviz import predicted_snapshot, snapshot_bytes, write_memviz_snapshot
from tracer.reports.timeline import render_timeline, timeline_image


@dataclasses.dataclass(frozen=True)
class Rendering:
    """One analysis and the settings its outputs are rendered with (module docstring)."""
    analysis: Analysis
    _: dataclasses.KW_ONLY
    policy: str = "eager"
    layer: str | None = None
    device_memory_bytes: int | None = None
    top: int | None = None

    @functools.cached_property
    def line_table(self) -> LineTable:
        return build_line_table(self.analysis, self.policy)

    @functools.cached_property
    def layer_dot(self) -> str:
        return render_layer_graph(self.analysis, self.layer, self.policy)

    @functools.cached_property
    def layer_svg(self) -> str | None:
        """The layer graph's `<svg>` element, None when graphviz is not installed. Made once: graphviz is
        the slowest renderer, and layer.svg and the HTML show the same graph."""
        return dot_to_svg(self.layer_dot)


@dataclasses.dataclass(frozen=True)
class ReportFile:
    """One file of the report folder."""
    key: str                                                # its key in write_report_dir's {key: path}
    name: str                                               # its file name in the folder
    render: Callable[[Rendering], str | bytes | None]      # None: not written


@dataclasses.dataclass(frozen=True)
class Output:
    """One output: its files in the report folder and the single flag that writes it alone."""
    files: tuple[ReportFile, ...]
    flag: str | None = None                                 # None: only in the report
    write: Callable[[Rendering, Any], None] | None = None   # what the flag does with its value
    switch: bool = False                                    # the flag takes no PATH


def _html(r: Rendering) -> str:
    return render_html(r.analysis, policy=r.policy, layer=r.layer, device_memory_bytes=r.device_memory_bytes,
                       top=r.top, graph_svg=r.layer_svg)


def _line_text(r: Rendering) -> str:
    return render_line_table(r.line_table, top=r.top)


def _print_line_text(r: Rendering, _switch: bool) -> None:
    sys.stdout.write("\n" + _line_text(r))                  # after the text report, an empty line between


def _line_json(r: Rendering) -> str:
    return json.dumps(line_table_json(r.line_table, top=r.top), indent=2) + "\n"


def _timeline(fmt: str) -> Callable[[Rendering], bytes]:
    return lambda r: timeline_image(r.analysis, fmt, device_memory_bytes=r.device_memory_bytes)[0]


def _write_timeline(r: Rendering, path: str) -> None:
    render_timeline(r.analysis, path, device_memory_bytes=r.device_memory_bytes)


def _write_layer_graph(r: Rendering, path: str) -> None:
    write_layer_graph(r.layer_dot, path)


def _snapshot(r: Rendering) -> bytes:
    return snapshot_bytes(predicted_snapshot(r.analysis, r.policy))


def _write_snapshot(r: Rendering, path: str) -> None:
    write_memviz_snapshot(r.analysis, path, policy=r.policy)


OUTPUTS = (
    Output((ReportFile("html", "report.html", _html),)),
    Output((ReportFile("lines_txt", "lines.txt", _line_text),), flag="--lines", write=_print_line_text,
           switch=True),
    Output((ReportFile("lines_json", "lines.json", _line_json),)),
    Output((ReportFile("timeline_png", "timeline.png", _timeline("png")),
            ReportFile("timeline_svg", "timeline.svg", _timeline("svg"))), flag="--plot", write=_write_timeline),
    Output((ReportFile("layer_dot", "layer.dot", lambda r: r.layer_dot),), flag="--graph",
           write=_write_layer_graph),
    # no flag: `--graph x.svg` writes graphviz's whole file (XML prolog and all), this is the element the HTML
    # inlines
    Output((ReportFile("layer_svg", "layer.svg", lambda r: r.layer_svg),)),
    Output((ReportFile("snapshot", "predicted_snapshot.pickle", _snapshot),), flag="--export-snapshot",
           write=_write_snapshot),
)


def write_report_dir(analysis: Analysis, out_dir, *, policy: str = "eager", layer: str | None = None,
                     device_memory_bytes: int | None = None, top: int | None = None) -> dict[str, Path]:
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise UsageError(f"the report directory {out} is a file", hint="name a folder for --report")
    rendering = Rendering(analysis, policy=policy, layer=layer, device_memory_bytes=device_memory_bytes, top=top)
    made = [(file, file.render(rendering)) for output in OUTPUTS for file in output.files]
    written = [(file, data) for file, data in made if data is not None]
    write_output_dir(out, {file.name: data for file, data in written}, what="the report directory")
    return {file.key: out / file.name for file, _ in written}
