"""Fixtures of the compiled-step accuracy tests (test_compiled.py, test_compiled_blocks.py)."""
import importlib.util
import os
import sys

import pytest
import torch

BENCHMARK = os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks", "compiled_vs_profiler.py")


@pytest.fixture(scope="module")
def compiled_vs_profiler():
    spec = importlib.util.spec_from_file_location("compiled_vs_profiler", BENCHMARK)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def no_compile_caches():
    """Every compile runs the partitioner (a cached one would skip it). torch's own `config.patch` sets the
    entries and puts them back (a monkeypatch undo would delete them: torch then hides the entry)."""
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        yield
    torch._dynamo.reset()
