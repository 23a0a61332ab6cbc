"""The default capture of a deep model: a few blocks captured, the full depth synthesized, the synthesis
checked against a capture.

`capture_deep(source, capture, check, options)`: when the model's repeated block list (planning.py's
`cut_source`) has more than `BASE_DEPTH + CHECK_DEPTH` blocks (fewer are captured in full at less
cost, unless the two cuts are captured at once in two processes: then a model of more than
`CUT_BESIDE_DEEPER_THAN` blocks costs its deeper cut, and is cut: tracer/pipeline.py), the step is
captured with the list cut to `BASE_DEPTH` and to `CHECK_DEPTH` blocks; the `CHECK_DEPTH`-block step is
synthesized from the `BASE_DEPTH` one
(tracer/passes/depth_graph.py: two copies of a middle block, so a copy next to a copy is exercised) and
analysed with the caller's options (liveness, saved tensors, attribution, the device view, sharding); only
if that analysis equals the captured one op for op (`first_difference`) is the full-depth step
synthesized the same way, and every pass and report runs on it as on a captured step.

Where the check fails and the `CHECK_DEPTH`-block capture hands a buffer on across r > 1 blocks
(compiled code: Inductor's plan gives a block's weight gradient a buffer later blocks used in backward;
depth_graph.block_reach), the result carries a `Retry`: the caller cuts again in units of r blocks
(`cut_depths(depth, r)`: `BASE_DEPTH` and `CHECK_DEPTH` units) and checks that synthesis the same way, when
the deeper of those two cuts captures at most half the model's depth (`cut_pays`; a check in units
of r that asks for larger units still is cut again in those). A compiled policy planned for a CUDA target,
whose plan hands buffers on so, may skip the cut in units of one block and be cut in `HANDED_ON_UNITS` at
once (`CutSteps.ahead`: the caller leaves it out of its first cut, tracer/pipeline.py). Otherwise the caller
captures in full, with the returned note saying why (which op or number broke the synthesis). Models with at most
`BASE_DEPTH + CHECK_DEPTH` blocks, no repeated block list, or `full_capture` are captured in full without a
note. Not covered by the check: a difference that only appears beyond the check's depth (the blocks are
identical modules, so the step of each is the same program).

The three steps are also callable one by one (`find_block_list`, `capture_cut`, `check_synthesis`), so
the two cut captures can run in different processes (tracer/levers.py) with the same result.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Callable

from tracer.errors import TracerError
from tracer.stepgraph import StepGraph

BASE_DEPTH = 4                 # captured and synthesized from: two middle blocks to align
CHECK_DEPTH = 6                # captured and compared with its synthesis: two copies
# with the two cuts captured at once in two processes (tracer/pipeline.py), a model of more blocks than this
# costs its deeper cut, not its depth
CUT_BESIDE_DEEPER_THAN = CHECK_DEPTH + 1
# the units of blocks a compiled policy planned for a CUDA target is cut in at once: Inductor's Triton plan
# hands buffers on from block to block, and its synthesis in units of one block failed its check, or its
# 4-block step already handed buffers on across 2 blocks, on every model measured (llama-88m, llama-7b,
# llama-70b, gpt2-124m, gpt2-1558m)
HANDED_ON_UNITS = 2
_CHECKED = re.compile(r"depth: captured \d+ and \d+ of ")     # the note of a checked synthesis begins so


@dataclasses.dataclass(frozen=True)
class DeepCapture:
    graphs: tuple[StepGraph | None, ...]     # at the full depth, per captured graph (None: capture it in full)
    note: str | None                         # why those are captured in full (None: silently)
    retry: "Retry | None" = None             # the units of blocks a second cut may synthesize those in


@dataclasses.dataclass(frozen=True)
class Retry:
    """Cut again in units of `group` blocks (`capture_cut(..., group=group)`): the checked synthesis in
    units of one block differed, and its check capture hands buffers on across `group` blocks
    (depth_graph.block_reach), while the two cuts in units of `group` still capture at most half the depth."""
    blocks: "BlockList"
    group: int


@dataclasses.dataclass(frozen=True)
class BlockList:
    """A model's repeated block list deeper than `BASE_DEPTH + CHECK_DEPTH` blocks: its module path and its length."""
    path: str
    depth: int


