"""The analysis pipeline: a straight list of pure passes over one `StepGraph`.

`analyze_graph(graph)` returns an `Analysis` with one `PolicyAnalysis` per simulated policy. Today the
policy is `eager` (what autograd saves and frees, op by op); recompute policies plug in here later.
"""
from __future__ import annotations

import dataclasses

from tracer.passes.attribution import Attribution, attribute, categorize
from tracer.passes.liveness import Liveness, compute_liveness
from tracer.passes.saved import SavedTensors, find_saved_tensors
from tracer.stepgraph import OpNode, Phase, StepGraph


@dataclasses.dataclass(frozen=True)
class PhasePeak:
    phase: str
    peak_bytes: int
    op_index: int


@dataclasses.dataclass(frozen=True)
class PolicyAnalysis:
    policy: str
    peak_bytes: int
    peak_op: OpNode
    phases: dict[str, PhasePeak]
    start_bytes: int
    end_bytes: int
    saved: SavedTensors
    at_peak: Attribution
    liveness: Liveness
    categories: tuple[str, ...]           # bill category per storage id

    @property
    def peak_phase(self) -> str:
        return self.peak_op.phase.value


@dataclasses.dataclass(frozen=True)
class Analysis:
    graph: StepGraph
    policies: dict[str, PolicyAnalysis]


def analyze_graph(graph: StepGraph) -> Analysis:
    return Analysis(graph=graph, policies={"eager": analyze_policy(graph, "eager")})


def analyze_policy(graph: StepGraph, policy: str) -> PolicyAnalysis:
    liveness = compute_liveness(graph)
    saved = find_saved_tensors(graph, liveness)
    categories = categorize(graph, liveness, saved)
    at_peak = attribute(graph, liveness, saved, categories, liveness.peak_op)
    return PolicyAnalysis(
        policy=policy,
        peak_bytes=liveness.peak_bytes,
        peak_op=graph.ops[liveness.peak_op],
        phases=phase_peaks(graph, liveness),
        start_bytes=liveness.start_bytes,
        end_bytes=liveness.live_after[-1] if liveness.live_after else liveness.start_bytes,
        saved=saved,
        at_peak=at_peak,
        liveness=liveness,
        categories=categories,
    )


def phase_peaks(graph: StepGraph, liveness: Liveness) -> dict[str, PhasePeak]:
    peaks: dict[str, PhasePeak] = {}
    for op in graph.ops:
        bytes_now = liveness.live_during[op.index]
        best = peaks.get(op.phase.value)
        if best is None or bytes_now > best.peak_bytes:
            peaks[op.phase.value] = PhasePeak(op.phase.value, bytes_now, op.index)
    return {p.value: peaks[p.value] for p in Phase if p.value in peaks}
