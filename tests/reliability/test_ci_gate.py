"""The CI gate in real projects (issue 31): a baseline replays the step however the model file makes it,
models are named the ways projects name them, outputs go where they point, and hostile inputs get one
clear line with a bounded amount of work."""
import json
import os
import stat
import subprocess
import sys
import textwrap

import pytest

from conftest import TINY, model
from tracer.errors import ExitCode

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIXTURES = os.path.join(ROOT, "tests", "fixtures")
SMALL = ["--target", "cpu", "--seq", "8"]


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ a baseline replays how the step was made

def test_a_model_file_with_its_own_optimizer_can_be_gated(run_cli, tmp_path):
    path, baseline = os.path.join(FIXTURES, "custom_optimizer.py"), tmp_path / "b.json"
    code, _, err = run_cli(path, *SMALL, "--save-baseline", baseline)
    assert code == ExitCode.OK, err
    assert json.loads(baseline.read_text())["config"]["optimizer"] == "custom"
    code, out, err = run_cli("check", path, "--baseline", baseline)
    assert code == ExitCode.OK, err
    assert "ok: no number grew" in out


def test_a_baseline_records_the_options_and_check_replays_them(run_cli, tmp_path):
    baseline = tmp_path / "b.json"
    code, _, err = run_cli(model("tiny"), *TINY, "--optimizer", "sgd-momentum", "--precision", "bf16",
                           "--save-baseline", baseline)
    assert code == ExitCode.OK, err
    options = json.loads(baseline.read_text())["baseline"]["options"]
    assert options["optimizer"] == "sgd-momentum" and options["precision"] == "bf16" and options["seq"] == 8
    code, out, err = run_cli("check", model("tiny"), "--baseline", baseline)
    assert code == ExitCode.OK, err


# ------------------------------------------------------------------ models named as projects name them

def write_package(root, name: str) -> str:
    """`root/src/<name>/` with a model file that imports its sibling relatively; returns the model file."""
    package = root / "src" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "layers.py").write_text(textwrap.dedent("""
        import torch.nn as nn

        class MLP(nn.Module):
            def __init__(self, width):
                super().__init__()
                self.up, self.down = nn.Linear(16, width), nn.Linear(width, 16)

            def forward(self, x):
                return self.down(self.up(x).relu())
    """))
    (package / "model.py").write_text(textwrap.dedent("""
        import torch
        from .layers import MLP


        class Net(MLP):
            def forward(self, x):
                return super().forward(x).pow(2).mean()


        def build_model(width=32):
            return Net(width)


        def build_wide(width=256):
            return Net(width)


        def example_batch(batch, seq):
            return (torch.randn(batch, seq, 16),)
    """))
    return str(package / "model.py")


def test_a_model_file_inside_a_package_is_imported_as_part_of_it(run_cli, tmp_path):
    path = write_package(tmp_path, "pkg_by_path")
    code, out, err = run_cli(path, *SMALL)
    assert code == ExitCode.OK, err
    assert "peak:" in out


def test_a_module_and_a_module_factory_with_arguments_name_a_model(run_cli, tmp_path, monkeypatch):
    write_package(tmp_path, "pkg_by_name")
    monkeypatch.chdir(tmp_path / "src")
    monkeypatch.setattr(sys, "path", list(sys.path))
    peaks = {}
    for name, extra in (("pkg_by_name.model", ()), ("pkg_by_name.model:build_wide", ()),
                        ("pkg_by_name.model:build_wide", ("--model-arg", "width=32"))):
        code, out, err = run_cli(name, *SMALL, *extra, "--json", tmp_path / "r.json")
        assert code == ExitCode.OK, err
        peaks[(name, extra)] = json.loads((tmp_path / "r.json").read_text())["policies"]["eager"]["peak_bytes"]
    plain, wide, narrowed = peaks.values()
    assert wide > plain and narrowed == plain           # the factory's own default, then width=32 as build_model's