@dataclasses.dataclass(frozen=True)
class CutSteps:
    """The step graphs of a model cut to `BASE_DEPTH` and to `CHECK_DEPTH` blocks (one per captured graph),
    or the TracerError that stopped the first capture that failed (then `base` or `check` is None).
    `checked_on`: `check` is None because the synthesis of this model was checked on another capture of it
    (named here: "a 6-block capture of" a variant of the same model, tracer/levers.py), so only `base` was
    captured."""
    blocks: BlockList
    base: tuple[StepGraph, ...] | None
    check: tuple[StepGraph, ...] | None
    error: TracerError | None = None
    checked_on: str | None = None
    prepared: "PreparedSynthesis | None" = None     # prepare_synthesis(base), made while `check` was captured
    group: int = 1                                  # blocks per synthesized unit (cut_depths)
    # graph index -> the units of blocks it is cut in at once (`HANDED_ON_UNITS`); not captured in this cut
    # (its `base` and `check` entries are None)
    ahead: dict[int, int] = dataclasses.field(default_factory=dict)


def cut_depths(depth: int, group: int = 1) -> tuple[int, int]:
    """The depths the model is cut to for a synthesis in units of `group` blocks: `BASE_DEPTH` units (the
    last one longer by what `depth` leaves over, so the copies reach `depth` exactly) and that plus
    `CHECK_DEPTH - BASE_DEPTH` units."""
    base = BASE_DEPTH * group + (depth - BASE_DEPTH * group) % group
    return base, base + (CHECK_DEPTH - BASE_DEPTH) * group


def cut_source(source, depth: int, seen: dict):
    """`source` whose build_model() keeps the first `depth` blocks of the repeated block list; records the
    list's path and full length in `seen`."""
    def build_model():
        model = source.build_model()
        path, blocks = _block_list(model)
        seen.update(path=path, depth=len(blocks))
        if depth < len(blocks):
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent) if parent else model, name, type(blocks)(list(blocks)[:depth]))
        return model
    return dataclasses.replace(source, build_model=build_model)


def _block_list(model) -> tuple[str, object]:
    from torch import nn
    best = None
    for path, module in model.named_modules():
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2 \
                and len({type(m) for m in module}) == 1 and (best is None or len(module) > len(best[1])):
            best = (path, module)
    if best is None:
        from tracer.passes.depth import DepthError
        raise DepthError(f"{type(model).__name__} has no nn.ModuleList or nn.Sequential of repeated blocks")
    return best


def find_block_list(source, *, precision: str, seq: int, deeper_than: int | None = None) -> BlockList | None:
    """The block list to synthesize `source`'s depth from, or None (no repeated block list, or at most
    `deeper_than` blocks: by default `BASE_DEPTH + CHECK_DEPTH`, where the two cut captures would cost as
    much as the full one): found by building the model cut to `BASE_DEPTH` under fake tensors."""
    from tracer.capture.build import probe_build
    from tracer.passes.depth import DepthError

    seen: dict = {}
    try:
        probe_build(cut_source(source, BASE_DEPTH, seen), precision, seq)
    except (TracerError, DepthError):
        return None                                 # no block list: the full capture says what is wrong
    depth, path = seen.get("depth", 0), seen.get("path", "")
    return BlockList(path, depth) if depth > (BASE_DEPTH + CHECK_DEPTH if deeper_than is None else deeper_than) \
        else None


