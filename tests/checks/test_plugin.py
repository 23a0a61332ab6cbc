"""The `memory_budget` marker (tracer.checks.plugin, loaded through the pytest11 entry point), run in
inner pytest sessions with `pytester`: budgets hold on tests/fixtures/check_base.py and fail on injected
regressions, naming the lines at the peak; bad markers fail with one line saying what to fix."""
import importlib.metadata
import os

import pytest

import tracer

pytest_plugins = ["pytester"]

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
BASE_TEXT = open(os.path.join(FIXTURES, "check_base.py")).read()
OPTIONS = dict(seq=64, precision="bf16", target="cpu")     # the CPU step: its peak is in backward


@pytest.fixture(scope="module")
def base_bill():
    eager = tracer.analyze(os.path.join(FIXTURES, "check_base.py"), **OPTIONS).policies["eager"]
    return eager.peak_bytes, eager.at_peak.by_category["activation"]


def test_plugin_is_registered_through_the_pytest11_entry_point(pytester):
    points = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="pytest11")}
    assert points.get("tracer") == "tracer.checks.plugin"
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(["*memory_budget(model, peak=None*"])


@pytest.mark.slow
def test_budgets_hold_on_the_model_and_fail_on_regressions(pytester, base_bill):
    peak, activation = base_bill
    pytester.makepyfile(base=BASE_TEXT,
                        upcast=BASE_TEXT.replace("h = F.gelu(h)  ", "h = F.gelu(h.float())  "),
                        wide=BASE_TEXT.replace("HIDDEN = 256\n", "HIDDEN = 512\n"))
    pytester.makepyfile(test_budgets=f"""
        import pytest

        @pytest.mark.memory_budget(model="base.py", peak={peak}, activation={activation}, seq=64, precision="bf16", target="cpu")
        def test_base_fits_exactly():
            pass

        @pytest.mark.memory_budget(model="upcast.py", peak={peak}, seq=64, precision="bf16", target="cpu")
        def test_upcast():
            pass

        @pytest.mark.memory_budget(model="wide.py", activation="{activation}B", seq=64, precision="bf16", target="cpu")
        def test_wide():
            pass

        @pytest.mark.memory_budget(model="base.py", peak="1KiB", seq=64, precision="bf16", target="cpu")
        def test_base_over_a_tiny_budget():
            pass
    """)
    # pytest warns that the tracer plugin was imported before the inner run could rewrite it, once per process
    # (whichever in-process run comes first): its path is not the report's
    result = pytester.runpytest("-p", "no:cacheprovider", "-W", "ignore::pytest.PytestAssertRewriteWarning")
    result.assert_outcomes(passed=1, failed=3)
    out = result.stdout.str()
    upcast = out.split("_ test_upcast _")[1].split("_ test_wide _")[0]
    assert f"> budget {peak / 2**20:.2f} MiB ({peak:,} B)" in upcast
    assert "peak in backward" in upcast and "top lines at the peak:" in upcast
    assert "upcast.py:24  h = F.gelu(h.float())" in upcast
    wide = out.split("_ test_wide _")[1]
    assert "activation" in wide and "wide.py:23  h = self.up(x)" in wide
    assert "peak 2.75 MiB" in out.split("_ test_base_over_a_tiny_budget _")[1]
    assert "site-packages" not in out          # library lines print from the package root, as the CLI does


@pytest.mark.slow
def test_the_body_runs_first_and_its_failure_wins(pytester):
    pytester.makepyfile(test_body="""
        import pytest

        @pytest.mark.memory_budget(model="does-not-exist.py", peak="1GiB")
        def test_failing_body():
            assert 1 == 2
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert "assert 1 == 2" in result.stdout.str() and "model file not found" not in result.stdout.str()


@pytest.mark.parametrize("marker,needle", [
    ('model="llama-debug"', "memory_budget needs a budget: peak= or one of parameter"),
    pytest.param('model="llama-debug", peak="lots"', "memory_budget peak='lots': cannot read 'lots' as a size",
                 marks=pytest.mark.slow),
    pytest.param('model="llama-debug", peak="1GiB", sequence=8', "unknown keyword(s) sequence (valid: model, policy, peak",
                 marks=pytest.mark.slow),
    pytest.param('model="llama-debug", peak="1GiB", precision="fp8"', "precision='fp8' is not valid",
                 marks=pytest.mark.slow),
    pytest.param('model="missing.py", peak="1GiB"', "memory_budget: model file not found: missing.py",
                 marks=pytest.mark.slow),
    pytest.param('model="llama-debug", peak="1GiB", seq=8, policy="nope"', "unknown policy 'nope'; valid policies: ",
                 marks=pytest.mark.slow),
])
def test_marker_mistakes_fail_with_one_clear_line(pytester, marker, needle):
    pytester.makepyfile(test_marker=f"""
        import pytest

        @pytest.mark.memory_budget({marker})
        def test_it():
            pass
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    assert needle in result.stdout.str()


@pytest.mark.memory_budget(model="../fixtures/check_base.py", peak="3MiB", activation="1MiB", seq=64, precision="bf16", target="cpu")
def test_the_fixture_fits_its_budget():
    """The marker in this very suite: the path is resolved next to this test file."""
