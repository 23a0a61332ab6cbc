"""Renderers of the planning answers, on plain synthetic results (no capture)."""
from tracer.passes.sharding import ShardedMemory
from tracer.planning import FitReport, FitResult
from tracer.reports.planning_text import render_fit, render_sharding


def test_fit_table_shows_the_answer_and_the_overflow():
    results = {
        "eager": FitResult(policy="eager", largest=5, peak_bytes=900, next_size=6, next_peak_bytes=1100,
                           predicted_peak_bytes=900, per_op=True, corrections=0),
        "full": FitResult(policy="full", largest=0, peak_bytes=None, next_size=1, next_peak_bytes=1500,
                          predicted_peak_bytes=None, per_op=False, corrections=1),
    }
    report = FitReport(budget_bytes=1000, dimension="batch", batch=None, seq=64, sample_sizes=(1, 2, 3),
                       results=results, analyses_run=5)
    text = render_fit(report)
    assert text.splitlines()[0] == "largest batch that fits 1,000 B (1,000 B) at seq 64"
    eager = next(line for line in text.splitlines() if line.strip().startswith("eager"))
    assert eager.split() == ["eager", "5", "900", "B", "100", "B", "6", "1.07", "KiB", "100", "B"]
    full = next(line for line in text.splitlines() if line.strip().startswith("full"))
    assert "none" in full and full.endswith("(phase-peak fit, corrected by 1)")
    assert "5 analyses: batch 1, 2, 3" in text


def test_sharding_table_has_one_row_per_policy():
    m = ShardedMemory(strategy="fsdp", world_size=8, peak_bytes=2048, peak_phase="backward", peak_op_index=3,
                      by_category_at_peak={"parameter": 1024, "activation": 1024, "temporary": 0}, phases={},
                      model_state_bytes={"parameter": 1024, "gradient": 512, "optimizer_state": 2048},
                      live_during=(), units=())
    text = render_sharding({"eager": m}, single_device_peaks={"eager": 8192})
    lines = text.splitlines()
    assert lines[0] == "per rank: fsdp on 8 ranks (rank 0, the largest shard)"
    assert lines[2].split() == ["eager", "2.00", "KiB", "backward", "1.00", "KiB", "512", "B", "2.00", "KiB",
                                "8.00", "KiB"]
    assert lines[3] == "  at the eager peak: parameter 1.00 KiB  activation 1.00 KiB"