def test_every_way_of_naming_a_model_round_trips_through_a_baseline(run_cli, tmp_path, monkeypatch):
    write_package(tmp_path, "pkg_round_trip")
    monkeypatch.chdir(tmp_path / "src")
    monkeypatch.setattr(sys, "path", list(sys.path))
    name = "pkg_round_trip.model:build_wide"
    baseline = tmp_path / "b.json"
    code, _, err = run_cli(name, *SMALL, "--model-arg", "width=64", "--save-baseline", baseline)
    assert code == ExitCode.OK, err
    code, out, err = run_cli("check", name, "--baseline", baseline)          # the model arguments replayed
    assert code == ExitCode.OK, err
    code, out, err = run_cli("check", name, "--baseline", baseline, "--model-arg", "width=512")
    assert code == ExitCode.BUDGET_EXCEEDED, out


def test_bad_model_names_and_arguments_are_one_line(run_cli, tmp_path):
    code, _, err = run_cli("no_such_pkg_anywhere.model", *SMALL)
    assert code == ExitCode.USAGE and "no module named 'no_such_pkg_anywhere'" in one_line(err)
    code, _, err = run_cli(model("tiny"), *SMALL, "--model-arg", "nonsense")
    assert code == ExitCode.USAGE and "is not KEY=VALUE" in one_line(err)
    code, _, err = run_cli(model("tiny"), *SMALL, "--model-arg", "width=3")
    assert code == ExitCode.USAGE and "does not take width" in one_line(err)
    code, _, err = run_cli("llama-debug", *SMALL, "--model-arg", "width=3")
    assert code == ExitCode.USAGE and "--model-arg applies to a model file or module" in one_line(err)


def test_a_syntax_error_is_located_in_the_model_file(run_cli, tmp_path):
    path = tmp_path / "broken.py"
    path.write_text("import torch\n\ndef build_model(:\n    pass\n")
    code, _, err = run_cli(path, *SMALL)
    assert code == ExitCode.ANALYSIS and f"{path}:3:" in one_line(err)


# ------------------------------------------------------------------ outputs go where they point

def test_device_nodes_and_links_to_them_are_written_through(run_cli, tmp_path):
    link = tmp_path / "discard.json"
    link.symlink_to(os.devnull)
    for target in (os.devnull, link):
        code, _, err = run_cli(model("tiny"), *TINY, "--json", target)
        assert code == ExitCode.OK, err
    assert stat.S_ISCHR(os.stat(os.devnull).st_mode) and os.path.islink(link)
    assert os.listdir(tmp_path) == ["discard.json"]


@pytest.mark.slow
def test_json_to_dev_stdout_prints_the_report_after_the_text(tmp_path):
    """Into a pipe, and into a file the shell redirected stdout to (appended, never truncated or replaced)."""
    argv = [sys.executable, "-m", "tracer", model("tiny"), *TINY, "--json", "/dev/stdout"]
    piped = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert piped.returncode == ExitCode.OK, piped.stderr
    assert piped.stdout.index("peak:") < piped.stdout.index('"schema_version"')
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        redirected = subprocess.run(argv, cwd=ROOT, stdout=f, stderr=subprocess.PIPE, text=True, timeout=300)
    assert redirected.returncode == ExitCode.OK, redirected.stderr
    assert out.read_text() == piped.stdout


def test_a_baseline_written_through_a_symlink_keeps_the_link(run_cli, tmp_path):
    real, link = tmp_path / "baselines" / "b.json", tmp_path / "b.json"
    real.parent.mkdir()
    link.symlink_to(real)
    code, _, err = run_cli(model("tiny"), *TINY, "--save-baseline", link)
    assert code == ExitCode.OK, err
    code, _, err = run_cli("check", model("tiny"), "--baseline", link, "--update-baseline", *TINY)
    assert code == ExitCode.OK, err
    assert os.path.islink(link) and json.loads(real.read_text())["baseline"]["options"]["seq"] == 8


