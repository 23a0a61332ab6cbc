"""Shared test helpers: `truth` (real eager step measured at storage level) is importable from any test.

Tiers: every test under tests/accuracy (real CPU steps of real-size or many models against predictions)
is marked `slow`, as are tests marked so explicitly; `python -m pytest -q -m "not slow" tests` is the fast
tier for local work, and the default command (CI) runs everything."""
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
