"""`tracer check` and baselines: regressions injected into tests/fixtures/check_base.py are caught, and the
diff table names the responsible line; the unchanged model passes; analyses are deterministic.

Every case edits a copy of the fixture's text and writes it as `model.py` in its own directory (a user
editing their model file; a different checkout than the one that saved the baseline), then runs
`check_main` there. Model options for all: batch 2, seq 64, bf16 autocast, the CPU target.
"""
import json
import os

import pytest
import torch

import tracer
from tracer.checks import check_main, compare_to_baseline, load_baseline, parse_tolerance, save_baseline
from tracer.checks.baseline import baseline_json
from tracer.errors import ExitCode, UsageError

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
BASE = os.path.join(FIXTURES, "check_base.py")
ARGV = ["--seq", "64", "--precision", "bf16", "--target", "cpu"]     # the CPU step (diff tables pinned to its peak)
OPTIONS = dict(batch=2, seq=64, precision="bf16", target="cpu")
B, S, D, H, LAYERS = 2, 64, 64, 256, 2                    # check_base.py sizes at these options

# the command line and the API analyse the same model.py with the same options: one capture (tests/conftest.py)
pytestmark = pytest.mark.usefixtures("shared_analyses")

GELU = "        h = F.gelu(h)                                        # (b, s, hidden)\n"
EDITS = {
    "attribute_cache": (GELU, GELU + "        self.cache = h\n"),            # kept on the module across the step
    "wide_mlp": ("HIDDEN = 256\n", "HIDDEN = 512\n"),
    "upcast": ("h = F.gelu(h)  ", "h = F.gelu(h.float())  "),
    "checkpointed": ("x = block(x)  ", "x = checkpoint(block, x, use_reentrant=False)  "),
}


