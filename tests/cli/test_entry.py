"""The CLI's output contract around libraries' logging and warnings: what a model's imports log below ERROR
(torchao's "Failed to load ...", torch's pytree deprecations) and the Python warnings they raise are not
printed unless --verbose, also by the processes a command spawns."""
import subprocess
import sys
import textwrap

import pytest

MODEL = textwrap.dedent('''
    import logging
    import warnings
    import torch
    from torch import nn

    logging.getLogger("somelibrary").warning("a library's warning at import")
    logging.getLogger("torch.utils._pytree").warning("a torch logger's warning at import")
    warnings.warn("a library's UserWarning at import")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(8))
            self.head = nn.Linear(16, 64)

        def forward(self, idx, targets):
            x = self.embed(idx)
            for block in self.blocks:
                x = x + block(x)
            return nn.functional.cross_entropy(self.head(x).flatten(0, 1), targets.flatten())

    def build_model():
        return Net()

    def example_batch(batch, seq):
        return torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))
''')


@pytest.mark.slow
@pytest.mark.parametrize("verbose", [False, True])
def test_libraries_warnings_are_printed_only_with_verbose(tmp_path, verbose):
    """`--policy all` captures the compiled policy here and the others in a spawned process, which imports
    the model file again: with --verbose both processes print the two warnings, without it neither does."""
    path = tmp_path / "noisy.py"
    path.write_text(MODEL)
    run = subprocess.run([sys.executable, "-m", "tracer", str(path), "--batch", "1", "--seq", "8", "--target", "cpu",
                          "--policy", "all", "--no-cache", "--progress", *(["--verbose"] if verbose else [])],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "in a second process" in run.stderr
    assert run.stderr.count("warning at import") == (4 if verbose else 0)
    assert run.stderr.count("UserWarning: a library's UserWarning") == (2 if verbose else 0)


@pytest.mark.slow
def test_the_levers_processes_print_nothing_but_the_table(tmp_path):
    """`--levers` captures its groups in spawned processes, and Inductor starts compile workers of its own:
    none of them prints a library's logging or warnings (nor multiprocessing's resource tracker, at exit)."""
    path = tmp_path / "noisy.py"
    path.write_text(MODEL)
    run = subprocess.run([sys.executable, "-m", "tracer", str(path), "--batch", "2", "--seq", "8", "--levers",
                          "--no-cache"], capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "what-if" in run.stdout
    assert run.stderr == ""
