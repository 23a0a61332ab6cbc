"""The command line: report, JSON schema, and one clear line with a documented exit code on bad input."""
import json
import os
import subprocess
import sys

import pytest

from tracer.cli import main
from tracer.errors import ExitCode

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_report_and_json_schema(tmp_path, capsys, shared_analyses):
    out = tmp_path / "out.json"
    assert main(["llama-debug", "--seq", "32", "--json", str(out), "--quiet"]) == ExitCode.OK
    text = capsys.readouterr().out
    assert "peak:" in text and "bill at the peak:" in text and "top 10 lines" in text
    data = json.loads(out.read_text())
    assert data["schema_version"] == 1
    assert data["config"]["model"] == "llama-debug" and data["config"]["seq"] == 32
    eager = data["policies"]["eager"]
    assert set(eager["phases"]) == {"forward", "backward", "optimizer"}
    assert eager["peak_bytes"] == max(p["peak_bytes"] for p in eager["phases"].values())
    assert eager["peak_phase"] in eager["phases"]
    assert set(eager["by_category_at_peak"]) == {"parameter", "gradient", "optimizer_state", "activation",
                                                 "temporary", "input", "caller_held"}
    assert data["frozen_parameter_count"] == 0 and eager["frozen_parameter_bytes"] == 0
    assert sum(eager["by_category_at_peak"].values()) == eager["peak_bytes"]
    assert eager["saved_activation_bytes"] > 0
    line = eager["top_lines"][0]
    assert {"file", "line", "code", "bytes_at_peak", "saved_bytes"} <= set(line)


@pytest.mark.parametrize("argv,code,needle", [
    (["does/not/exist.py"], ExitCode.USAGE, "model file not found"),
    ([os.path.join(FIXTURES, "no_model.py")], ExitCode.USAGE, "defines no build_model()"),
    (["llama-3b"], ExitCode.USAGE, "valid zoo names"),
    ([os.path.join(FIXTURES, "raising_forward.py")], ExitCode.ANALYSIS, "raising_forward.py:12"),
    ([os.path.join(FIXTURES, "data_dependent.py"), "--capture", "export"], ExitCode.ANALYSIS, "data_dependent.py:13"),
])
def test_bad_input_gets_one_clear_line(argv, code, needle, capsys):
    assert main(argv + ["--seq", "4", "--quiet"]) == code
    err = capsys.readouterr().err.strip()
    assert needle in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err


def test_help_documents_every_flag():
    proc = subprocess.run([sys.executable, "-m", "tracer", "--help"], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0
    for flag in ("--batch", "--seq", "--precision", "--optimizer", "--foreach", "--step", "--zero-grad", "--json",
                 "--top", "--verbose", "--quiet"):
        assert flag in proc.stdout


@pytest.mark.slow
def test_readme_example_file_runs_as_written():
    proc = subprocess.run([sys.executable, "-m", "tracer", "examples/tiny_mlp_lm.py", "--seq", "128", "--batch", "4"],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    assert "peak:" in proc.stdout


SNAPSHOT = os.path.join(ROOT, "..", "shared", "snapshots", "cs336-medium-ctx128-fp32-train-step.pickle")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(SNAPSHOT), reason="../shared/snapshots is not beside the checkout")
def test_snapshot_subcommand_reads_a_real_snapshot(tmp_path, capsys):
    out = tmp_path / "snap.json"
    assert main(["snapshot", SNAPSHOT, "--json", str(out)]) == ExitCode.OK
    assert "peak live" in capsys.readouterr().out
    data = json.loads(out.read_text())
    from tracer.snapshots.reader import read_snapshot
    reading = read_snapshot(SNAPSHOT)                  # its numbers are checked against the raw trace elsewhere
    assert data["peak_bytes"] == reading.peak_bytes and data["peak_phase"] == reading.peak_phase


def test_snapshot_subcommand_missing_file(capsys):
    assert main(["snapshot", "nope.pickle"]) == ExitCode.USAGE
    assert "snapshot file not found" in capsys.readouterr().err


@pytest.mark.slow
def test_policy_table_and_json_per_policy(tmp_path, capsys):
    out = tmp_path / "p.json"
    assert main(["llama-debug", "--seq", "32", "--policy", "all", "--json", str(out), "--quiet"]) == ExitCode.OK
    text = capsys.readouterr().out
    for name in ("eager", "compiled", "selective", "full"):
        assert f"\n  {name} " in text
    policies = json.loads(out.read_text())["policies"]
    assert set(policies) == {"eager", "compiled", "selective", "full"}
    assert policies["eager"]["recompute_flops"] == 0 and policies["full"]["recompute_flops"] > 0
    assert policies["full"]["saved_activation_bytes"] < policies["eager"]["saved_activation_bytes"]
    assert all(p["step_flops"] > 0 for p in policies.values())


def test_unknown_save_policy_lists_the_valid_ones(capsys):
    assert main(["llama-debug", "--policy", "selective", "--save-policy", "most", "--quiet"]) == ExitCode.USAGE
    assert "matmul-attention" in capsys.readouterr().err


@pytest.mark.slow
def test_check_subcommand_and_save_baseline(tmp_path, capsys):
    baseline = tmp_path / "b.json"
    assert main(["llama-debug", "--seq", "32", "--quiet", "--save-baseline", str(baseline)]) == ExitCode.OK
    assert main(["check", "llama-debug", "--seq", "32", "--baseline", str(baseline)]) == ExitCode.OK
    assert main(["check", "llama-debug", "--baseline", str(baseline)]) == ExitCode.OK       # seq 32: the baseline's
    assert main(["check", "llama-debug", "--seq", "48", "--baseline", str(baseline)]) == ExitCode.BUDGET_EXCEEDED
    assert "seq (baseline 32, now 48): given on the command line" in capsys.readouterr().out


def test_export_failure_falls_back_and_says_so(capsys):
    assert main([os.path.join(FIXTURES, "data_dependent.py"), "--seq", "4", "--quiet"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "capture: dispatch" in out and "export failed" in out and "data_dependent.py:13" in out


@pytest.mark.slow
def test_fit_and_shard(capsys):
    assert main(["llama-debug", "--seq", "64", "--fit", "3MiB", "--quiet"]) == ExitCode.OK
    assert "largest batch that fits" in capsys.readouterr().out
    assert main(["llama-debug", "--seq", "64", "--shard", "zero3", "--quiet"]) == ExitCode.USAGE
    assert main(["llama-debug", "--seq", "64", "--shard", "zero3", "--world-size", "2", "--quiet"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert out.startswith("per rank: zero3 on 2 ranks")          # the per-rank view first, then the whole step
    assert out.index("bill at the peak:") > out.index("eager ")


@pytest.mark.slow
def test_outputs_go_to_folders_that_do_not_exist_yet(tmp_path):
    out = tmp_path / "new" / "deeper"
    assert main(["llama-debug", "--seq", "8", "--quiet", "--plot", str(out / "step.svg"),
                 "--json", str(out / "json" / "step.json")]) == ExitCode.OK
    assert (out / "step.svg").stat().st_size > 0 and (out / "json" / "step.json").stat().st_size > 0
