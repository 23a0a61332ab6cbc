"""What the model's own code asks about the device while the step is captured.

The capture runs on this CPU-only build under fake CPU tensors, whatever the target: a model whose code
branches on the device (`if torch.cuda.is_available():`, `if x.is_cuda:`, a fused optimizer for CUDA) takes
the CPU branch here, and on the target GPU the other one. `device_queries_observed()` records each line of
the model's own files (not torch's, not an installed library's) that asks, with the answer it got, so that a
CUDA target's report names them in a `note:` instead of predicting the CPU branch silently.

Observed: `torch.cuda.is_available()`, `torch.cuda.device_count()`, `torch.cuda.is_bf16_supported()` and a
tensor's `.is_cuda`. Not observed: comparisons of `tensor.device` or `device.type` (a plain torch.device
value, read everywhere to place new tensors).
"""
from __future__ import annotations

import contextlib
import os
import sys

import torch

from tracer.capture.source import is_model_file

_CUDA_QUERIES = ("is_available", "device_count", "is_bf16_supported")


@contextlib.contextmanager
def device_queries_observed():
    """Yields a dict filled while the block runs: (file, line) -> the query and the answer it got."""
    asked: dict[tuple[str, int], str] = {}
    originals = {name: getattr(torch.cuda, name) for name in _CUDA_QUERIES}

    def observing(name, query):
        def observed(*args, **kwargs):
            answer = query(*args, **kwargs)
            _record(asked, sys._getframe(1), f"torch.cuda.{name}()", answer)
            return answer
        return observed

    def is_cuda(self):
        answer = _TENSOR_IS_CUDA.__get__(self)
        _record(asked, sys._getframe(1), "tensor.is_cuda", answer)
        return answer

    for name, query in originals.items():
        setattr(torch.cuda, name, observing(name, query))
    torch.Tensor.is_cuda = property(is_cuda)
    try:
        yield asked
    finally:
        for name, query in originals.items():
            setattr(torch.cuda, name, query)
        del torch.Tensor.is_cuda


_TENSOR_IS_CUDA = torch._C.TensorBase.is_cuda


def _record(asked: dict, frame, query: str, answer) -> None:
    path = frame.f_code.co_filename
    if is_model_file(path):
        asked.setdefault((path, frame.f_lineno), f"{query} answered {answer!r}")


def device_query_note(asked: dict, target_is_cuda: bool) -> tuple[str, ...]:
    """A `note:` for a CUDA target naming the lines of the model that asked about the device."""
    if not asked or not target_is_cuda:
        return ()
    lines = "; ".join(f"{os.path.basename(path)}:{line} ({what})" for (path, line), what in list(asked.items())[:4])
    more = f" and {len(asked) - 4} more" if len(asked) > 4 else ""
    return (f"the model's code asked about the device during the capture, which runs on the CPU: {lines}{more}; "
            "on the target GPU those lines may take another branch, which this prediction does not follow "
            "(to predict the GPU's branch, write a model file that takes it unconditionally)",)
