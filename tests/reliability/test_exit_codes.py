"""Exit codes that mean what the docs say (issue 16): the model's failures are exit 3, never 0 or 1; an
unexpected error is exit 3 with one line and the --verbose hint; Ctrl-C is 130; flag and output-path errors
are exit 2 before any analysis; the model's print() and sys.argv parsing do not touch the tool's own."""
import textwrap

import pytest

from conftest import TINY, model
from tracer.errors import ExitCode


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize("name, needle", [
    ("exit_at_import", "called sys.exit(0)"),
    ("exit_in_build", "called sys.exit(0)"),
    ("exit_in_forward", "called sys.exit(0)"),
    ("raise_in_optimizer", "no optimizer today"),
])
def test_the_models_failure_is_exit_3(run_cli, name, needle):
    code, out, err = run_cli(model(name), *TINY)
    assert code == ExitCode.ANALYSIS
    assert needle in one_line(err) and out == ""


@pytest.mark.slow
def test_the_models_own_keyboard_interrupt_is_exit_3():
    """In a subprocess: a KeyboardInterrupt the model raises unwinds through torch's tracing, which may
    leave tracing state behind in the process (the CLI exits right after; a test session would not)."""
    import os
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-m", "tracer", model("interrupt_in_forward"), *TINY], cwd=root,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == ExitCode.ANALYSIS and "raised KeyboardInterrupt" in one_line(proc.stderr)
    assert proc.stdout == ""


def test_sys_exit_0_in_the_model_cannot_pass_tracer_check(tmp_path, capsys):
    from tracer.cli.check import check_main
    baseline = tmp_path / "b.json"
    code = check_main([model("exit_in_forward"), "--baseline", str(baseline), "--update-baseline", *TINY[:-2]])
    assert code == ExitCode.ANALYSIS
    assert "called sys.exit(0)" in one_line(capsys.readouterr().err)
    assert not baseline.exists()


def test_an_unexpected_error_is_exit_3_with_the_verbose_hint(run_cli, monkeypatch):
    import tracer.pipeline

    def crash(*args, **kwargs):
        raise RuntimeError("something nobody foresaw")
    monkeypatch.setattr(tracer.pipeline, "run_analysis", crash)
    code, out, err = run_cli(model("tiny"), *TINY)
    line = one_line(err)
    assert code == ExitCode.ANALYSIS and "internal error: RuntimeError: something nobody foresaw" in line
    assert "rerun with --verbose" in line
    code, out, err = run_cli(model("tiny"), *TINY, "--verbose")
    assert code == ExitCode.ANALYSIS and "Traceback" in err


def test_ctrl_c_outside_the_model_is_130_with_one_line(run_cli, monkeypatch):
    import tracer.pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(tracer.pipeline, "run_analysis", interrupted)
    code, out, err = run_cli(model("tiny"), *TINY)
    assert code == ExitCode.INTERRUPTED == 130 and "interrupted" in one_line(err)


def test_a_real_sigint_while_the_model_runs_stays_an_interrupt():
    """In a process of its own, with Python's own SIGINT handler, as in a terminal: SIGINT's disposition is
    process-wide and inherited, and a pytest-xdist worker's may be to ignore it (seen in CI: a subprocess
    of the worker started with SIGINT ignored)."""
    import subprocess
    import sys
    probe = textwrap.dedent("""
        import os
        import signal

        import pytest

        from tracer.capture.model_input import running_user_code
        from tracer.errors import ModelRunError

        signal.signal(signal.SIGINT, signal.default_int_handler)
        before = signal.getsignal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            with running_user_code("model.py"):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(10**7):          # the handler runs between bytecodes
                    pass
        with pytest.raises(ModelRunError, match="raised KeyboardInterrupt"):
            with running_user_code("model.py"):
                raise KeyboardInterrupt
        assert signal.getsignal(signal.SIGINT) is before
        print("ok")
    """)
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr


@pytest.mark.parametrize("flags, needle", [
    (["--device-memory", "80XB"], "--device-memory"),
    (["--tolerance", "lots"], "--tolerance needs --compare"),
    (["--compare-json", "c.json"], "--compare-json needs --compare"),
    (["--world-size", "0"], "--world-size"),
    (["--world-size", "8"], "--world-size needs --shard"),
    (["--shard", "ddp", "--world-size", "0"], "--world-size"),
    (["--save-ops", "mn"], "'mn' is not an aten op"),
    (["--checkpoint-every", "0"], "--checkpoint-every"),
    (["--batch", "0"], "--batch"),
    (["--memory-budget", "2"], "--memory-budget"),
])
def test_flag_errors_are_found_before_the_analysis(run_cli, no_analysis, tmp_path, monkeypatch, flags, needle):
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(model("tiny"), *TINY, *flags)
    assert code == ExitCode.USAGE and needle in one_line(err) and out == ""


def test_tolerance_with_compare_must_read(run_cli, no_analysis, tmp_path):
    snap = tmp_path / "s.pickle"
    snap.write_bytes(b"\x80\x04N.")
    code, out, err = run_cli(model("tiny"), *TINY, "--compare", snap, "--tolerance", "lots")
    assert code == ExitCode.USAGE and "--tolerance" in one_line(err)


@pytest.mark.parametrize("flag", ["--json", "--plot", "--graph", "--export-snapshot", "--save-baseline"])
def test_output_path_errors_are_found_before_the_analysis(run_cli, no_analysis, tmp_path, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, out, err = run_cli(model("tiny"), *TINY, flag, blocker / "out.json")     # a folder under a file
    assert code == ExitCode.USAGE and "cannot create the output folder" in one_line(err)
    code, out, err = run_cli(model("tiny"), *TINY, flag, tmp_path)                 # a folder, not a file
    assert code == ExitCode.USAGE and "is a folder" in one_line(err)


def test_report_must_be_a_folder(run_cli, no_analysis, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    code, out, err = run_cli(model("tiny"), *TINY, "--report", blocker)
    assert code == ExitCode.USAGE and "is a file" in one_line(err)


def test_the_models_print_goes_to_stderr_and_its_argparse_sees_no_tracer_flags(run_cli, tmp_path):
    code, out, err = run_cli(model("prints"), *TINY)
    assert code == ExitCode.OK and "MODEL-PRINT" not in out and "peak" in out
    assert err.count("MODEL-PRINT") >= 3
    code, out, err = run_cli(model("argv_at_import"), *TINY, "--json", tmp_path / "r.json")
    assert code == ExitCode.OK and (tmp_path / "r.json").exists()
