"""Source attribution: the user's line from an fx `stack_trace` string or a live Python stack.

The user's line is the innermost frame of model code: outside torch and outside tracer's own capture code
(frames in `torch/optim` count: an optimizer step's memory belongs to the optimizer's own lines), and, in
an installed package (site-packages), only in a file whose module `forward` is running in that stack. So
a model's own code in a library (transformers' `modeling_llama.py`, timm's layers) keeps its lines, while a
tensor utility library the model calls (einops' `rearrange`, einx, opt_einsum, a library's helper
functions) is attributed to the model's line that called it. A stack with no such frame falls back to its
innermost frame outside torch and tracer.
Module paths from export's `nn_module_stack` are normalised (`L__self__`, `_export_root.`,
`L['self'].` prefixes and the loss wrapper's attribute are dropped).
"""
from __future__ import annotations

import functools
import contextlib
import linecache
import os
import re
import sysconfig
import sys

import torch

from tracer.stepgraph import SourceLoc

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_TRACER_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_ZOO_DIR = os.path.join(_TRACER_DIR, "models") + os.sep      # the zoo's model files are model code
# Python's own library (contextlib, functools, copy): it runs model code, it is not model code
_STDLIB_DIR = os.path.abspath(sysconfig.get_paths()["stdlib"]) + os.sep
_FRAME_RE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<func>\S+)\n(?P<code>[^\n]*)')
_GRAD_ACC_SUFFIX = "Gradient addition node due to multiple use of tensor around:"
WRAPPED_ATTR = "_tracer_wrapped"   # attribute name of the user model inside the loss wrapper
_PREFIXES = ("L__self__", "_export_root.", "L['self'].", "L['self']", "L__self___")


@functools.lru_cache(maxsize=None)
def is_user_file(path: str) -> bool:
    """Model code: not torch (but torch.optim, whose lines the optimizer step is attributed to), not
    Python's own library, and not tracer's own code (its pipeline and capture wrap the user's forward),
    except the zoo's model files."""
    path = os.path.abspath(path) if not path.startswith("<") else path
    if path.startswith("<") or (path.startswith(_STDLIB_DIR) and _LIBRARY_DIRS[0] not in path
                                and _LIBRARY_DIRS[1] not in path):
        return False
    if path.startswith(_TRACER_DIR) and not path.startswith(_ZOO_DIR):
        return False
    return not path.startswith(_TORCH_DIR) or path.startswith(_OPTIM_DIR)


_LIBRARY_DIRS = (os.sep + "site-packages" + os.sep, os.sep + "dist-packages" + os.sep)


def model_code_frames(frames: list[tuple[str, str]]) -> list[int]:
    """Of a stack's (file, function) frames, outer to inner, the indices of model code (module docstring):
    user files, less the installed-library files in which no `forward` of the stack runs; all user files
    when that leaves none."""
    user = [i for i, (path, _) in enumerate(frames) if is_user_file(path)]
    running = {path for path, function in frames if function == "forward"}
    model = [i for i in user if frames[i][0] in running or not _in_library(frames[i][0])]
    return model or user


def is_model_file(path: str) -> bool:
    """The model's own code: a user file (`is_user_file`) that is not an installed package's."""
    return is_user_file(path) and not any(d in os.path.abspath(path) for d in _LIBRARY_DIRS)


def _in_library(path: str) -> bool:
    """An installed package's file, other than torch.optim's (the optimizer step's own lines)."""
    return any(d in path for d in _LIBRARY_DIRS) and not os.path.abspath(path).startswith(_OPTIM_DIR)


def loc_from_stack_trace(stack_trace: str | None) -> SourceLoc | None:
    if not stack_trace:
        return None
    stack_trace = stack_trace.replace(_GRAD_ACC_SUFFIX, "")
    frames = list(_FRAME_RE.finditer(stack_trace + "\n"))
    chosen = model_code_frames([(m["file"], m["func"]) for m in frames])
    if not chosen:
        return None
    m = frames[chosen[-1]]
    code = m["code"].strip()
    if not code or set(code) <= {"^", "~", " "}:
        code = linecache.getline(m["file"], int(m["line"])).strip()
    return SourceLoc(m["file"], int(m["line"]), m["func"], code)


def user_frames(stack_trace: str | None) -> tuple[tuple[str, int, str], ...]:
    """Every frame of an fx stack trace outside torch and tracer, outer to inner, as (file, line, function):
    library helpers included, since their Python locals hold tensors until they return (pylocals.py);
    which of them a line is billed to is `loc_from_stack_trace`'s choice."""
    if not stack_trace:
        return ()
    stack_trace = stack_trace.replace(_GRAD_ACC_SUFFIX, "")
    return tuple((m["file"], int(m["line"]), m["func"]) for m in _FRAME_RE.finditer(stack_trace + "\n")
                 if is_user_file(m["file"]))


_CALLER_FRAMES = [0]     # outer frames of the code that started the step run, left out of its lines


def loc_from_python_stack() -> SourceLoc | None:
    stack, frame = [], sys._getframe(1)
    while frame is not None:
        stack.append(frame)
        frame = frame.f_back
    stack.reverse()                                     # outer to inner
    return loc_of_frames(stack[_CALLER_FRAMES[-1]:])


@contextlib.contextmanager
def caller_frames_left_out():
    """While active, `loc_from_python_stack` leaves out the frames that called into it: a script of the
    user's that calls `tracer.analyze` is not the model's code, and an op no model line runs (autograd's
    engine starting backward) has no line rather than the script's."""
    depth, frame = 0, sys._getframe(2)
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    _CALLER_FRAMES.append(depth)
    try:
        yield
    finally:
        _CALLER_FRAMES.pop()


def loc_of_frames(stack: list) -> SourceLoc | None:
    """The line of the innermost model-code frame (`model_code_frames`) of Python frames, outer to inner."""
    chosen = model_code_frames([(f.f_code.co_filename, f.f_code.co_name) for f in stack])
    if not chosen:
        return None
    frame = stack[chosen[-1]]
    path, line = frame.f_code.co_filename, frame.f_lineno
    return SourceLoc(path, line, frame.f_code.co_name, linecache.getline(path, line).strip())


def normalize_module_path(path: str) -> str:
    for prefix in _PREFIXES:
        if path.startswith(prefix):
            path = path[len(prefix):]
    if path == WRAPPED_ATTR or path.startswith(WRAPPED_ATTR + "."):
        path = path[len(WRAPPED_ATTR) + 1:]
    return path


def module_from_stack(nn_module_stack: dict | None) -> str:
    if not nn_module_stack:
        return ""
    fqn = list(nn_module_stack.values())[-1][0]
    return normalize_module_path(str(fqn))


def exception_location(exc: BaseException, model: str = "model") -> str:
    """'file:line' of the innermost model-code frame of `exc`; else its SyntaxError's own place; else
    `model` (the model's name: an error raised where no model line runs, inside autograd's backward)."""
    import traceback
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if is_user_file(f.filename)]
    frames = [f for f in frames if "/tracer/" not in f.filename or "/tracer/models/" in f.filename]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else model
