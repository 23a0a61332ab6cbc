"""A step with many identical blocks, from the same step captured with a few blocks.

    extrapolate_depth(samples: {depth: PolicyAnalysis}, depth) -> DepthEstimate

Why it is exact: with identical blocks, the bytes live at an op of block j in a model of k blocks are
alpha + beta * j + gamma * k for fixed alpha, beta, gamma per op "template" (what the same op sees in
every block: the blocks before it have saved their activations, the blocks after it have produced their
gradients, every block holds its parameters and optimizer state). Ops outside the blocks (embedding,
head, loss, optimizer) see alpha + gamma * k. So the peak of the deep model is the largest template
evaluated at the full depth, with j at either end of the middle blocks.

Templates: an op's block j is the block its module lies in (a module-less op in forward or backward,
such as the autograd engine summing gradients, belongs to the block of the op before it); its template
is (phase, first / middle / last block or none, module path with the block index removed, aten target,
ordinal among the ops of that block with the same module and target). Ops that allocate nothing are
skipped, except the first op of each phase: the bytes live at such an op are at most those at the op
before it, so none can be the only peak of its phase (this is what lets a foreach optimizer step, whose per-parameter scalar ops grow with the depth, be
extrapolated). The first and the last blocks are templates of their own (the first block reads the
embedding, the last feeds the head).

Checked, never assumed: the samples must have the same templates at every depth and every middle block
(so `checkpoint_every=2` or a for-loop optimizer raise DepthError), and every template's values must fit
its linear form exactly at every sample (three depths of at least 3 blocks: 6 middle-block points for 3
unknowns, 3 depths for 2). The totals (bytes before and after the step, saved bytes, parameters, FLOPs)
are checked the same way. DepthError says which op or number broke the structure.
"""
from __future__ import annotations

import dataclasses
from fractions import Fraction

from tracer.errors import TracerError
from tracer.passes.attribution import CATEGORIES
from tracer.passes.blocks import block_of, repeated_blocks
from tracer.passes.liveness import BEFORE_STEP
from tracer.stepgraph import OpNode, Phase


class DepthError(TracerError):
    """The samples are not the same step with a different number of identical blocks."""


@dataclasses.dataclass(frozen=True)
class DepthEstimate:
    policy: str
    depth: int                           # blocks of the estimated model
    sample_depths: tuple[int, ...]
    peak_bytes: int
    peak_phase: str
    peak_op: OpNode                      # the op at the peak, as captured in the largest sample
    peak_block: str                      # the block of the full model it runs in ("" outside the blocks)
    phases: dict[str, int]               # peak bytes per phase
    start_bytes: int
    end_bytes: int
    saved_bytes: int
    saved_activation_bytes: int
    by_category_at_peak: dict[str, int]
    lines_at_peak: tuple[tuple[str, int], ...]   # ("file:line" or "(role)", bytes), largest first
    parameter_count: int
    step_flops: int
    recompute_flops: int


_FIRST, _MIDDLE, _LAST, _NONE = "first", "middle", "last", ""


def extrapolate_depth(samples: dict, depth: int, *, top: int = 10) -> DepthEstimate:
    """`samples` maps a block count (at least 3, three counts) to the `PolicyAnalysis` of that model."""
    depths = tuple(sorted(samples))
    if len(depths) < 3 or depths[0] < 3:
        raise DepthError(f"need three sample depths of at least 3 blocks, got {list(depths)}")
    if depth < 3:
        raise DepthError(f"the full model has {depth} blocks: analyse it in full")
    points: dict[tuple, dict[tuple[int, int], tuple[int, int]]] = {}     # template -> (j, k) -> (op, bytes)
    for k, policy in samples.items():
        blocks = repeated_blocks(policy.graph)
        if len(blocks) != k:
            raise DepthError(f"the {k}-block sample has {len(blocks)} repeated blocks")
        for template, j, op_index in _templates(policy, blocks):
            if (j, k) in points.setdefault(template, {}):
                raise DepthError(f"two ops share the template {template} in the {k}-block sample")
            points[template][(j, k)] = (op_index, policy.liveness.live_during[op_index])
    _check_same_templates(points, depths)
    forms = {t: _fit(t[1], {jk: v for jk, (_, v) in pts.items()}, _describe(t)) for t, pts in points.items()}
    best = None
    phases: dict[str, int] = {}
    for template, form in forms.items():
        for j in _candidate_blocks(template, form, depth):
            value = _eval(form, j, depth)
            phase = template[0]
            phases[phase] = max(phases.get(phase, 0), value)
            if best is None or value > best[0]:
                best = (value, template, j)
    peak_value, peak_template, peak_j = best
    largest = samples[depths[-1]]
    sample_op = _sample_op(points[peak_template], peak_template, depths[-1])
    blocks = repeated_blocks(largest.graph)
    peak_block = "" if peak_template[1] == _NONE else f"{blocks[0].rsplit('.', 1)[0]}.{peak_j}"
    by_category, lines = _bill_at(samples, points[peak_template], peak_template, peak_j, depth, top)
    totals = {name: _fit_total(name, {k: value(samples[k]) for k in depths}, depth) for name, value in _TOTALS.items()}
    return DepthEstimate(
        policy=largest.policy, depth=depth, sample_depths=depths, peak_bytes=_bytes(peak_value),
        peak_phase=peak_template[0], peak_op=largest.graph.ops[sample_op], peak_block=peak_block,
        phases={p.value: _bytes(phases[p.value]) for p in Phase if p.value in phases},
        by_category_at_peak=by_category, lines_at_peak=lines, **totals)