def write_model(directory, edit: str | None = None):
    text = open(BASE).read()
    if edit is not None:
        old, new = EDITS[edit]
        assert text.count(old) == 1, f"edit {edit!r} no longer matches check_base.py"
        text = text.replace(old, new)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.py").write_text(text)
    return directory


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Baseline of the unchanged model, written by `check --update-baseline` in its own directory."""
    root = tmp_path_factory.mktemp("check")
    path = str(root / "memory-baseline.json")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(write_model(root / "base"))
        assert check_main(["model.py", "--baseline", path, "--update-baseline", *ARGV]) == ExitCode.OK
    return path


def check(tmp_path, monkeypatch, baseline_path, edit, *extra):
    """Runs `tracer check model.py` on the edited model; returns (exit code, the CheckResult via the API)."""
    monkeypatch.chdir(write_model(tmp_path / (edit or "unchanged"), edit))
    code = check_main(["model.py", "--baseline", baseline_path, *ARGV, "--tolerance", "1%", *extra])
    result = compare_to_baseline(tracer.analyze("model.py", **OPTIONS), load_baseline(baseline_path), "1%")
    return code, result


@pytest.mark.slow
def test_unchanged_model_passes_from_another_checkout(tmp_path, monkeypatch, capsys, baseline):
    code, result = check(tmp_path, monkeypatch, baseline, None)
    assert code == ExitCode.OK and result.ok
    assert "ok: no number grew beyond 1%" in capsys.readouterr().out
    assert all(n.delta == 0 for n in result.numbers) and not result.improvements
    diff = result.diffs[0]                             # file paths are relative to the model file's directory
    assert diff.lines == diff.layers == diff.categories == ()


@pytest.mark.slow
def test_wider_mlp_is_caught(tmp_path, monkeypatch, capsys, baseline):
    code, result = check(tmp_path, monkeypatch, baseline, "wide_mlp")
    out = capsys.readouterr().out
    assert code == ExitCode.BUDGET_EXCEEDED and "REGRESSION" in out and "h = self.up(x)" in out
    grew = {n.metric: n.delta for n in result.regressions}
    assert {"peak_bytes", "saved_activation_bytes", "end_bytes"} <= set(grew)
    # per layer, hidden 256 -> 512 adds to what backward saves: the bf16 up and gelu outputs (b, s, +256)
    # and autocast's bf16 copies of the up and down weights (d x +256 each)
    assert grew["saved_activation_bytes"] == LAYERS * (2 * B * S * H * 2 + 2 * D * H * 2)
    lines = {r.code: r for r in result.diffs[0].lines}
    for code_text in ("h = self.up(x)", "h = F.gelu(h)", "return x + self.down(h)"):
        assert lines[code_text].delta_bytes > 0 and lines[code_text].delta_saved > 0
    assert {r.key for r in result.diffs[0].layers if r.delta_bytes > 0} == {"blocks.0", "blocks.1"}


def test_activation_upcast_to_fp32_is_caught(tmp_path, monkeypatch, capsys, baseline):
    code, result = check(tmp_path, monkeypatch, baseline, "upcast")
    out = capsys.readouterr().out
    assert code == ExitCode.BUDGET_EXCEEDED and "h = F.gelu(h.float())" in out
    assert {"peak_bytes", "saved_activation_bytes"} <= {n.metric for n in result.regressions}
    top = result.diffs[0].lines[0]                     # the line that grew most at the peak
    assert top.code == "h = F.gelu(h.float())" and top.label == "model.py:24"
    assert top.delta_bytes == top.delta_saved == LAYERS * B * S * H * 4      # the fp32 copy, saved by gelu


@pytest.mark.slow
def test_module_attribute_cache_is_caught(tmp_path, monkeypatch, baseline):
    """`self.cache = h` keeps gelu's output alive past the step. Export drops the attribute, but the fake run of
    the forward sees it (tracer.capture.joint.ForwardObservations). The predicted growth of the optimizer-phase
    peak equals what a real eager step measures: 2 x bf16 (b, s, hidden)."""
    from truth import measure_step

    from tracer.capture import load_model_source

    code, result = check(tmp_path, monkeypatch, baseline, "attribute_cache")
    assert code == ExitCode.BUDGET_EXCEEDED
    predicted = {n.name: n.delta for n in result.numbers}["eager.phases.optimizer.peak_bytes"]
    real = {}
    for edit in (None, "attribute_cache"):
        source = load_model_source(str(write_model(tmp_path / f"real-{edit}", edit) / "model.py"))
        torch.manual_seed(0)
        model = source.build_model()
        real[edit] = measure_step(model, source.example_batch(B, S),
                                  torch.optim.AdamW(model.parameters()), precision="bf16")
    grown = real["attribute_cache"].phase_peaks["optimizer"] - real[None].phase_peaks["optimizer"]
    assert grown == predicted == LAYERS * B * S * H * 2


@pytest.mark.slow
def test_checkpointing_turned_off_is_caught(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(write_model(tmp_path / "checkpointed", "checkpointed"))
    with_ckpt = tracer.analyze("model.py", **OPTIONS)
    path = str(tmp_path / "baseline.json")
    save_baseline(with_ckpt, path)
    monkeypatch.chdir(write_model(tmp_path / "plain"))
    without = tracer.analyze("model.py", **OPTIONS)
    if baseline_json(with_ckpt)["baseline"] == baseline_json(without)["baseline"]:
        pytest.fail("a checkpointed model predicts like the plain one: the capture lost the model's own "
                    "torch.utils.checkpoint calls")
    assert check_main(["model.py", "--baseline", path, *ARGV, "--tolerance", "1%"]) == ExitCode.BUDGET_EXCEEDED
    assert "saved_activation_bytes" in capsys.readouterr().out


@pytest.mark.slow
def test_two_analyses_give_identical_numbers(tmp_path):
    first = tracer.analyze(BASE, **OPTIONS)
    second = tracer.analyze(BASE, **OPTIONS)
    save_baseline(first, str(tmp_path / "a.json"))
    save_baseline(second, str(tmp_path / "b.json"))
    assert (tmp_path / "a.json").read_bytes() == (tmp_path / "b.json").read_bytes()
    a, b = first.policies["eager"], second.policies["eager"]
    assert a.liveness.live_during == b.liveness.live_during and a.at_peak == b.at_peak
    result = compare_to_baseline(second, load_baseline(str(tmp_path / "a.json")), 0)
    assert result.ok and not result.improvements and all(n.delta == 0 for n in result.numbers)


def test_check_takes_the_baselines_settings_and_reports_what_a_flag_changes(tmp_path, monkeypatch, capsys, baseline):
    monkeypatch.chdir(write_model(tmp_path / "m"))
    assert check_main(["model.py", "--baseline", baseline]) == ExitCode.OK         # seq 64 and bf16: the baseline's
    out = capsys.readouterr().out
    assert "seq 64  bf16" in out and "given on the command line" not in out
    assert check_main(["model.py", "--baseline", baseline, "--seq", "32"]) == ExitCode.OK   # a shorter sequence
    out = capsys.readouterr().out
    assert "note: seq (baseline 64, now 32): given on the command line" in out and "bf16" in out


def test_comparing_an_analysis_made_with_other_settings_is_refused(baseline):
    with pytest.raises(UsageError) as info:
        compare_to_baseline(tracer.analyze(BASE, batch=2, seq=32), load_baseline(baseline))
    assert "seq (baseline 64, now 32)" in str(info.value) and "precision (baseline 'bf16', now 'fp32')" in str(info.value)


@pytest.mark.slow
def test_update_baseline_locks_in_a_change(tmp_path, monkeypatch, capsys, baseline):
    path = str(tmp_path / "baseline.json")
    with open(baseline) as src, open(path, "w") as dst:
        dst.write(src.read())
    monkeypatch.chdir(write_model(tmp_path / "m", "upcast"))
    assert check_main(["model.py", "--baseline", path, *ARGV]) == ExitCode.BUDGET_EXCEEDED
    assert check_main(["model.py", "--baseline", path, *ARGV, "--update-baseline"]) == ExitCode.OK
    assert check_main(["model.py", "--baseline", path, *ARGV]) == ExitCode.OK
    data = json.loads(open(path).read())
    assert data["schema_version"] == 1 and data["torch_version"] == torch.__version__
    record = data["baseline"]["policies"]["eager"]
    assert record["numbers"]["peak_bytes"] == data["policies"]["eager"]["peak_bytes"]
    assert set(record["numbers"]) >= {"phases.forward.peak_bytes", "phases.backward.peak_bytes",
                                      "phases.optimizer.peak_bytes", "saved_bytes", "end_bytes"}
    assert sum(r["bytes_at_peak"] for r in record["lines"]) == record["numbers"]["peak_bytes"]


@pytest.mark.parametrize("argv,needle", [
    (["m.py", "--baseline", "missing.json"], "baseline not found"),
    (["m.py", "--baseline", "report.json"], "is not a tracer baseline"),
    (["m.py", "--baseline", "report.json", "--tolerance", "5"], "ambiguous"),
    (["m.py", "--baseline", "report.json", "--seq", "0"], "seq=0 is not valid"),
])
def test_usage_errors_exit_2(tmp_path, monkeypatch, capsys, argv, needle):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "report.json").write_text(json.dumps({"schema_version": 1, "policies": {}}))
    assert check_main(argv) == ExitCode.USAGE
    assert needle in capsys.readouterr().err


def test_missing_flag_and_help(capsys):
    assert check_main(["model.py"]) == ExitCode.USAGE              # --baseline is required
    assert check_main(["--help"]) == ExitCode.OK
    out = capsys.readouterr().out
    for flag in ("--baseline", "--tolerance", "--update-baseline", "--batch", "--seq", "--precision", "--optimizer",
                 "--foreach", "--step", "--zero-grad"):
        assert flag in out


def test_analysis_error_exits_3(baseline, capsys):
    argv = [os.path.join(FIXTURES, "raising_forward.py"), "--baseline", baseline, "--seq", "4"]
    assert check_main(argv) == ExitCode.ANALYSIS
    assert "raising_forward.py:12" in capsys.readouterr().err


def test_parse_tolerance():
    assert parse_tolerance("2%") == 0.02 and parse_tolerance("0.5 %") == 0.005
    assert parse_tolerance("0.02") == 0.02 and parse_tolerance(0) == 0.0
    for bad in ("2", "-1%", "two", ""):
        with pytest.raises(ValueError):
            parse_tolerance(bad)


@pytest.mark.slow
def test_improvement_and_one_byte_regression_are_classified():
    analysis = tracer.analyze("llama-debug", batch=1, seq=8)
    data = baseline_json(analysis)
    numbers = data["baseline"]["policies"]["eager"]["numbers"]
    peak = numbers["peak_bytes"]
    numbers["peak_bytes"] = 2 * peak                   # the baseline was twice as large: an improvement
    numbers["retired_metric"] = 0                      # a number this tracer no longer computes
    result = compare_to_baseline(analysis, data, "2%")
    assert result.ok and [n.metric for n in result.improvements] == ["peak_bytes"]
    assert "eager.retired_metric is in the baseline but not in this analysis" in result.notes
    numbers["peak_bytes"] = peak - 1
    result = compare_to_baseline(analysis, data, 0)
    assert [n.metric for n in result.regressions] == ["peak_bytes"] and result.regressions[0].delta == 1
    with pytest.raises(UsageError, match="model"):
        compare_to_baseline(analysis, {**data, "config": {**data["config"], "model": "gpt2-debug"}}, 0)
