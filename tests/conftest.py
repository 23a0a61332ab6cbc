"""Shared test helpers: `truth` (real eager step measured at storage level) is importable from any test.

Tiers: every test under tests/accuracy (real CPU steps of real-size or many models against predictions)
is marked `slow`, as are tests marked so explicitly; `python -m pytest -q -m "not slow" tests` is the fast
tier for local work, and the default command (CI) runs everything.

Shared captures: `analyzed(model, **options)` is `tracer.analyze` memoized for the session on the resolved
options, so tests that assert different things on the same step share one capture (a capture of a debug
model costs about a second); the `shared_analyses` fixture routes the command line through the same memo.
`llama_debug` is the llama-debug step (batch 2, seq 32, eager, the default CUDA target) for every test whose
property does not depend on the size. An Analysis is frozen data; a test must not change what it gets."""
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
# every test captures afresh: the content-addressed capture cache (tracer/capture_cache.py) is off unless a
# test turns it on with a cache folder of its own
os.environ["TRACER_NO_CACHE"] = "1"
sys.path.insert(0, HERE)
ACCURACY = os.path.join(HERE, "accuracy")


from torch_config_guard import torch_configs_left_as_found  # noqa: E402,F401  (an autouse fixture)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(ACCURACY):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def analysis_of():
    """`analysis_of(model, options)`: `tracer.pipeline.run_analysis` memoized for the session. A model file is
    known by its absolute path and its text (tests write different `model.py` files in different folders)."""
    from tracer.pipeline import run_analysis
    analyses = {}

    def analyze(model, options, on_progress=None, workers=1):
        key = (_model_key(model), options)
        if key not in analyses:
            analyses[key] = run_analysis(model, options)
        return analyses[key]
    return analyze


def _model_key(model) -> tuple:
    if isinstance(model, str) and os.path.isfile(model):
        with open(model, "rb") as f:
            return os.path.abspath(model), f.read()
    return (model,)


@pytest.fixture(scope="session")
def analyzed(analysis_of):
    from tracer.pipeline import options_from_keywords
    return lambda model, **options: analysis_of(model, options_from_keywords(**options))


@pytest.fixture
def shared_analyses(monkeypatch, analysis_of):
    """The pipeline (the command line, tracer.analyze, tracer check) answers from the session's analyses:
    for tests of what is done with an analysis, not of how it is made (no progress is reported, the model's
    output is not printed again)."""
    import tracer.pipeline
    monkeypatch.setattr(tracer.pipeline, "run_analysis", analysis_of)


@pytest.fixture(scope="session")
def llama_debug(analyzed):
    return analyzed("llama-debug", batch=2, seq=32)


@pytest.fixture
def run_cli(capsys):
    """main(argv) in-process: (exit code, stdout, stderr)."""
    from tracer.cli import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err
    return run
