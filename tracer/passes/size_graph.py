"""A step graph at another size (batch, or sequence length), built from the same step captured at a few sizes.

    SizedSteps(samples) -> .at(size) -> StepGraph

Structure used (the one tracer/passes/fit.py relies on): with everything else fixed, the op sequence of a
captured step is the same at every size, and every integer in it (a storage's bytes, a tensor's shape, a
view's size argument, the config's batch or seq) is a polynomial in the batch of degree 1 and in the
sequence length of degree at most 2 (attention scores are s x s). Given the step at degree + 1 sizes,
each integer that differs between them is interpolated exactly (rational interpolation), and everything
else must be equal in every sample. The result is the step the capture would make at that size, as long
as the structure holds there; nothing here checks that it does (a kernel whose buffer is padded to a
multiple of 32 rows is linear only on the multiples): the caller compares full analyses at the sizes it
reports (tracer/planning.py).

Integers that label things rather than count them (autograd node ids, numbered as the capturing process
goes) are kept as the first sample numbers them, where every sample groups the same ops under one label.
Raises SizeError when the samples differ in anything but integers (the graph changes with the size), or
an interpolated integer is not a whole number at the size asked for (or a size or count below 0).
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

from tracer.errors import TracerError
from tracer.passes.fit import interpolate
from tracer.stepgraph import StepGraph


class SizeError(TracerError):
    """The sampled steps are not one step whose integers are polynomials of the size."""


class SizedSteps:
    """The steps captured at `samples` (size -> StepGraph, at least two sizes), ready to be built at any
    size (`at`). Raises SizeError at construction when the samples differ in anything but integers."""

    def __init__(self, samples: dict[int, StepGraph]):
        if len(samples) < 2:
            raise SizeError(f"a step at another size needs at least two sampled sizes, got {sorted(samples)}")
        self.sizes = tuple(sorted(samples))
        self._template = _template(tuple(samples[size] for size in self.sizes), self.sizes)

    def at(self, size: int) -> StepGraph:
        """The step at `size` (at a sampled size, a graph equal to that sample but for the labels kept from the
        first sample, `_IDENTIFIERS`)."""
        return _build(self._template, size)


# integers that label things (numbered as the capture process goes, not by the size): kept as the first
# sample numbers them, where every sample groups the same things under one label
_IDENTIFIERS = frozenset(("OpNode.autograd_node",))


@dataclasses.dataclass(frozen=True, eq=False)
class _Varying:
    """An integer that differs between the samples: its polynomial's coefficients (c0, c1, ...)."""
    coefficients: tuple[Fraction, ...]
    where: str

    def at(self, size: int) -> int:
        value = sum(c * size**k for k, c in enumerate(self.coefficients))
        if value.denominator != 1 or value < 0:
            raise SizeError(f"{self.where} is {float(value):,.2f} at size {size}: not a count, so the step's "
                            "structure changes with the size")
        return int(value)


def _template(graphs: tuple, sizes: tuple[int, ...]):
    """The samples merged into one structure: what is equal in every sample shared as it is, an integer
    that differs as `_Varying`, and a tuple or dataclass holding one as `_Tuple` or `_Node`."""
    memo: dict = {}
    renamed: dict = {}              # (field, sample, its value) -> the first sample's, and back

    def merge(values: tuple, where: str):
        first = values[0]
        if all(v is first for v in values[1:]):
            return first
        if where in _IDENTIFIERS:
            return same_identifier(values, where)
        kind = type(first)
        if any(type(v) is not kind for v in values[1:]):
            raise SizeError(f"{where} differs in kind between the sampled sizes")
        if kind is int:
            if all(v == first for v in values[1:]):
                return first
            return _Varying(interpolate(list(sizes), list(values)), where)
        if kind is tuple or (dataclasses.is_dataclass(first) and not isinstance(first, type)):
            key = tuple(map(id, values))
            if key not in memo:
                memo[key] = merge_parts(values, kind, where)
            return memo[key]
        if all(v == first for v in values[1:]):
            return first
        raise SizeError(f"{where} differs between the sampled sizes ({values[0]!r} and {values[1]!r})")

    def same_identifier(values: tuple, where: str):
        # the first sample's label, where each sample labels the same things alike
        for k, value in enumerate(values[1:], start=1):
            if renamed.setdefault((where, k, value), values[0]) != values[0] or \
                    renamed.setdefault((where, -k, values[0]), value) != value:
                raise SizeError(f"{where} groups the step's ops differently at sizes {sizes[0]} and {sizes[k]}")
        return values[0]

    def merge_parts(values: tuple, kind: type, where: str):
        first = values[0]
        if kind is tuple:
            if any(len(v) != len(first) for v in values[1:]):
                raise SizeError(f"{where} has {', '.join(str(len(v)) for v in values)} entries at sizes "
                                f"{', '.join(map(str, sizes))}")
            items = tuple(merge(tuple(v[i] for v in values), where) for i in range(len(first)))
            return _Tuple(items) if any(isinstance(m, _MARKERS) for m in items) else first
        fields = {f.name: merge(tuple(getattr(v, f.name) for v in values), f"{kind.__name__}.{f.name}")
                  for f in dataclasses.fields(first)}
        return _Node(kind, fields) if any(isinstance(m, _MARKERS) for m in fields.values()) else first

    return merge(graphs, "the step")


@dataclasses.dataclass(frozen=True, eq=False)
class _Node:
    """A dataclass instance with a field that varies: rebuilt at each size."""
    kind: type
    fields: dict


@dataclasses.dataclass(frozen=True, eq=False)
class _Tuple:
    """A tuple with an entry that varies: rebuilt at each size."""
    items: tuple


_MARKERS = (_Varying, _Node, _Tuple)


def _build(template, size: int):
    built: dict = {}

    def build(value):
        if isinstance(value, _Varying):
            return value.at(size)
        if isinstance(value, _Tuple):
            if id(value) not in built:
                built[id(value)] = tuple(build(v) for v in value.items)
            return built[id(value)]
        if isinstance(value, _Node):
            if id(value) not in built:
                obj = object.__new__(value.kind)
                for name, field in value.fields.items():
                    object.__setattr__(obj, name, build(field))
                built[id(value)] = obj
            return built[id(value)]
        return value

    return build(template)
