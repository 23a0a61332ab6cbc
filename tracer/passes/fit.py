"""The largest size (batch, or sequence length) whose peak fits a memory budget, from a few measured sizes.

    fit_peak_model(sizes, live_bytes, degree) -> PeakModel
    largest_fitting_size(model, budget_bytes) -> int          (0 when not even size 1 fits)

Structure used: with everything else fixed, every storage of a captured step has a size that is a
polynomial in the batch size of degree 1 and in the sequence length of degree at most 2 (attention
scores are s x s), and the op sequence is the same at every size. So the bytes live at each op are such a
polynomial, and the peak at any size is the maximum over ops of those polynomials. Given the live bytes of
every op (`Liveness.live_during`) at degree + 1 sizes, the per-op polynomials are recovered exactly
(rational interpolation); sizes beyond degree + 1 check them. The peak model is then exact, not fitted,
at every size. When only the peaks of a few candidates are known (per-phase peaks), the same code
interpolates those; that is exact only while each candidate's maximum stays at the same op, so callers
verify the answer with a full analysis.

The peak is assumed not to decrease with the size (so the largest fitting size is found by bisection).

Raises FitError when the sizes disagree on the number of ops (the graph changed with the size), when a
checking size contradicts the interpolation, or when fewer than degree + 1 sizes are given.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction
from typing import Sequence

from tracer.errors import TracerError

MAX_SIZE = 1 << 40


class FitError(TracerError):
    """The peaks at the sampled sizes do not have the structure the fit relies on."""


@dataclasses.dataclass(frozen=True)
class PeakModel:
    degree: int
    coefficients: tuple[tuple[Fraction, ...], ...]   # per candidate (op): c0, c1[, c2]; bytes = sum c_k x^k

    def peak_bytes(self, size: int) -> int:
        """The peak at `size`: the largest candidate, rounded up to whole bytes."""
        best = max(sum(c * size**k for k, c in enumerate(cs)) for cs in self.coefficients)
        return -((-best.numerator) // best.denominator)


def fit_peak_model(sizes: Sequence[int], live_bytes: Sequence[Sequence[int]], degree: int, *,
                   check: bool = True) -> PeakModel:
    """Per-candidate polynomials of `degree` through the bytes measured at `sizes` (one row per size, one
    column per candidate: an op's live bytes, or a phase's peak). Sizes beyond the first degree + 1 check
    the polynomials unless `check` is False (an approximate fit through the largest sizes)."""
    if len(sizes) != len(live_bytes):
        raise FitError(f"{len(sizes)} sizes but {len(live_bytes)} measurements")
    if len(set(sizes)) < degree + 1:
        raise FitError(f"a degree-{degree} fit needs {degree + 1} distinct sizes, got {sorted(set(sizes))}")
    widths = {len(row) for row in live_bytes}
    if len(widths) != 1:
        counts = ", ".join(f"{len(row)} at size {x}" for x, row in zip(sizes, live_bytes))
        raise FitError(f"the step has a different number of ops at different sizes ({counts})",
                       hint="the graph changes with the size; fit from the phase peaks instead")
    basis = list(range(degree + 1)) if check else list(range(len(sizes) - degree - 1, len(sizes)))
    columns = list(zip(*live_bytes))
    coefficients = []
    seen: dict[tuple, tuple[Fraction, ...]] = {}
    for column in columns:
        key = tuple(column)
        if key not in seen:
            seen[key] = interpolate([sizes[i] for i in basis], [column[i] for i in basis])
            for x, y in zip(sizes[degree + 1:], column[degree + 1:]) if check else ():
                predicted = sum(c * x**k for k, c in enumerate(seen[key]))
                if predicted != y:
                    raise FitError(f"bytes at size {x} are {y:,}, not the {float(predicted):,.0f} that sizes "
                                   f"{[sizes[i] for i in basis]} imply for a degree-{degree} polynomial")
            coefficients.append(seen[key])
    return PeakModel(degree=degree, coefficients=tuple(dict.fromkeys(coefficients)))


def largest_fitting_size(model: PeakModel, budget_bytes: int, *, multiple: int = 1) -> int:
    """The largest multiple of `multiple` whose peak is at most `budget_bytes`; 0 when none is."""
    step = max(1, multiple)
    if model.peak_bytes(step) > budget_bytes:
        return 0
    low, high = 1, 2                                  # in units of `step`: low fits, high is unknown
    while model.peak_bytes(high * step) <= budget_bytes:
        low, high = high, high * 2
        if high * step > MAX_SIZE:
            raise FitError(f"the peak stays under {budget_bytes:,} B up to size {low * step:,}: it does not "
                           "grow with the size")
    while high - low > 1:
        mid = (low + high) // 2
        if model.peak_bytes(mid * step) <= budget_bytes:
            low = mid
        else:
            high = mid
    return low * step


def interpolate(xs: list[int], ys: list[int]) -> tuple[Fraction, ...]:
    """Coefficients (lowest degree first) of the polynomial through (xs, ys), by Newton's divided differences."""
    n = len(xs)
    table = [Fraction(y) for y in ys]
    for level in range(1, n):
        for i in range(n - 1, level - 1, -1):
            table[i] = (table[i] - table[i - 1]) / (xs[i] - xs[i - level])
    coefficients = [Fraction(0)] * n
    for i in range(n - 1, -1, -1):                    # expand the Newton form into monomials
        coefficients = [Fraction(0)] + coefficients[:-1]          # multiply by x ...
        for k in range(n - 1):
            coefficients[k] -= xs[i] * coefficients[k + 1]        # ... minus xs[i]
        coefficients[0] += table[i]
    return tuple(coefficients)
