"""Shared helpers of the reliability probes: the probe model files and a CLI runner that returns
(exit code, stdout, stderr)."""
import os

import pytest

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
TINY = ["--target", "cpu", "--batch", "1", "--seq", "8", "--top", "1"]


def model(name: str) -> str:
    return os.path.join(MODELS, name + ".py")


@pytest.fixture
def run_cli(capsys):
    """main(argv) in-process: (exit code, stdout, stderr)."""
    from tracer.cli import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err
    return run


@pytest.fixture
def no_analysis(monkeypatch):
    """Fail the test if an analysis starts: for errors that must be found before it runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("the analysis ran before the error was found")
    import tracer.pipeline
    monkeypatch.setattr(tracer.pipeline, "run_analysis", refuse)