def capture_cut(source, blocks: BlockList, capture: Callable[[object], tuple[StepGraph, ...]],
                say: Callable[[str], None] = lambda message: None, group: int = 1) -> CutSteps:
    """`capture(source)` of `source` cut to the two `cut_depths` (`BASE_DEPTH` and `CHECK_DEPTH` blocks in
    units of one); a TracerError is kept in the result (the caller captures in full and says why)."""
    base_depth, check_depth = cut_depths(blocks.depth, group)
    say(f"capturing {source.name} cut to {base_depth} and {check_depth} of its {blocks.depth} blocks under fake "
        "tensors ...")
    try:
        base = capture(cut_source(source, base_depth, {}))
    except TracerError as exc:
        return CutSteps(blocks, None, None, exc, group=group)
    try:
        return CutSteps(blocks, base, capture(cut_source(source, check_depth, {})), group=group)
    except TracerError as exc:
        return CutSteps(blocks, base, None, exc, group=group)


def capture_deep(source, capture: Callable[[object], tuple[StepGraph, ...]],
                 analyze: Callable[[int, StepGraph], object], *, count: int, precision: str, seq: int,
                 say: Callable[[str], None] = lambda message: None, cut: CutSteps | None = None) -> DeepCapture:
    """`capture(source)`: the `count` step graphs of a source; `analyze(i, graph)`: the PolicyAnalysis of
    the i-th graph with the caller's options. A graph whose check fails is left to the full capture.
    `cut`: the two cut captures already made (`find_block_list`, then `capture_cut` or one process per
    depth: tracer/levers.py), else made here."""
    if cut is None:
        blocks = find_block_list(source, precision=precision, seq=seq)
        if blocks is None:
            return DeepCapture((None,) * count, None)
        cut = capture_cut(source, blocks, capture, say)
    return check_synthesis(cut, analyze, count=count)


@dataclasses.dataclass(frozen=True)
class PreparedSynthesis:
    """What `check_synthesis` computes from the `BASE_DEPTH`-block graphs alone, per graph: the analysis of
    its `CHECK_DEPTH`-block synthesis and its full-depth synthesis, or the DepthError text that refuses
    them. Made while the `CHECK_DEPTH`-block capture is still under way (tracer/pipeline.py)."""
    synthesized_check: tuple            # PolicyAnalysis | None per graph (None: refused)
    full: tuple                         # StepGraph | None per graph
    refused: tuple                      # str | None per graph


def prepare_synthesis(base: tuple[StepGraph, ...], analyze: Callable[[int, StepGraph], object],
                      depth: int, group: int = 1, deferred: dict[int, str] | None = None) -> PreparedSynthesis:
    """The synthesized side of the check of `base` and its synthesis at `depth` blocks. `deferred`: graph
    index -> why it is not checked in this cut (a graph cut in larger units at once: its `base` entry is
    None), refused here with that reason."""
    from tracer.passes.depth import DepthError
    from tracer.passes.depth_graph import synthesize_depth

    base_depth, check_depth = cut_depths(depth, group)
    checks, fulls, refused = [], [], []
    for i, graph in enumerate(base):
        if i in (deferred or {}):
            checks.append(None)
            fulls.append(None)
            refused.append(deferred[i])
            continue
        try:
            checks.append(analyze(i, synthesize_depth(graph, check_depth, group)))
            fulls.append(synthesize_depth(graph, depth, group))
            refused.append(None)
        except DepthError as exc:
            checks.append(None)
            fulls.append(None)
            refused.append(str(exc).splitlines()[0])
    return PreparedSynthesis(tuple(checks), tuple(fulls), tuple(refused))


