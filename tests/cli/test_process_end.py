"""How a tracer process ends: after the report it leaves the objects it made to the operating system
instead of letting the interpreter's teardown collect every reference cycle of the captured graphs once
more (about a second of a command on a model of 88M parameters), and the exit handlers of the model's code
still run. The pool processes of a command end the same way (the pool's shutdown waits for them). While it
works, the tracer runs the garbage collector after 50,000 new objects rather than CPython's 700 (its graphs
stay alive until the report, so frequent collections find little), and gives the caller's setting back."""
import gc
import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MLP_LM = os.path.join(ROOT, "tests", "fixtures", "mlp_lm.py")

# appended to a model file: at the process's exit, it writes how many objects the collector has set aside
EXIT_HANDLER = textwrap.dedent('''

    import atexit as _atexit
    import gc as _gc
    import os as _os


    def _say_how_the_process_ends():
        with open(_os.environ["END_REPORT"], "w") as out:
            out.write(f"frozen={_gc.get_freeze_count()}")


    _atexit.register(_say_how_the_process_ends)
''')


def test_the_command_ends_without_collecting_and_the_models_exit_handlers_run(tmp_path):
    path = tmp_path / "mlp_lm_with_exit_handler.py"
    path.write_text(open(MLP_LM).read() + EXIT_HANDLER)
    report = tmp_path / "end.txt"
    proc = subprocess.run([sys.executable, "-m", "tracer", str(path), "--seq", "8", "--batch", "2", "--no-cache"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "END_REPORT": str(report)})
    assert proc.returncode == 0, proc.stderr
    assert "peak:" in proc.stdout
    frozen = int(report.read_text().removeprefix("frozen="))
    assert frozen > 0                      # the objects were set aside before the exit handlers ran


@pytest.fixture
def thresholds_kept():
    """The garbage collector's thresholds of this process, put back after the test."""
    before = gc.get_threshold()
    yield before
    gc.set_threshold(*before)


def test_a_pool_process_collects_seldom_and_ends_without_collecting(monkeypatch, thresholds_kept):
    import atexit

    from tracer.pipeline import YOUNG_OBJECTS_PER_COLLECTION, _as_sibling, _output_state, end_without_collecting
    from tracer.capture import triton_target

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(triton_target, "share_cores", lambda processes: None)
    gc.set_threshold(700, 10, 10)                      # CPython's default
    _as_sibling(_output_state(), 2)
    assert registered == [end_without_collecting]
    assert gc.get_threshold() == (YOUNG_OBJECTS_PER_COLLECTION, 10, 10)


# appended to a model file: the garbage collector's thresholds while the tracer builds the model
THRESHOLD_RECORDER = textwrap.dedent('''

    import gc as _gc

    THRESHOLDS_SEEN = []
    _build_model = build_model


    def build_model():
        THRESHOLDS_SEEN.append(_gc.get_threshold())
        return _build_model()
''')


@pytest.mark.parametrize("entry", ["tracer.analyze", "the CLI"])
def test_the_tracer_collects_garbage_seldom_while_it_works_and_restores_the_callers_setting(
        entry, tmp_path, thresholds_kept):
    import tracer
    from tracer.cli import main
    from tracer.pipeline import YOUNG_OBJECTS_PER_COLLECTION

    path = tmp_path / "mlp_lm_recording_thresholds.py"
    path.write_text(open(MLP_LM).read() + THRESHOLD_RECORDER)
    gc.set_threshold(900, 11, 12)                      # the caller's own setting
    if entry == "tracer.analyze":
        tracer.analyze(str(path), seq=8, batch=2)
    else:
        assert main([str(path), "--seq", "8", "--batch", "2", "--no-cache", "--quiet"]) == 0
    seen = [module.THRESHOLDS_SEEN for name, module in list(sys.modules.items())
            if getattr(module, "__file__", None) == str(path)]
    assert seen and seen[0], "the model file was not built in this process"
    assert set(seen[0]) == {(YOUNG_OBJECTS_PER_COLLECTION, 11, 12)}
    assert gc.get_threshold() == (900, 11, 12)
