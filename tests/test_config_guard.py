"""The suite's guard (tests/torch_config_guard.py) fails a test that leaves a torch config entry changed
or deleted, naming the entry, and lets `config.patch` (which undoes itself) through. Run in an inner pytest
session in its own process: the probe really changes the config."""
import os

import pytest

pytest_plugins = ["pytester"]

TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_the_guard_names_the_entry_a_test_left_changed_or_deleted(pytester):
    pytester.makeconftest(f"""
        import sys
        sys.path.insert(0, {TESTS!r})
        from torch_config_guard import torch_configs_left_as_found  # noqa: F401
    """)
    pytester.makepyfile(test_probe="""
        import torch._inductor.config as inductor

        def test_patched_the_torch_way():
            with inductor.patch(fx_graph_cache=False):
                assert inductor.fx_graph_cache is False

        def test_assigned_and_never_restored():
            inductor.fx_graph_cache = False

        def test_deleted():
            del inductor.fx_graph_cache

        def test_after_a_slip_the_configs_are_back():
            assert inductor.fx_graph_cache is not False
    """)
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=4, errors=2)
    out = result.stdout.str()
    assert "test_assigned_and_never_restored left torch config entries changed: torch._inductor.config.fx_graph_cache" in out
    assert "test_deleted left torch config entries changed: torch._inductor.config.fx_graph_cache (deleted)" in out
    assert "test_after_a_slip_the_configs_are_back" not in out      # it passed: the guard put the entry back