_TOTALS = {
    "start_bytes": lambda p: p.start_bytes,
    "end_bytes": lambda p: p.end_bytes,
    "saved_bytes": lambda p: p.saved.total_bytes,
    "saved_activation_bytes": lambda p: p.saved.activation_bytes,
    "parameter_count": lambda p: p.graph.parameter_count,
    "step_flops": lambda p: p.step_flops,
    "recompute_flops": lambda p: p.recompute_flops,
}


def _templates(policy, blocks: list[str]):
    """(template, block index or None, op index) for every op that allocates."""
    graph, liveness = policy.graph, policy.liveness
    allocates = [False] * len(graph.ops)
    for iv in liveness.intervals:
        if iv.alloc_op is not None and iv.alloc_op != BEFORE_STEP and iv.nbytes:
            allocates[iv.alloc_op] = True
    index_of = {b: i for i, b in enumerate(blocks)}
    k = len(blocks)
    counts: dict[tuple, int] = {}
    previous: tuple[Phase, str] = (Phase.OPTIMIZER, "")
    for op in graph.ops:
        block = block_of(op.module, index_of)
        if not op.module and op.phase is not Phase.OPTIMIZER and previous[0] is op.phase:
            block = previous[1]
        starts_phase = previous[0] is not op.phase or op.index == 0
        previous = (op.phase, block)
        if not allocates[op.index]:
            if starts_phase:                    # what a phase starts with bounds its ops that allocate nothing
                yield (op.phase.value, _NONE, "(phase start)", "", False, 0), None, op.index
            continue
        if block:
            j = index_of[block]
            where = _FIRST if j == 0 else _LAST if j == k - 1 else _MIDDLE
            relative = "*" + op.module[len(block):]
        else:
            j, where, relative = None, _NONE, op.module
        base = (op.phase.value, where, relative, op.target, op.recomputed)
        ordinal = counts[(base, j)] = counts.get((base, j), -1) + 1
        yield base + (ordinal,), j, op.index


def _check_same_templates(points: dict, depths: tuple[int, ...]) -> None:
    for template, pts in points.items():
        where = template[1]
        for k in depths:
            expected = ({0} if where == _FIRST else {k - 1} if where == _LAST else
                        set(range(1, k - 1)) if where == _MIDDLE else {None})
            have = {j for (j, kk) in pts if kk == k}
            if have != expected:
                raise DepthError(f"{_describe(template)} runs in blocks {sorted(have, key=str)} of the {k}-block "
                                 f"sample, not {sorted(expected, key=str)}: the blocks are not identical",
                                 hint="analyse the model in full")


def _fit(where: str, values: dict[tuple[int, int], int], what: str) -> tuple[Fraction, Fraction, Fraction]:
    """(alpha, beta, gamma) with value = alpha + beta * j + gamma * k at every (j, k) point, exactly; beta
    is 0 outside the middle blocks (j is fixed there, or tied to k)."""
    pts = sorted(values)
    if where == _MIDDLE:
        form = _solve_plane([(j, k, values[(j, k)]) for j, k in pts])
    else:
        (_, k0), (_, k1) = pts[0], pts[1]
        gamma = Fraction(values[pts[1]] - values[pts[0]], k1 - k0)
        form = (values[pts[0]] - gamma * k0, Fraction(0), gamma)
    for (j, k), value in values.items():
        if _eval(form, j if where == _MIDDLE else 0, k) != value:
            raise DepthError(f"{what}: {value:,} B in the {k}-block sample is off the line through the other "
                             "samples", hint="the blocks are not identical; analyse the model in full")
    return form


