"""The repeated blocks of a captured step: module paths `prefix.N` that forward runs for several N.

`repeated_blocks(graph)` returns the block paths in forward order for the most frequent prefix with at
least two blocks (`blocks.0`, `blocks.1`, ...; `model.layers.0`, ...), or [] when nothing repeats.
`block_of(module, blocks)` is the block a module path lies in ("" when none).
"""
from __future__ import annotations

import collections
import re

from tracer.stepgraph import Phase, StepGraph

BLOCK_RE = re.compile(r"^(.*?\.\d+)(?:\.|$)")


def repeated_blocks(graph: StepGraph) -> list[str]:
    return most_frequent_blocks(op.module for op in graph.ops if op.phase is Phase.FORWARD)


def most_frequent_blocks(module_paths) -> list[str]:
    """The block paths (`prefix.N`) the module paths run, in first-run order, of the prefix with the most
    blocks; [] when no prefix has two. The one rule for "the model's layers" (capture and passes)."""
    seen: dict[str, None] = {}
    for path in module_paths:
        if match := BLOCK_RE.match(path):
            seen.setdefault(match.group(1))
    prefixes = collections.Counter(b.rsplit(".", 1)[0] for b in seen)
    if not prefixes or prefixes.most_common(1)[0][1] < 2:
        return []
    top = prefixes.most_common(1)[0][0]
    return [b for b in seen if b.rsplit(".", 1)[0] == top]


def block_of(module: str, blocks: list[str] | set[str] | frozenset[str]) -> str:
    """The outermost of `blocks` that `module` is or lies inside ("" when none); blocks may be any module
    paths (a `--blocks` glob's matches), not only `prefix.N`."""
    parts = module.split(".")
    for i in range(1, len(parts) + 1):
        if (path := ".".join(parts[:i])) in blocks:
            return path
    return ""
