"""Golden files of the renderers (tests/reports/golden/), for output we fully own: text, DOT, JSON from the
hand-built step in synthetic.py.

To regenerate them after an intended change of output:

    TRACER_UPDATE_GOLDEN=1 python -m pytest -q tests/reports

then review `git diff tests/reports/golden` before committing.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

GOLDEN = Path(__file__).parent / "golden"


def check_golden(name: str, text: str) -> None:
    """Compare `text` with golden/`name`; with TRACER_UPDATE_GOLDEN=1, rewrite the file instead."""
    path = GOLDEN / name
    if os.environ.get("TRACER_UPDATE_GOLDEN") == "1":
        path.write_text(text, encoding="utf-8")
        return
    if not path.exists():
        pytest.fail(f"missing golden {path}; run TRACER_UPDATE_GOLDEN=1 python -m pytest -q tests/reports")
    assert text == path.read_text(encoding="utf-8"), (
        f"{name} differs from its golden; if the change is intended, regenerate with "
        "TRACER_UPDATE_GOLDEN=1 python -m pytest -q tests/reports and review the diff")
