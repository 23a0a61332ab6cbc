"""How a tracer process ends: after the report it leaves the objects it made to the operating system
instead of letting the interpreter's teardown collect every reference cycle of the captured graphs once
more (about a second of a command on a model of 88M parameters), and the exit handlers of the model's code
still run. The pool processes of a command end the same way (the pool's shutdown waits for them)."""
import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MODEL = textwrap.dedent('''
    import atexit
    import gc
    import os

    import torch
    from torch import nn


    def _say_how_the_process_ends():
        with open(os.environ["END_REPORT"], "w") as out:
            out.write(f"frozen={gc.get_freeze_count()}")


    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.head = nn.Linear(16, 64)

        def forward(self, idx, targets):
            return nn.functional.cross_entropy(self.head(self.embed(idx)).flatten(0, 1), targets.flatten())


    def build_model():
        return Net()


    def example_batch(batch, seq):
        return torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))
''')


def _handler_registered_at_import(model_source: str) -> str:
    """The model file registers its exit handler when the tracer imports it."""
    return model_source + "\natexit.register(_say_how_the_process_ends)\n"


def test_the_command_ends_without_collecting_and_the_models_exit_handlers_run(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(_handler_registered_at_import(MODEL))
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
