"""Per-line attribution table: goldens for text and JSON, layer grouping, FLOPs, the recompute column."""
from __future__ import annotations

import json

from golden_files import check_golden
from synthetic import with_recompute

from tracer.passes.flops import op_flops
from tracer.reports.line_table import build_line_table, group_layer_names, line_table_html, line_table_json, \
    render_line_table


def test_text_and_json_goldens(synthetic):
    table = build_line_table(with_recompute(synthetic, {"model.py:10": 128}))
    check_golden("line_table.txt", render_line_table(table))
    check_golden("line_table.json", json.dumps(line_table_json(table), indent=2) + "\n")


def test_rows_agree_with_the_attribution_and_flops(synthetic):
    result = synthetic.policies["eager"]
    table = build_line_table(synthetic)
    rows = {r.label: r for r in table.rows}
    for line in result.at_peak.lines:
        assert (rows[line.label].bytes_at_peak, rows[line.label].saved_bytes) == (line.bytes_at_peak, line.saved_bytes)
    assert sum(r.bytes_at_peak for r in table.rows) == result.peak_bytes
    for label, row in rows.items():
        ops = [op for op in synthetic.graph.ops if op.source and f"{op.source.file}:{op.source.line}" == label]
        assert row.flops == sum(op_flops(op) or 0 for op in ops)
    assert rows["model.py:10"].flops == 5 * 2 * 2 * 4 * 4          # 2 forward + 3 backward matmuls of 2x4x4
    assert rows["model.py:10"].layers == "blocks.0-1, x2"
    assert rows["model.py:20"].layers == "" and rows["train.py:30"].flops == 2 * 32
    assert rows["model.py:20"].unknown_flop_ops == 1 and rows["model.py:10"].unknown_flop_ops == 0


def test_recompute_column_only_when_the_policy_has_it(synthetic):
    without = build_line_table(with_recompute(synthetic, None))
    assert not without.has_recompute_flops and all(r.recompute_flops is None for r in without.rows)
    assert "recompute" not in render_line_table(without)
    assert all("recompute_flops" not in row for row in line_table_json(without)["rows"])
    assert "recompute FLOPs" not in line_table_html(without)
    with_ = build_line_table(with_recompute(synthetic, {"model.py:11": 7}))
    assert {r.label: r.recompute_flops for r in with_.rows}["model.py:11"] == 7
    assert "recompute FLOPs" in line_table_html(with_)


def test_repeated_blocks_are_grouped():
    assert group_layer_names([f"blocks.{i}" for i in range(10)]) == "blocks.0-9, x10"
    assert group_layer_names(["blocks.3"]) == "blocks.3"
    assert group_layer_names(["norm", "blocks.1", "blocks.0", "lm_head"]) == "blocks.0-1, x2; lm_head; norm"
    assert group_layer_names(["h.0", "h.2", "h.3", "h.7"]) == "h.0,2-3,7, x4"
    assert group_layer_names(["enc.0", "dec.0", "dec.1"]) == "dec.0-1, x2; enc.0"
    assert group_layer_names([]) == ""


def test_html_table_is_sortable_and_escaped(synthetic):
    text = line_table_html(build_line_table(synthetic))
    assert text.startswith('<table class="sortable" id="line-table">')
    assert text.count("<tr>") == 1 + len(build_line_table(synthetic).rows)
    assert "&lt;keep&gt; &amp; &quot;quote&quot;" in text and "<keep>" not in text
    assert 'data-sort="452"' not in text and 'data-sort="96"' in text


def test_llama_debug_lines_group_the_blocks(llama_debug):
    table = build_line_table(llama_debug)
    by_code = {r.source.code.strip(): r for r in table.rows if r.source}
    mlp = next(r for code, r in by_code.items() if code.startswith("return self.w2("))
    assert mlp.layers == "blocks.0-1, x2" and mlp.flops > 0 and mlp.saved_bytes > 0
    assert sum(r.bytes_at_peak for r in table.rows) == llama_debug.policies["eager"].peak_bytes


def test_paths_print_from_the_package_root_the_working_directory_or_the_model_files_directory(tmp_path,
                                                                                                  monkeypatch):
    """Installed packages from their root; files under the working directory relative to it; a model file
    run from elsewhere, and the files beside it, relative to the model file's directory; anything else as
    given."""
    from tracer.reports.line_table import model_dir, short_label, short_path
    project = tmp_path / "project"
    (project / "layers").mkdir(parents=True)
    (project / "model.py").write_text("")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    here = model_dir(str(project / "model.py"))
    assert here == str(project) and model_dir("llama-debug") is None
    assert short_path("/usr/lib/python3/site-packages/torch/optim/adam.py", here) == "torch/optim/adam.py"
    assert short_path(str(project / "layers" / "attention.py"), here) == "layers/attention.py"
    assert short_label(f"{project / 'model.py'}:12", here) == "model.py:12"
    assert short_path(str(elsewhere / "run.py"), here) == "run.py"
    assert short_path("/opt/other/thing.py", here) == "/opt/other/thing.py"
    assert short_label("(parameters)", here) == "(parameters)"