def check_synthesis(cut: CutSteps, analyze: Callable[[int, StepGraph], object], *, count: int) -> DeepCapture:
    """The full-depth graphs synthesized from `cut.base`, each where its `CHECK_DEPTH`-block synthesis
    equals `cut.check` op for op (`analyze(i, graph)`: the PolicyAnalysis of the i-th graph; `cut.prepared`:
    `prepare_synthesis` of `cut.base`, when already made)."""
    depth, path = cut.blocks.depth, cut.blocks.path
    fallback = f"depth: captured all {depth} blocks of {path}"
    if cut.error is not None:
        return DeepCapture((None,) * count, f"{fallback}: the model cut to a few blocks cannot be captured "
                                            f"({str(cut.error).splitlines()[0]})")
    if cut.checked_on is not None and cut.check is None:
        return _synthesized_unchecked(cut, count)
    base = cut.base
    base_depth, check_depth = cut_depths(depth, cut.group)
    prepared = cut.prepared or prepare_synthesis(base, analyze, depth, cut.group)
    differences = synthesis_differences(prepared, cut.check, analyze)
    units = f" in units of {cut.group} blocks" if cut.group > 1 else ""
    note = (f"depth: captured {base_depth} and {check_depth} of {depth} blocks of {path}; the {check_depth}-block "
            f"step synthesized from {base_depth}{units} equals its capture op for op, the {depth}-block step is "
            "synthesized")
    graphs = tuple(None if i in differences else _with_note(prepared.full[i], note) for i in range(len(base)))
    compared = [why for i, why in differences.items() if cut.check[i] is not None]
    reasons = ([f"the {check_depth}-block step synthesized from {base_depth} blocks{units} differs from its capture "
                f"({'; '.join(compared)})"] if compared else []) + \
        [why for i, why in differences.items() if cut.check[i] is None]       # refused before any comparison
    return DeepCapture(graphs, None if not differences else f"{fallback}: {'; '.join(reasons)}",
                       retry=_retry(cut, differences))


def _retry(cut: CutSteps, differences: dict[int, str]) -> Retry | None:
    """A `Retry` in units of the longest reach of a differing graph's check capture (its base capture's where
    it has none; the units it is cut in at once where it is `ahead`), where that is more blocks than this
    cut's units and a cut in those units pays (`cut_pays`)."""
    from tracer.passes.depth_graph import block_reach

    reach = max((cut.ahead[i] if i in cut.ahead else
                 block_reach(cut.check[i] if cut.check[i] is not None else cut.base[i]) for i in differences),
                default=0)
    if reach <= cut.group or not cut_pays(cut.blocks.depth, reach):
        return None
    return Retry(cut.blocks, reach)


def cut_pays(depth: int, group: int) -> bool:
    """The deeper of two cuts in units of `group` blocks captures at most half of `depth` blocks: made in two
    processes, the cuts take at most about half the full capture's time, and made one after the other at
    most 5/6 of it (a check that then differs adds the full capture's time)."""
    return 2 * cut_depths(depth, group)[1] <= depth


def synthesis_differences(prepared: PreparedSynthesis, check: tuple[StepGraph, ...],
                          analyze: Callable[[int, StepGraph], object]) -> dict[int, str]:
    """Graph index -> "<policy>: why" for each graph whose `CHECK_DEPTH`-block synthesis (`prepared`) is
    refused or differs from its capture in `check`; empty when every synthesis is checked."""
    differences = {}
    for i, captured in enumerate(check):
        if captured is None:                  # cut in larger units at once: its refusal names the policy
            differences[i] = prepared.refused[i]
            continue
        difference = prepared.refused[i] or first_difference(prepared.synthesized_check[i], analyze(i, captured))
        if difference:
            differences[i] = f"{captured.config.policy}: {difference}"
    return differences


def _synthesized_unchecked(cut: CutSteps, count: int) -> DeepCapture:
    """The full-depth graphs synthesized from `cut.base` alone: the comparison with a `CHECK_DEPTH`-block
    capture was made on `cut.checked_on`; the synthesis still aligns blocks 1 and 2 op by op, so a graph
    whose blocks differ (DepthError) is left to the full capture."""
    from tracer.passes.depth import DepthError
    from tracer.passes.depth_graph import synthesize_depth

    depth, path = cut.blocks.depth, cut.blocks.path
    note = (f"depth: captured {BASE_DEPTH} of {depth} blocks of {path}, the {depth}-block step is synthesized; "
            f"the synthesis was checked op for op against {cut.checked_on}")
    graphs, differences = [], []
    for graph in cut.base[:count]:
        try:
            graphs.append(_with_note(synthesize_depth(graph, depth), note))
        except DepthError as exc:
            graphs.append(None)
            differences.append(f"{graph.config.policy}: {str(exc).splitlines()[0]}")
    return DeepCapture(tuple(graphs), None if not differences else
                       f"depth: captured all {depth} blocks of {path}: the step cut to {BASE_DEPTH} blocks cannot "
                       f"be synthesized ({'; '.join(differences)})")


