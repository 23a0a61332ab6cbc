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
    ANALYSIS = 3            # the model was loaded but could not be run, exported or analysed


class TracerError(Exception):
    exit_code = ExitCode.ANALYSIS

    def __init__(self, message: str, *, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} ({self.hint})" if self.hint else self.message


class ModelInputError(TracerError):
    """The model file or zoo name cannot give a model: missing file, no build_model, unknown name."""
    exit_code = ExitCode.USAGE


class UsageError(TracerError):
    exit_code = ExitCode.USAGE


class ModelRunError(TracerError):
    """The user's forward (or example_batch, or optimizer) raised while being traced."""


class CaptureError(TracerError):
    """torch.export or the joint-graph capture failed on an op. For the capture ladder: `next_rung_may_work`
    (the forward itself ran on fake tensors, so another capture path may succeed), `direct` (raised by the
    direct trace, whose errors say less than the export rungs'), `quiet` (not a failure worth a note: the
    model is simply left to the next rung)."""

    def __init__(self, message: str, *, hint: str = "", next_rung_may_work: bool = False, direct: bool = False,
                 quiet: bool = False):
        super().__init__(message, hint=hint)
        self.next_rung_may_work, self.direct, self.quiet = next_rung_may_work, direct, quiet
