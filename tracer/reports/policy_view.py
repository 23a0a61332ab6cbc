"""How the renderers look up one policy of an `Analysis`, and the hooks recompute policies plug into.

Every renderer in `tracer.reports` reads a policy through these functions, so the policies being added
(compiled, selective, full recompute: all `PolicyAnalysis`) show up in every report without renderer
changes. The hooks read what exists today and fall back cleanly:
  * `policy_graph`: a policy may carry its own `graph` (a recompute policy that adds ops); otherwise the
    analysis' graph, whose op indices the policy's liveness uses.
  * `is_recomputed(op)`: true for ops marked `recomputed` (a forward op re-run in backward), or whose
    phase is "recompute" (STYLE habit 5), when the step graph has either.
  * `recompute_flops_by_line(result)`: the policy's `recompute_flops_by_line` ({"file:line": flops}) when
    it has one, else None (the recompute FLOPs column is then left out).
"""
from __future__ import annotations

from tracer.errors import UsageError
from tracer.passes.analysis import Analysis, PolicyAnalysis
from tracer.stepgraph import OpNode, StepGraph

RECOMPUTE_PHASE = "recompute"


def policy_result(analysis: Analysis, policy: str) -> PolicyAnalysis:
    """The named policy. Raises UsageError naming the valid policies when it is not in the analysis."""
    try:
        return analysis.policies[policy]
    except KeyError:
        raise UsageError(f"unknown policy {policy!r}; this analysis has: {', '.join(analysis.policies)}") from None


def policy_graph(analysis: Analysis, result: PolicyAnalysis) -> StepGraph:
    return getattr(result, "graph", None) or analysis.graph


def is_recomputed(op: OpNode) -> bool:
    return bool(getattr(op, "recomputed", False)) or getattr(op.phase, "value", op.phase) == RECOMPUTE_PHASE


def recompute_flops_by_line(result: PolicyAnalysis) -> dict[str, int] | None:
    value = getattr(result, "recompute_flops_by_line", None)
    return dict(value) if value is not None else None
