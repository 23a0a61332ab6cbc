"""The exit-code contract of every subcommand (`python -m tracer`, `tracer check`, `tracer snapshot`, ...).

    run_entry_point(body, *, prog, verbose) -> int

`body()` returns the exit code. What it raises becomes one line on stderr and a code (tracer.errors.ExitCode):
  * a `TracerError`: its message and its `exit_code` (2 usage, 3 analysis or the model's own failure);
  * `KeyboardInterrupt` (Ctrl-C outside the model's code; the model's own is a ModelRunError): 130;
  * anything else is a bug or an environment failure: exit 3, never 1 (which means "a memory check
    failed"), with the hint to rerun with --verbose for the traceback.
With `verbose` the chained traceback is printed before the line. Exit 0 and 1 only come from `body`'s
return value, so no crash can read as a pass or as a regression.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings
from typing import Callable

from tracer.errors import ExitCode, TracerError

VERBOSE_HINT = "rerun with --verbose for the traceback"


def run_entry_point(body: Callable[[], int], *, prog: str, verbose: bool) -> int:
    from tracer.pipeline import spaced_collections
    with _library_warnings_quiet(verbose), spaced_collections():
        return _run(body, prog=prog, verbose=verbose)


@contextlib.contextmanager
def _library_warnings_quiet(verbose: bool):
    """Libraries log warnings while the command runs (torchao: "Failed to load ... .so" for a binary built
    for another Python, through Python's last-resort handler; torch's pytree: a deprecation when a library
    registers an Enum, through the handler torch._logging installs): that is not tracer's output, and the
    contract is one line on stderr. Without --verbose (or TORCH_LOGS, which asks for torch's), records below
    ERROR are not emitted while the command runs, and neither are Python warnings (Inductor's "undefined
    OpHandler", a library's deprecation); tracer itself does not log, and what it has to say is in the report.
    The processes a command spawns do the same (tracer.pipeline.capture_processes)."""
    if verbose or os.environ.get("TORCH_LOGS"):
        yield
        return
    previous, last_resort = logging.root.manager.disable, logging.lastResort
    last_resort_level = last_resort.level if last_resort is not None else None
    logging.disable(logging.WARNING)
    if last_resort is not None:         # a library may lift logging.disable; no handler of its own: this one
        last_resort.setLevel(logging.ERROR)
    environment = os.environ.get("PYTHONWARNINGS")
    os.environ["PYTHONWARNINGS"] = "ignore"       # for processes started meanwhile (Inductor's compile workers)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        if environment is None:
            os.environ.pop("PYTHONWARNINGS", None)
        else:
            os.environ["PYTHONWARNINGS"] = environment
        logging.disable(previous)
        if last_resort is not None:
            last_resort.setLevel(last_resort_level)


def _run(body: Callable[[], int], *, prog: str, verbose: bool) -> int:
    try:
        return int(body())
    except TracerError as exc:
        _say(prog, f"error: {exc}", exc, verbose)
        return int(exc.exit_code)
    except KeyboardInterrupt as exc:
        _say(prog, "interrupted (Ctrl-C)", exc, verbose=False)
        return int(ExitCode.INTERRUPTED)
    except Exception as exc:  # noqa: BLE001 - the contract: an unexpected error is exit 3 and one line
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        detail = f"{type(exc).__name__}: {first}" if first else type(exc).__name__
        hint = "" if verbose else f" ({VERBOSE_HINT})"
        _say(prog, f"internal error: {detail}{hint}", exc, verbose)
        return int(ExitCode.ANALYSIS)


def _say(prog: str, line: str, exc: BaseException, verbose: bool) -> None:
    if verbose:
        import traceback
        traceback.print_exception(exc)
    print(f"{prog}: {line}", file=sys.stderr)
