"""What a model file declares about its training loop, read before anything is traced: which forward
outputs the loop keeps (`keep_outputs` names or positions, or a `keep_alive(outputs)` function) and the
bytes it holds beside the model (`extra_resident_bytes`, an int or a function of batch and seq). The
declarations are checked here (ModelInputError for a malformed one); tracer/capture/caller_held.py puts
what they name on the captured step.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Callable

import torch

from tracer.errors import ModelInputError, ModelRunError


def keep_function(keep_outputs, keep_alive, path: str) -> Callable | None:
    """The model file's `keep_outputs` / `keep_alive` as one function: outputs -> ((label, tensor), ...).
    Raises ModelInputError for a malformed declaration."""
    if keep_outputs is not None and keep_alive is not None:
        raise ModelInputError(f"{path} defines both keep_outputs and keep_alive", hint="keep one of them")
    if keep_alive is not None:
        if not callable(keep_alive):
            raise ModelInputError(f"{path}: keep_alive is a {type(keep_alive).__name__}, not a function",
                                  hint="define keep_alive(outputs) returning the tensors the loop keeps")
        return lambda out: _labelled(keep_alive(out))
    if keep_outputs is None:
        return None
    names = (keep_outputs,) if isinstance(keep_outputs, (str, int)) else keep_outputs
    if not isinstance(names, (tuple, list)) or not all(isinstance(n, (str, int)) for n in names):
        raise ModelInputError(f"{path}: keep_outputs must be a tuple of output names or positions",
                              hint='e.g. keep_outputs = ("logits",) or keep_outputs = (0,)')
    return lambda out: tuple((str(name), _output(out, name)) for name in names)


def extra_bytes(declared, path: str, batch: int, seq: int) -> int:
    """The model file's `extra_resident_bytes` (an int, or a function of batch and seq). Raises
    ModelInputError unless it gives a non-negative int."""
    value = declared(batch, seq) if callable(declared) else declared
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ModelInputError(f"{path}: extra_resident_bytes gave {value!r}",
                              hint="a number of bytes (int >= 0), or a function (batch, seq) -> int")
    return value


def _labelled(kept) -> tuple:
    items = (kept,) if isinstance(kept, torch.Tensor) else tuple(kept)
    if not all(isinstance(t, torch.Tensor) for t in items):
        raise ModelRunError("keep_alive(outputs) must return a tensor or an iterable of tensors")
    return tuple((f"keep_alive {i}", t) for i, t in enumerate(items))


def _output(out, name):
    """out[name] of a mapping, out.name of an object, out[i] of a tuple."""
    if isinstance(name, int) and isinstance(out, (tuple, list)) and -len(out) <= name < len(out):
        return out[name]
    if isinstance(name, str) and isinstance(out, Mapping) and name in out:
        return out[name]
    if isinstance(name, str) and isinstance(getattr(out, name, None), torch.Tensor):
        return getattr(out, name)
    raise ModelRunError(f"keep_outputs names {name!r}, which forward's {type(out).__name__} output does not have",
                        hint="name a key or attribute of a mapping output, or a position in a tuple")
