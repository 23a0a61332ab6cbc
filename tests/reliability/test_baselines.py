"""A memory gate that cannot pass by accident: malformed baselines and comparisons of nothing are usage
errors; a baseline of any policy is compared on its own policies; every memory_budget marker is checked."""
import copy
import json

import pytest

from conftest import TINY, model
from tracer.checks import load_baseline
from tracer.cli.check import check_main
from tracer.errors import ExitCode, UsageError

CHECK_FLAGS = TINY[:-2]           # tracer check has no --top


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A baseline of the tiny model made with --policy full (the case that compared nothing)."""
    from tracer.cli import main
    path = tmp_path_factory.mktemp("baseline") / "full.json"
    assert main([model("tiny"), *TINY, "--policy", "full", "--save-baseline", str(path)]) == 0
    return json.loads(path.read_text())


def _write(tmp_path, data, name="b.json"):
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _mutations(base):
    numbers = lambda d: d["baseline"]["policies"]["full"]["numbers"]   # noqa: E731
    record = lambda d: d["baseline"]["policies"]["full"]                # noqa: E731
    return [
        ("schema 99", lambda d: d.update(schema_version=99), "schema_version 99"),
        ("format 2", lambda d: d["baseline"].update(format_version=2), "format_version 2"),
        ("no policies", lambda d: d["baseline"].update(policies={}), "gates nothing"),
        ("no numbers", lambda d: record(d).update(numbers={}), "gates nothing"),
        ("string number", lambda d: numbers(d).update(peak_bytes="12"), "not a byte or FLOP count"),
        ("negative number", lambda d: numbers(d).update(peak_bytes=-5), "not a byte or FLOP count"),
        ("float number", lambda d: numbers(d).update(peak_bytes=1.5), "not a byte or FLOP count"),
        ("bool number", lambda d: numbers(d).update(peak_bytes=True), "not a byte or FLOP count"),
        ("policy list", lambda d: d["baseline"].update(policies=[]), "not an object"),
        ("record list", lambda d: d["baseline"]["policies"].update(full=[]), "not an object"),
        ("lines dict", lambda d: record(d).update(lines={}), "lines is not a list"),
        ("line without key", lambda d: record(d)["lines"].append({"bytes_at_peak": 1, "saved_bytes": 0}),
         "lines[" ),
        ("layers none", lambda d: record(d).update(layers=None), "layers is not a list"),
        ("categories", lambda d: record(d).update(by_category_at_peak={"activation": "x"}), "by_category_at_peak"),
        ("config", lambda d: d.update(config=[]), "no config object"),
        ("top list", lambda d: (d.clear(), d.update(x=1)), "schema_version None"),
    ]


def test_malformed_baselines_are_refused_with_one_line(tmp_path, saved):
    for label, mutate, needle in _mutations(saved):
        data = copy.deepcopy(saved)
        mutate(data)
        with pytest.raises(UsageError) as info:
            load_baseline(_write(tmp_path, data))
        assert needle in str(info.value), label
    for text, needle in (("[1, 2]", "top level is a list"), ("{", "cannot read baseline"),
                         ('{"a": NaN}', "cannot read baseline"), ("[" * 100000 + "]" * 100000, "cannot read baseline")):
        with pytest.raises(UsageError) as info:
            load_baseline(_write(tmp_path, text))
        assert needle in str(info.value)


def test_a_full_policy_baseline_is_compared_on_its_own_policy(tmp_path, saved, capsys):
    path = _write(tmp_path, saved)
    assert check_main([model("tiny"), "--baseline", path, *CHECK_FLAGS]) == ExitCode.OK
    assert "full peak" in capsys.readouterr().out
    edited = copy.deepcopy(saved)
    edited["baseline"]["policies"]["full"]["numbers"]["peak_bytes"] = 1
    assert check_main([model("tiny"), "--baseline", _write(tmp_path, edited), *CHECK_FLAGS]) == ExitCode.BUDGET_EXCEEDED


def test_a_comparison_of_nothing_is_an_error(tmp_path, saved, capsys):
    import tracer
    from tracer.checks import compare_to_baseline
    analysis = tracer.analyze(model("tiny"), batch=1, seq=8, target="cpu", policies=("eager",))
    other = copy.deepcopy(saved)
    other["config"] = json.loads(json.dumps(tracer.checks.baseline.baseline_json(analysis)["config"]))
    with pytest.raises(UsageError, match="gates no number"):
        compare_to_baseline(analysis, other)


def test_the_same_model_file_by_another_path_is_the_same_model(tmp_path, saved, monkeypatch, capsys):
    import os
    monkeypatch.chdir(os.path.dirname(model("tiny")))
    path = _write(tmp_path, saved)
    assert check_main(["./../models/tiny.py", "--baseline", path, *CHECK_FLAGS]) == ExitCode.OK


pytest_plugins = ["pytester"]


@pytest.mark.slow
def test_every_memory_budget_marker_is_checked(pytester):
    tiny = model("tiny")
    pytester.makepyfile(test_markers=f"""
        import pytest

        pytestmark = pytest.mark.memory_budget(model={tiny!r}, peak=1, batch=1, seq=8, target="cpu")

        @pytest.mark.memory_budget(model={tiny!r}, peak="1GiB", batch=1, seq=8, target="cpu")
        def test_module_marker_still_checked():
            pass

        @pytest.mark.memory_budget(model={tiny!r}, peak="1GiB", batch=1, seq=8, target="cpu")
        @pytest.mark.memory_budget(model={tiny!r}, gradient=1, batch=1, seq=8, target="cpu")
        def test_stacked():
            pass
    """)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(["*peak * > budget 1 B*"])
    result.stdout.fnmatch_lines(["*gradient * > budget 1 B*"])
