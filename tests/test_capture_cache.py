"""The content-addressed capture cache (tracer/capture_cache.py): a second run of the same model, code and
options reuses the capture and gives the same report; any changed input is a miss; a corrupt entry is
ignored, never trusted."""
import json
import os

import pytest

import tracer.pipeline as pipeline
from tracer import capture_cache
from tracer.pipeline import options_from_keywords, run_analysis
from tracer.reports.json_report import report_json

MODEL = '''
import torch
from torch import nn
from helper import WIDTH


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH)

    def forward(self, x, y):
        return ((self.a(x) - y) ** 2).mean()


def build_model():
    return Net()


def example_batch(batch, seq):
    return torch.randn(batch, seq, WIDTH), torch.randn(batch, seq, WIDTH)
'''


@pytest.fixture
def cached(tmp_path, monkeypatch):
    """A model file importing a sibling module, the cache on in a folder of its own, and a counter of the
    captures actually made."""
    monkeypatch.setenv("TRACER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("TRACER_NO_CACHE", "0")
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "helper.py").write_text("WIDTH = 16\n")
    (tmp_path / "net.py").write_text(MODEL)
    captures = []
    real = pipeline.capture_graphs

    def counted(*args, **kwargs):
        captures.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(pipeline, "capture_graphs", counted)
    return tmp_path, captures


def _report(path, **options) -> str:
    analysis = run_analysis(str(path), options_from_keywords(batch=2, seq=8, target="cpu", **options))
    return json.dumps(report_json(analysis, versions={}), sort_keys=True)


def test_a_second_run_reuses_the_capture_and_reports_the_same(cached):
    folder, captures = cached
    first = _report(folder / "net.py")
    second = _report(folder / "net.py")
    assert captures == [1]
    assert second == first


def test_a_changed_model_file_an_import_or_an_option_is_a_miss(cached):
    folder, captures = cached
    _report(folder / "net.py")
    _report(folder / "net.py", precision="bf16")
    assert len(captures) == 2
    (folder / "net.py").write_text(MODEL + "\n# edited\n")
    _report(folder / "net.py")
    assert len(captures) == 3
    (folder / "helper.py").write_text("WIDTH = 16  # edited, same value\n")
    import importlib
    import helper
    importlib.reload(helper)
    _report(folder / "net.py")
    assert len(captures) == 4


def test_a_corrupt_entry_is_ignored_and_removed(cached):
    folder, captures = cached
    first = _report(folder / "net.py")
    (entry,) = os.listdir(capture_cache.cache_dir())
    with open(os.path.join(capture_cache.cache_dir(), entry), "wb") as f:
        f.write(b"not a pickle")
    assert _report(folder / "net.py") == first
    assert len(captures) == 2
    assert _report(folder / "net.py") == first and len(captures) == 2     # stored again, then reused


def test_no_cache_captures_again(cached, monkeypatch):
    folder, captures = cached
    _report(folder / "net.py")
    monkeypatch.setenv("TRACER_NO_CACHE", "1")
    _report(folder / "net.py")
    assert len(captures) == 2
