"""How a tracer process ends: after the report it leaves the objects it made to the operating system
instead of letting the interpreter's teardown collect every reference cycle of the captured graphs once
more (about a second of a command on a model of 88M parameters), and the exit handlers of the model's code
still run. The pool processes of a command end the same way (the pool's shutdown waits for them)."""
import os
import subprocess
import sys
import textwrap

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


def test_a_pool_process_ends_without_collecting(monkeypatch):
    import atexit

    from tracer.pipeline import _as_sibling, _output_state, end_without_collecting
    from tracer.capture import triton_target

    registered = []
    monkeypatch.setattr(atexit, "register", registered.append)
    monkeypatch.setattr(triton_target, "share_cores", lambda processes: None)
    _as_sibling(_output_state(), 2)
    assert registered == [end_without_collecting]
