"""Error types and process exit codes.

Every error the user can cause is a `TracerError` whose message names the file, line or op and says what
to do; the CLI prints it as one line and exits with `exit_code`. The original exception stays chained
(`raise ... from exc`) and is shown with `--verbose`. An option whose package is missing or fails to import
gets its error from `package_import_error`.
"""
from __future__ import annotations

import enum
from typing import Sequence


class ExitCode(enum.IntEnum):
    OK = 0
    BUDGET_EXCEEDED = 1     # a memory check failed (regression, budget)
    USAGE = 2               # bad command line, missing or invalid model file, unknown model name
    ANALYSIS = 3            # the model failed (raised, exited) or could not be analysed; any unexpected error
    INTERRUPTED = 130       # Ctrl-C (SIGINT) outside the model's own code


class TracerError(Exception):
    exit_code = ExitCode.ANALYSIS

    def __init__(self, message: str, *, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message

    def __reduce__(self):
        # keyword-only fields survive pickling (an error raised in a worker process, e.g. --levers')
        return _rebuild_error, (type(self), self.message, dict(self.__dict__))


def _rebuild_error(cls, message: str, state: dict) -> TracerError:
    error = cls.__new__(cls)
    Exception.__init__(error, message)
    error.__dict__.update(state)
    return error


class ModelInputError(TracerError):
    """The model file or zoo name cannot give a model: missing file, no build_model, unknown name."""
    exit_code = ExitCode.USAGE


class UsageError(TracerError):
    exit_code = ExitCode.USAGE


class ModelRunError(TracerError):
    """The user's code (the model file's import, build_model, example_batch, forward, loss_fn, make_optimizer)
    raised, called sys.exit or raised KeyboardInterrupt while being traced: the model's failure."""


class CaptureError(TracerError):
    """torch.export or the joint-graph capture failed on an op. For the capture ladder: `next_rung_may_work`
    (the forward itself ran on fake tensors, so another capture path may succeed), `direct` (raised by the
    direct trace, whose errors say less than the export rungs'), `quiet` (not a failure worth a note: the
    model is simply left to the next rung)."""

    def __init__(self, message: str, *, hint: str = "", next_rung_may_work: bool = False, direct: bool = False,
                 quiet: bool = False):
        super().__init__(message, hint=hint)
        self.next_rung_may_work, self.direct, self.quiet = next_rung_may_work, direct, quiet


def package_import_error(needs: str, packages: Sequence[str], exc: ImportError, *, install: str,
                         error: type[TracerError] = UsageError) -> TracerError:
    """The error for `needs` (an option, `--lora`) when importing `packages` raised `exc`. A package that is
    not installed asks for `install`; where every one is installed, the import itself failed (a package
    built for another torch that the import pulls in: a torchvision whose C++ operators do not load breaks
    transformers, and so peft), so the message gives the failure's root cause instead of asking for a
    package that is already there."""
    if not all(package_installed(name) for name in packages):
        return error(f"{needs} needs {' and '.join(packages)}", hint=install)
    root = _root_cause(exc)
    first_line = (str(root).strip().splitlines() or [""])[0]
    return error(f"{needs}: {' and '.join(packages)} installed, but importing failed: "
                 f"{type(root).__name__}: {first_line}",
                 hint=f"python -c 'import {packages[0]}' shows the whole error; reinstall the package it names in "
                      "the same pip command as torch (pip install torch==<your version> <package>), or uninstall it")


def package_installed(name: str) -> bool:
    """Whether the top-level package `name` can be found, without importing it (an import may fail for
    reasons of its own: `package_import_error`)."""
    import importlib.util
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):       # a module left half-imported in sys.modules: installed
        return True


def _root_cause(exc: BaseException) -> BaseException:
    """The innermost exception `exc` was raised from (or while handling)."""
    seen = {id(exc)}
    while (inner := exc.__cause__ or exc.__context__) is not None and id(inner) not in seen:
        seen.add(id(inner))
        exc = inner
    return exc
