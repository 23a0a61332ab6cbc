"""Progress lines on stderr (`[  3.2s] capturing ...`) for long runs: shown when stderr is a terminal or
`--progress` is given, never with `--quiet`. stdout carries only the report."""
from __future__ import annotations

import sys
import time


class Progress:
    """A callable `on_progress(message)` for tracer.pipeline, tracer.planning and tracer.levers."""

    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.monotonic()

    @classmethod
    def from_args(cls, args) -> "Progress":
        quiet, forced = getattr(args, "quiet", False), getattr(args, "progress", False)
        return cls(enabled=not quiet and (forced or sys.stderr.isatty()))

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.monotonic() - self.start:5.1f}s] {message}", file=sys.stderr, flush=True)

    def done(self) -> None:
        self("done")
