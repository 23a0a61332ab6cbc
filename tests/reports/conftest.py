"""Fixtures for renderer tests: the hand-built two-block step (llama-debug, captured once per session, is
tests/conftest.py's `llama_debug`).

Goldens: see golden_files.py (regenerate with TRACER_UPDATE_GOLDEN=1).
"""
from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from synthetic import two_block_step  # noqa: E402

from tracer.passes.analysis import analyze_graph  # noqa: E402


@pytest.fixture(scope="session")
def synthetic():
    return analyze_graph(two_block_step())
