"""Repeated blocks analysed once: a deep model extrapolated from the same model cut to 3, 4 and 5 blocks
(tracer/passes/depth.py, tracer.planning.analyze_by_depth) equals the full analysis, number for number."""
import os

import pytest

import tracer
from tracer.passes.depth import DepthError, extrapolate_depth
from tracer.planning import analyze_by_depth

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
LLAMA6 = os.path.join(FIXTURES, "llama6_debug.py")
POLICIES = ("eager", "compiled", "selective", "full")


def _compare(estimate, full):
    assert estimate.peak_bytes == full.peak_bytes
    assert estimate.peak_phase == full.peak_phase
    assert estimate.phases == {name: p.peak_bytes for name, p in full.phases.items()}
    assert estimate.by_category_at_peak == full.at_peak.by_category
    assert list(estimate.lines_at_peak) == [(r.label, r.bytes_at_peak) for r in full.at_peak.lines if r.bytes_at_peak > 0][:10]
    assert (estimate.peak_op.target, estimate.peak_op.source) == (full.peak_op.target, full.peak_op.source)
    assert estimate.peak_block == (full.peak_op.module.split(".")[0] + "." + full.peak_op.module.split(".")[1]
                                   if full.peak_op.module.startswith("blocks.") else "")
    assert (estimate.start_bytes, estimate.end_bytes) == (full.start_bytes, full.end_bytes)
    assert (estimate.saved_bytes, estimate.saved_activation_bytes) == (full.saved.total_bytes, full.saved.activation_bytes)
    assert estimate.parameter_count == full.graph.parameter_count
    assert (estimate.step_flops, estimate.recompute_flops) == (full.step_flops, full.recompute_flops)


@pytest.mark.parametrize("batch,seq,optimizer,policies", [
    (2, 64, "adamw", POLICIES),               # peaks at the loss's backward and in the optimizer step
    (8, 64, "sgd", ("eager", "full")),        # peaks inside the last (eager) and the first (full) block
])
@pytest.mark.slow
def test_extrapolated_depth_equals_the_full_analysis(batch, seq, optimizer, policies):
    report = analyze_by_depth(LLAMA6, batch=batch, seq=seq, policies=policies, optimizer=optimizer)
    full = tracer.analyze(LLAMA6, batch=batch, seq=seq, policies=policies, optimizer=optimizer)
    assert (report.block_list, report.depth, report.sample_depths) == ("blocks", 6, (3, 4, 5))
    for policy in policies:
        _compare(report.policies[policy], full.policies[policy])


@pytest.mark.slow
def test_blocks_that_differ_are_refused():
    """Every second block checkpointed: the middle blocks are two kinds. (A for-loop optimizer is refused
    the same way: its allocating ops grow with the number of parameters.)"""
    with pytest.raises(DepthError, match="not identical"):
        analyze_by_depth(LLAMA6, batch=1, seq=16, policies=("full",), checkpoint_every=2)


@pytest.mark.slow
def test_shallow_models_and_bad_samples_are_refused():
    with pytest.raises(DepthError, match="has 2 blocks"):
        analyze_by_depth("llama-debug", batch=1, seq=16)
    one = tracer.analyze("llama-debug", batch=1, seq=16).policies["eager"]
    samples = {k: one for k in (2, 3, 4)}
    with pytest.raises(DepthError, match="at least 3 blocks"):
        extrapolate_depth(samples, 80)
