"""HTML report: self-contained, escaped, every section; the report directory; and an end-to-end check in
headless Chromium (skipped when Debian's `chromium` is not installed: apt-get install chromium).

Set TRACER_SCREENSHOT_DIR to keep the Chromium screenshot of the llama-debug report there.
"""
from __future__ import annotations

import html.parser
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest
from synthetic import two_policies, with_recompute

from tracer.passes.attribution import CATEGORIES
from tracer.reports.html_report import render_html
from tracer.reports.layer_graph import build_layer_graph, dot_binary
from tracer.reports.line_table import build_line_table
from tracer.reports.report_dir import write_report_dir
from tracer.snapshots import read_snapshot

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                                                             "(Debian: apt-get install chromium)")
SECTIONS = ("summary", "timeline", "policies", "lines", "layer-graph")


class _Outline(html.parser.HTMLParser):
    """Counts what the checks need: elements by tag, rows per table id, sections, external references."""

    def __init__(self):
        super().__init__()
        self.tags: dict[str, int] = {}
        self.rows: dict[str, int] = {}
        self.sections: list[str] = []
        self.external: list[str] = []
        self.saved_edges = 0
        self._table: list[str] = []
        self._in_body = 0

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.tags[tag] = self.tags.get(tag, 0) + 1
        for key in ("src", "href", "xlink:href"):
            if re.match(r"(https?:)?//", a.get(key) or ""):
                self.external.append(a[key])
        if tag == "link" or (tag == "script" and "src" in a):
            self.external.append(tag)
        if tag == "section":
            self.sections.append(a.get("id", ""))
        if tag == "table":
            self._table.append(a.get("id", ""))
        if tag == "tbody":
            self._in_body += 1
        if tag == "tr" and self._in_body and self._table:
            self.rows[self._table[-1]] = self.rows.get(self._table[-1], 0) + 1
        if tag == "g" and "saved" in (a.get("class") or "").split():
            self.saved_edges += 1

    def handle_endtag(self, tag):
        if tag == "table" and self._table:
            self._table.pop()
        if tag == "tbody":
            self._in_body -= 1


def _outline(text: str) -> _Outline:
    parser = _Outline()
    parser.feed(text)
    return parser


def test_report_is_self_contained_with_every_section(llama_debug):
    text = render_html(llama_debug, device_memory_bytes=3 * 2**20)
    out = _outline(text)
    assert out.sections == list(SECTIONS)
    assert out.external == [] and "@import" not in text and not re.search(r"url\((?!['\"]?#)", text)
    assert out.tags["svg"] == (2 if dot_binary() else 1)
    assert out.rows["policy-table"] == len(llama_debug.policies)
    assert out.rows["line-table"] == len(build_line_table(llama_debug).rows)
    assert out.rows["bill"] == len(CATEGORIES)          # one row per category, caller_held included
    if dot_binary():
        assert out.saved_edges == len([e for e in build_layer_graph(llama_debug).edges if e.saved])
    else:
        assert "apt-get install graphviz" in text


def test_text_from_the_model_is_escaped(synthetic):
    text = render_html(synthetic)
    assert "# <keep>" not in text and "# &lt;keep&gt; &amp; &quot;quote&quot;" in text


def test_policy_table_has_one_row_per_policy_and_recompute_flops(synthetic):
    analysis = with_recompute(two_policies(synthetic, "full"), {"model.py:10": 128}, policy="full")
    out = _outline(render_html(analysis))
    assert out.rows["policy-table"] == 2
    text = render_html(analysis)
    table = text[text.index('id="policy-table"'):text.index("</table>", text.index('id="policy-table"'))]
    assert "recompute FLOPs" in table and 'data-sort="128">128 FLOP' in table
    assert ">full</td>" in table and ">eager</td>" in table


def test_report_dir_writes_every_file(synthetic, tmp_path):
    paths = write_report_dir(synthetic, tmp_path / "out", device_memory_bytes=1024)
    expected = {"html", "timeline_png", "timeline_svg", "lines_txt", "lines_json", "layer_dot", "snapshot"}
    assert expected <= set(paths) and all(p.exists() and p.stat().st_size for p in paths.values())
    assert ("layer_svg" in paths) == (dot_binary() is not None)
    assert json.loads(paths["lines_json"].read_text())["peak_bytes"] == 452
    assert read_snapshot(paths["snapshot"]).peak_bytes == 452
    assert paths["html"].read_text().count("<svg") == len([k for k in paths if k == "layer_svg"]) + 1


# ---------------------------------------------------------------------------------------------- Chromium

def _chromium(*args: str, timeout_s: float = 90.0) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
             f"--user-data-dir={profile}", *args], capture_output=True, text=True, timeout=timeout_s, check=False)


SORT_PROBE = """<script>
const th = [...document.querySelectorAll("#line-table th")].find((h) => h.textContent === "at peak");
const values = () => [...document.querySelectorAll("#line-table tbody tr")]
  .map((r) => Number(r.cells[th.cellIndex].dataset.sort));
th.click(); const first = values(); th.click(); const second = values();
document.body.dataset.sortDesc = JSON.stringify(first); document.body.dataset.sortAsc = JSON.stringify(second);
</script></body>"""


@needs_chromium
@pytest.mark.slow
def test_report_opens_and_renders_in_headless_chromium(llama_debug, tmp_path):
    report = write_report_dir(llama_debug, tmp_path / "report", device_memory_bytes=3 * 2**20)["html"]
    probe = tmp_path / "report" / "probe.html"
    probe.write_text(report.read_text().replace("</body>", SORT_PROBE, 1))

    proc = _chromium("--dump-dom", probe.as_uri())
    assert proc.returncode == 0, proc.stderr[-2000:]
    dom = proc.stdout
    out = _outline(dom)
    assert 'data-ready="1"' in dom                                 # the report's own script ran to the end
    assert out.sections == list(SECTIONS)
    assert out.tags.get("svg", 0) == (2 if dot_binary() else 1)
    assert out.tags.get("path", 0) > 50                            # the timeline's areas and axes
    assert out.rows["policy-table"] == len(llama_debug.policies) and out.rows["line-table"] > 10
    if dot_binary():
        assert out.saved_edges == len([e for e in build_layer_graph(llama_debug).edges if e.saved]) > 0
        assert out.tags.get("g", 0) > 100                          # graph nodes and edges
    desc = json.loads(re.search(r'data-sort-desc="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    asc = json.loads(re.search(r'data-sort-asc="([^"]*)"', dom).group(1).replace("&quot;", '"'))
    assert desc == sorted(desc, reverse=True) and asc == sorted(asc) and len(desc) == out.rows["line-table"]

    shot = tmp_path / "report.png"
    proc = _chromium("--window-size=1400,4000", f"--screenshot={shot}", report.as_uri())
    assert proc.returncode == 0 and shot.read_bytes()[:4] == b"\x89PNG", proc.stderr[-2000:]
    assert shot.stat().st_size > 100_000                           # a rendered page, not a blank one
    keep = os.environ.get("TRACER_SCREENSHOT_DIR")
    if keep:
        Path(keep).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(keep) / "report.png")
        shutil.copy(report, Path(keep) / "report.html")
