"""A library that caches tensors in a module-level dict (bitsandbytes' quantization code maps) meets the
capture's fake tensors: a build under fake tensors gets the cache emptied of real tensors and of another
capture's fakes (the library makes them again, as fakes), and after the capture the process's caches hold
no fake tensor and their real tensors are back, the same objects."""
import sys
import textwrap
import types

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source

MODEL = textwrap.dedent('''
    import sys
    import torch
    from torch import nn

    CACHE = sys.modules["tracer_test_library"].CACHE

    def code_map():
        if "dynamic" not in CACHE:                  # made once, then reused: a library's cache
            CACHE["dynamic"] = torch.linspace(-1, 1, 16)
        return CACHE["dynamic"]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = nn.Linear(16, 4)
            self.register_buffer("scale", code_map() * 2)

        def forward(self, x, y):
            return ((self.linear(x * self.scale) - y) ** 2).mean()

    def build_model():
        return Net()

    def example_batch(batch, seq):
        return torch.randn(batch, 16), torch.randn(batch, 4)
''')


@pytest.fixture
def library():
    module = types.ModuleType("tracer_test_library")
    module.CACHE = {}
    sys.modules[module.__name__] = module
    yield module
    del sys.modules[module.__name__]


def _capture(tmp_path):
    path = tmp_path / "net.py"
    path.write_text(MODEL)
    return capture_steps(load_model_source(str(path)), CaptureOptions(batch=2, seq=8), (PolicySpec(name="eager"),))


def test_a_real_cached_tensor_is_set_aside_for_the_capture_and_put_back(tmp_path, library):
    real = torch.linspace(-1, 1, 16)
    library.CACHE["dynamic"] = real
    _capture(tmp_path)
    assert library.CACHE["dynamic"] is real


def test_the_capture_leaves_no_fake_tensor_in_a_cache(tmp_path, library):
    _capture(tmp_path)
    _capture(tmp_path)                               # a second capture does not meet the first one's fakes
    assert "dynamic" not in library.CACHE