def test_a_report_folder_is_written_whole_or_not_at_all(run_cli, tmp_path, monkeypatch):
    import errno
    real_fsync, calls = os.fsync, []

    def disk_full_at_the_third_file(fd):
        calls.append(fd)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_fsync(fd)
    out = tmp_path / "report"
    monkeypatch.setattr(os, "fsync", disk_full_at_the_third_file)
    code, _, err = run_cli(model("tiny"), *TINY, "--report", out)
    assert code == ExitCode.USAGE and "No space left on device" in err
    assert not out.exists() and os.listdir(tmp_path) == []
    monkeypatch.setattr(os, "fsync", real_fsync)
    code, _, err = run_cli(model("tiny"), *TINY, "--report", out)
    assert code == ExitCode.OK, err
    assert {"report.html", "lines.json", "predicted_snapshot.pickle"} <= set(os.listdir(out))


# ------------------------------------------------------------------ the model's own failures

@pytest.mark.slow
@pytest.mark.parametrize("raised", ["GeneratorExit()", "Stop('its own BaseException')"])
def test_a_model_raising_outside_exceptions_tree_is_its_failure(tmp_path, raised):
    """In a subprocess: an exception outside Exception's tree unwinds through torch's tracing, which cleans
    up only after an Exception and may leave tracing state behind (the CLI exits right after)."""
    path = tmp_path / "raises.py"
    path.write_text(textwrap.dedent(f"""
        import torch
        import torch.nn as nn


        class Stop(BaseException):
            pass


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(4, 4)

            def forward(self, x):
                raise {raised}


        def build_model():
            return Net()


        def example_batch(batch, seq):
            return (torch.randn(batch, 4),)
    """))
    proc = subprocess.run([sys.executable, "-m", "tracer", str(path), *SMALL], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == ExitCode.ANALYSIS and proc.stdout == ""
    assert f"{path}:16: the model raised {raised.split('(')[0]}" in one_line(proc.stderr)


def test_an_in_place_write_into_a_tensor_backward_needs_is_refused_as_eager_refuses_it(run_cli, tmp_path):
    import torch
    text = textwrap.dedent("""
        import torch
        import torch.nn as nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.lin = nn.Linear(8, 8)

            def forward(self, x):
                y = self.lin(x).sigmoid()
                y.mul_(2)
                return y.sum()


        def build_model():
            return Net()


        def example_batch(batch, seq):
            return (torch.randn(batch, 8),)
    """)
    path = tmp_path / "inplace_saved.py"
    path.write_text(text)
    namespace = {}
    exec(compile(text, str(path), "exec"), namespace)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        namespace["build_model"]()(*namespace["example_batch"](2, 8)).backward()     # eager, for real
    code, out, err = run_cli(path, *SMALL)
    assert code == ExitCode.ANALYSIS and out == ""
    assert f"{path}:13: 'y.mul_(2)' writes in place into a tensor that aten.sigmoid (line 12)" in one_line(err)
    path.write_text(text.replace("y = self.lin(x).sigmoid()", "y = self.lin(x)"))   # the linear saves no output
    code, out, err = run_cli(path, *SMALL)
    assert code == ExitCode.OK, err
    assert torch.is_grad_enabled()


@pytest.mark.slow
def test_a_models_non_daemon_thread_does_not_keep_the_cli_alive(tmp_path):
    path = tmp_path / "threaded.py"
    path.write_text(open(model("tiny")).read() + textwrap.dedent("""

        import threading
        import time

        threading.Thread(target=time.sleep, args=(3600,), daemon=False).start()
    """))
    proc = subprocess.run([sys.executable, "-m", "tracer", str(path), *TINY], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == ExitCode.OK, proc.stderr
    assert "peak:" in proc.stdout


# ------------------------------------------------------------------ work bounded by what the input justifies

def test_an_absurd_accumulation_is_refused_before_any_analysis(run_cli, no_analysis):
    code, _, err = run_cli(model("tiny"), *TINY, "--accumulate", "1000000000000")
    assert code == ExitCode.USAGE and "more micro-batches than one simulated step holds" in one_line(err)


def test_an_accumulation_past_what_one_step_holds_is_refused_with_the_largest_that_fits(run_cli, monkeypatch):
    import tracer.capture.accumulation as accumulation
    monkeypatch.setattr(accumulation, "MAX_STEP_OPS", 200)
    code, _, err = run_cli(model("tiny"), *TINY, "--accumulate", "50")
    assert code == ExitCode.USAGE and "--accumulate 50 repeats the captured forward and backward" in one_line(err)
    assert "pass --accumulate" in err


@pytest.mark.slow
def test_a_config_with_a_billion_layers_is_refused_before_it_is_built(run_cli, tmp_path):
    pytest.importorskip("transformers")
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 10**9, "hidden_size": 64,
                                  "intermediate_size": 128, "num_attention_heads": 4}))
    assert config.stat().st_size < 200
    code, _, err = run_cli("hf:llama", "--config-json", config, *SMALL)
    assert code == ExitCode.USAGE and "num_hidden_layers = 1,000,000,000 is more layers" in one_line(err)


