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
def no_compile_caches(monkeypatch):
    """Every compile runs the partitioner (a cached one would skip it)."""
    monkeypatch.setattr(torch._inductor.config, "fx_graph_cache", False)
    monkeypatch.setattr(torch._functorch.config, "enable_autograd_cache", False)
    yield
    torch._dynamo.reset()