def _solve_plane(triples: list[tuple[int, int, int]]) -> tuple[Fraction, Fraction, Fraction]:
    """alpha + beta j + gamma k = v through three non-collinear (j, k) points of `triples`."""
    for a in range(len(triples)):
        for b in range(a + 1, len(triples)):
            for c in range(b + 1, len(triples)):
                (j0, k0, v0), (j1, k1, v1), (j2, k2, v2) = triples[a], triples[b], triples[c]
                det = (j1 - j0) * (k2 - k0) - (j2 - j0) * (k1 - k0)
                if det:
                    beta = Fraction((v1 - v0) * (k2 - k0) - (v2 - v0) * (k1 - k0), det)
                    gamma = Fraction((j1 - j0) * (v2 - v0) - (j2 - j0) * (v1 - v0), det)
                    return v0 - beta * j0 - gamma * k0, beta, gamma
    raise DepthError("the middle blocks of the samples do not span two dimensions",
                     hint="sample at three depths of at least 3 blocks")


def _eval(form, j: int, k: int) -> Fraction:
    alpha, beta, gamma = form
    return alpha + beta * j + gamma * k


def _candidate_blocks(template: tuple, form, depth: int) -> tuple[int, ...]:
    where = template[1]
    if where == _MIDDLE:
        return (1,) if depth == 3 else (1, depth - 2)
    return (0 if where in (_FIRST, _NONE) else depth - 1,)


def _sample_op(points: dict, template: tuple, k: int) -> int:
    return min(op for (j, kk), (op, _) in points.items() if kk == k)


def _bill_at(samples: dict, points: dict, template: tuple, j: int, depth: int, top: int):
    """Bytes by category and by line at the peak op, each extrapolated like the op's live bytes."""
    from tracer.passes.attribution import attribute
    categories: dict[str, dict] = {c: {} for c in CATEGORIES}
    lines: dict[str, dict] = {}
    saved: dict[str, dict] = {}
    for (jj, k), (op_index, _) in points.items():
        policy = samples[k]
        bill = attribute(policy.graph, policy.liveness, policy.saved, policy.categories, op_index)
        for category, nbytes in bill.by_category.items():
            categories[category][(jj, k)] = nbytes
        for row in bill.lines:
            lines.setdefault(row.label, {})[(jj, k)] = row.bytes_at_peak
            saved.setdefault(row.label, {})[(0, k)] = row.saved_bytes
    where = template[1]
    at_j = j if where == _MIDDLE else 0

    def extrapolate(label: str, values: dict) -> int:
        if len(values) != len(points):
            return -1                                   # not live at the peak in every sample
        return _bytes(_eval(_fit(where, values, f"{label} at the peak"), at_j, depth))

    by_category = {c: max(0, extrapolate(c, v)) for c, v in categories.items()}
    rows = []
    for label, values in lines.items():
        nbytes = extrapolate(label, values)
        if nbytes > 0:
            saved_bytes = _bytes(_eval(_fit(_NONE, saved[label], f"{label} saved bytes"), 0, depth))
            rows.append((label, nbytes, saved_bytes))
    ranked = sorted(rows, key=lambda r: (-r[1], -r[2], r[0]))        # as attribution ranks its lines
    return by_category, tuple((label, nbytes) for label, nbytes, _ in ranked[:top])


def _fit_total(name: str, values: dict[int, int], depth: int) -> int:
    (k0, v0), (k1, v1), *rest = sorted(values.items())
    gamma = Fraction(v1 - v0, k1 - k0)
    for k, v in rest:
        if v0 + gamma * (k - k0) != v:
            raise DepthError(f"{name} is not linear in the number of blocks ({dict(sorted(values.items()))})",
                             hint="analyse the model in full")
    return _bytes(v0 + gamma * (depth - k0))


def _bytes(value: Fraction) -> int:
    if value.denominator != 1:
        raise DepthError(f"a fractional byte count ({value}) came out of the extrapolation")
    return int(value)


def _describe(template: tuple) -> str:
    phase, where, module, target, recomputed, ordinal = template
    block = f" ({where} block)" if where else ""
    again = " (recomputed)" if recomputed else ""
    return f"{phase} op {target}{again} #{ordinal} in {module or '(root)'}{block}"
