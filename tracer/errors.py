"""Error types and process exit codes.

Every error the user can cause is a `TracerError` whose message names the file, line or op and says what
to do; the CLI prints it as one line and exits with `exit_code`. The original exception stays chained
(`raise ... from exc`) and is shown with `--verbose`.
"""
from __future__ import annotations

import enum


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
