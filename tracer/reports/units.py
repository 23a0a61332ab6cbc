"""Byte and FLOP formatting, and byte parsing, shared by every renderer and the CLI."""
from __future__ import annotations

import re

_UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def byte_unit(nbytes: int) -> tuple[str, int]:
    """The unit that shows `nbytes` as a number below 1024 (TiB at most): ("MiB", 2**20) for 44 MiB."""
    for power, unit in enumerate(BYTE_UNITS):
        if abs(nbytes) < 1024 ** (power + 1) or unit == BYTE_UNITS[-1]:
            return unit, 1024 ** power
    raise AssertionError("unreachable")


def format_bytes(nbytes: int) -> str:
    unit, unit_bytes = byte_unit(nbytes)
    value = nbytes / unit_bytes
    return f"{value:,.0f} B" if unit == "B" else f"{value:,.2f} {unit}"


def format_flops(flops: int) -> str:
    value = float(flops)
    for unit in ("", "k", "M", "G", "T", "P"):
        if abs(value) < 1000 or unit == "P":
            return f"{value:,.0f} FLOP" if unit == "" else f"{value:,.2f} {unit}FLOP"
        value /= 1000
    raise AssertionError("unreachable")


def parse_bytes(text: str) -> int:
    """'80GiB', '80 GB', '512MiB', '1024' -> bytes. Raises ValueError on anything else."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _UNITS | {"": 1}:
        raise ValueError(f"cannot read {text!r} as a size; use a number with B, KB, MB, GB, KiB, MiB or GiB")
    return int(float(match.group(1)) * _UNITS.get(match.group(2).lower(), 1))
