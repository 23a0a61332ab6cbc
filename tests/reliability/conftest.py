"""Shared helpers of the reliability probes: the probe model files (the CLI runner `run_cli` is the
suite's, in tests/conftest.py)."""
import os

import pytest

MODELS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models")
TINY = ["--target", "cpu", "--batch", "1", "--seq", "8", "--top", "1"]


def model(name: str) -> str:
    return os.path.join(MODELS, name + ".py")


@pytest.fixture
def no_analysis(monkeypatch):
    """Fail the test if an analysis starts: for errors that must be found before it runs."""
    def refuse(*args, **kwargs):
        raise AssertionError("the analysis ran before the error was found")
    import tracer.pipeline
    monkeypatch.setattr(tracer.pipeline, "run_analysis", refuse)