def test_a_build_that_registers_too_many_modules_is_stopped(run_cli, tmp_path, monkeypatch):
    import tracer.capture.build as build
    monkeypatch.setattr(build, "MAX_BUILD_REGISTRATIONS", 50)
    path = tmp_path / "deep.py"
    path.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn


        def build_model():
            return nn.Sequential(*[nn.Linear(4, 4) for _ in range(10**6)])


        def example_batch(batch, seq):
            return (torch.randn(batch, 4),)
    """))
    code, _, err = run_cli(path, *SMALL)
    assert code == ExitCode.USAGE and "registered over 50 submodules and parameters" in one_line(err)


# ------------------------------------------------------------------ flags that do not apply

@pytest.mark.parametrize("flags, says", [
    (["--hf-task", "causal-lm"], "--hf-task applies to hf:<model_type> models"),
    (["--config-json", "config.json"], "--config-json applies to hf:<model_type> models"),
    (["--no-reshard-after-forward"], "--no-reshard-after-forward is FSDP's reshard_after_forward=False"),
    (["--levers", "--world-size", "0"], "--world-size 0 is not valid"),
])
def test_a_flag_that_does_not_apply_is_refused(run_cli, flags, says):
    code, _, err = run_cli("llama-debug", *SMALL, *flags)
    assert code == ExitCode.USAGE and says in one_line(err)


def test_a_tensor_parallel_size_that_does_not_divide_the_heads_is_refused(run_cli):
    code, _, err = run_cli("llama-debug", *SMALL, "--tp", "3")
    assert code == ExitCode.USAGE and "--tp 3: " in one_line(err) and "does not split into 3 equal parts" in err


def test_a_lever_the_model_cannot_take_is_a_row_saying_why(tmp_path):
    from tracer.levers import LEVERS, run_levers
    from tracer.pipeline import AnalysisOptions
    path = tmp_path / "no_linear.py"
    path.write_text(textwrap.dedent("""
        import torch
        import torch.nn as nn


        class Net(nn.Module):
            def __init__(self):
                super().__init__()
                self.w = nn.Parameter(torch.randn(16, 16))

            def forward(self, x):
                return (x @ self.w).pow(2).mean()


        def build_model():
            return Net()


        def example_batch(batch, seq):
            return (torch.randn(batch, seq, 16),)
    """))
    levers = tuple(lever for lever in LEVERS if lever.name == "baseline" or lever.name.startswith("LoRA"))
    table = run_levers(str(path), AnalysisOptions(seq=8, target="cpu"), levers=levers)
    lora = next(row for row in table.rows if row.lever.startswith("LoRA"))
    assert table.baseline.peak_bytes and lora.options is None and "has no nn.Linear to adapt" in lora.reason