def synthesis_checked(graph: StepGraph) -> bool:
    """Whether `graph` was synthesized at its depth after the `CHECK_DEPTH`-block comparison passed."""
    return any(_CHECKED.match(note) for note in graph.config.notes)


def with_note(graph: StepGraph, note: str | None) -> StepGraph:
    """`graph` with `note` among its capture notes (the reports print them)."""
    return graph if note is None else _with_note(graph, note)


def _with_note(graph: StepGraph, note: str) -> StepGraph:
    return dataclasses.replace(graph, config=dataclasses.replace(graph.config, notes=graph.config.notes + (note,)))


def first_difference(synthesized, captured) -> str | None:
    """The first number on which two PolicyAnalysis differ, named, or None when every one is equal: live
    bytes at every op, phase peaks, saved bytes, the bill and lines at the peak, FLOPs, and the device,
    per-rank and host views when present."""
    a_ops, b_ops = synthesized.graph.ops, captured.graph.ops
    if len(a_ops) != len(b_ops):
        return f"{len(a_ops)} ops synthesized, {len(b_ops)} captured"
    for name, (a, b) in (("live bytes during", (synthesized.liveness.live_during, captured.liveness.live_during)),
                         ("live bytes after", (synthesized.liveness.live_after, captured.liveness.live_after))):
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                op = b_ops[i]
                return f"{name} op {i} ({op.target} in {op.module or '(root)'}): {x:,} B synthesized, {y:,} captured"
    for name, x, y in _numbers(synthesized, captured):
        if x != y:
            return f"{name}: {x!r} synthesized, {y!r} captured"
    return None


def _numbers(a, b):
    yield "peak", (a.peak_bytes, a.peak_op.index), (b.peak_bytes, b.peak_op.index)
    yield "phases", _phases(a), _phases(b)
    yield "start and end bytes", (a.start_bytes, a.end_bytes), (b.start_bytes, b.end_bytes)
    yield "saved bytes", (a.saved.total_bytes, a.saved.activation_bytes), (b.saved.total_bytes, b.saved.activation_bytes)
    yield "parameters", _parameters(a.graph), _parameters(b.graph)
    yield "FLOPs", (a.step_flops, a.recompute_flops), (b.step_flops, b.recompute_flops)
    yield "bill at the peak", a.at_peak.by_category, b.at_peak.by_category
    yield "lines at the peak", _rows(a.at_peak.lines), _rows(b.at_peak.lines)
    yield "layers at the peak", _rows(a.at_peak.layers), _rows(b.at_peak.layers)
    for view in ("device", "rank_device"):
        yield f"{view} view", _device(getattr(a, view)), _device(getattr(b, view))
    yield "per-rank memory", _sharded(a.sharded), _sharded(b.sharded)
    yield "host memory", a.host, b.host


def _phases(result) -> dict:
    return {name: (p.peak_bytes, p.op_index) for name, p in result.phases.items()}


def _parameters(graph: StepGraph) -> tuple[int, int]:
    return graph.parameter_count, graph.frozen_parameter_count


def _rows(rows) -> list:
    return [dataclasses.astuple(row) for row in rows]


def _device(view):
    if view is None:
        return None
    return (view.peak_bytes, view.peak_op_index, view.phases, view.before_bytes, view.allocated_peak_bytes,
            view.reserved_peak_bytes, view.segment_count, view.oom is None)


def _sharded(view):
    if view is None:
        return None
    return (view.peak_bytes, view.peak_op_index, view.phases, view.live_during, view.by_category_at_peak,
            view.model_state_bytes, view.start_bytes)
