"""Shared test helpers: `truth` (real eager step measured at storage level) is importable from any test.

Tiers: every test under tests/accuracy (real CPU steps of real-size or many models against predictions)
is marked `slow`, as are tests marked so explicitly; `python -m pytest -q -m "not slow" tests` is the fast
tier for local work, and the default command (CI) runs everything.

Shared captures: `analyzed(model, **options)` is `tracer.analyze` memoized for the session on the resolved
options, so tests that assert different things on the same step share one capture (a capture of a debug
model costs about a second). `llama_debug` is the llama-debug step (batch 2, seq 32, eager, the default
CUDA target) for every test whose property does not depend on the size. An Analysis is frozen data; a test
must not change what it gets."""
import os
import sys

import pytest

HERE = os.path.dirname(__file__)
sys.path.insert(0, HERE)
ACCURACY = os.path.join(HERE, "accuracy")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if str(item.path).startswith(ACCURACY):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session")
def analyzed():
    from tracer.pipeline import options_from_keywords, run_analysis
    analyses = {}

    def analyze(model, **options):
        key = (model, options_from_keywords(**options))
        if key not in analyses:
            analyses[key] = run_analysis(*key)
        return analyses[key]
    return analyze


@pytest.fixture(scope="session")
def llama_debug(analyzed):
    return analyzed("llama-debug", batch=2, seq=32)
