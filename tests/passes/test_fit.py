"""--fit: per-op peak polynomials (tracer/passes/fit.py) and the driver that checks them with full analyses
(tracer/planning.py). The driver tests run llama-debug; the pass tests use plain numbers."""
import dataclasses
from fractions import Fraction

import pytest

import tracer
from tracer.errors import UsageError
from tracer.passes.fit import FitError, PeakModel, fit_peak_model, largest_fitting_size
from tracer.planning import _Runner, analyze_model, fit_budget
from tracer.reports.planning_text import render_fit


def _rows(polys, sizes):
    return [[sum(c * x**k for k, c in enumerate(p)) for p in polys] for x in sizes]


def test_interpolation_recovers_each_candidate_exactly():
    polys = [(1000, 30, 2), (5000, 10, 0), (7, 0, 1)]
    model = fit_peak_model([2, 5, 9], _rows(polys, [2, 5, 9]), degree=2)
    assert set(model.coefficients) == {tuple(Fraction(c) for c in p) for p in polys}
    for x in (1, 3, 100, 10_000):
        assert model.peak_bytes(x) == max(sum(c * x**k for k, c in enumerate(p)) for p in polys)


def test_largest_fitting_size_is_exact_at_the_boundary():
    model = PeakModel(degree=1, coefficients=((Fraction(100), Fraction(7)), (Fraction(150), Fraction(3))))
    assert [model.peak_bytes(x) for x in (1, 11, 12, 13)] == [153, 183, 186, 191]
    assert largest_fitting_size(model, 186) == 12            # equality fits
    assert largest_fitting_size(model, 190) == 12
    assert largest_fitting_size(model, 185) == 11
    assert largest_fitting_size(model, 152) == 0              # not even size 1
    assert largest_fitting_size(model, 186, multiple=5) == 10


def test_extra_sizes_check_the_fit():
    rows = _rows([(10, 4)], [1, 2, 3])
    fit_peak_model([1, 2, 3], rows, degree=1)
    rows[2][0] += 1
    with pytest.raises(FitError, match="size 3"):
        fit_peak_model([1, 2, 3], rows, degree=1)


def test_a_graph_that_changes_with_the_size_is_refused():
    with pytest.raises(FitError, match="different number of ops"):
        fit_peak_model([1, 2], [[1, 2, 3], [1, 2]], degree=1)
    with pytest.raises(FitError, match="distinct sizes"):
        fit_peak_model([4, 4], [[1], [2]], degree=1)


def test_a_peak_that_never_grows_is_refused():
    with pytest.raises(FitError, match="does not grow"):
        largest_fitting_size(PeakModel(degree=1, coefficients=((Fraction(5), Fraction(0)),)), 10)


class _CountingAnalyze:
    def __init__(self):
        self.calls = []

    def __call__(self, model, **kwargs):
        self.calls.append((kwargs["batch"], kwargs["seq"], kwargs["policies"]))
        return tracer.analyze(model, **kwargs)


@pytest.mark.slow
def test_largest_batch_fits_and_the_next_does_not():
    seq, policies = 64, ("eager", "full")
    budget = tracer.analyze("llama-debug", batch=5, seq=seq, target="cpu").policies["eager"].peak_bytes + 1000
    counting = _CountingAnalyze()
    report = fit_budget("llama-debug", budget, seq=seq, policies=policies, analyze=counting, target="cpu")
    assert report.results["eager"].largest == 5
    assert report.results["full"].largest > 5                  # checkpointing fits a larger batch
    for policy, result in report.results.items():
        assert result.per_op and result.corrections == 0
        assert result.predicted_peak_bytes == result.peak_bytes  # the per-op model is exact
        assert result.peak_bytes <= budget < result.next_peak_bytes
    at, after = (tracer.analyze("llama-debug", batch=b, seq=seq, target="cpu").policies["eager"].peak_bytes
                 for b in (5, 6))
    assert (at, after) == (report.results["eager"].peak_bytes, report.results["eager"].next_peak_bytes)
    # three samples (both policies each), then one analysis per size to check
    assert len(counting.calls) == 3 + len({s for r in report.results.values() for s in (r.largest, r.next_size)})


def test_the_independent_analyses_in_worker_processes_give_the_same_report():
    """The three samples, and the checks at each answer and the size after it, run in two processes at once
    (`workers=2`): the report is the one made one analysis after the other, on a CUDA target (the reserved
    peaks' searches follow) with two policies."""
    keywords = dict(seq=64, policies=("eager", "full"), target="cuda")
    budget = tracer.analyze("llama-debug", batch=5, seq=64, target="cuda").policies["eager"].device.reserved_peak_bytes
    alone = fit_budget("llama-debug", budget, **keywords)
    assert all(result.largest > 3 and result.reserved_synthesized for result in alone.results.values())
    assert fit_budget("llama-debug", budget, workers=2, **keywords) == alone


def test_the_reserved_peak_searched_on_synthesized_steps_gives_the_full_searchs_answer():
    """On a CUDA target the reserved peak is searched first on steps synthesized from the three samples
    (tracer/passes/size_graph.py: an allocator replay each, no capture), and only that search's answer and
    the next size are analysed in full; every number of the report is the one the search with full
    analyses finds (a custom analysis function keeps that search), in fewer analyses."""
    keywords = dict(seq=64, policies=("eager", "full"), target="cuda")
    budget = tracer.analyze("llama-debug", batch=7, seq=64, target="cuda").policies["eager"].device.reserved_peak_bytes
    synthesized = fit_budget("llama-debug", budget, **keywords)
    full = fit_budget("llama-debug", budget, analyze=lambda model, **kwargs: analyze_model(model, **kwargs),
                      **keywords)
    for label, result in full.results.items():
        assert result.reserved_searches > 0 and result.reserved_synthesized == 0
        assert synthesized.results[label].reserved_synthesized > 0
        assert dataclasses.replace(synthesized.results[label], reserved_searches=0, reserved_synthesized=0) == \
            dataclasses.replace(result, reserved_searches=0)
    assert synthesized.analyses_run < full.analyses_run
    assert "steps synthesized from the samples" in render_fit(synthesized)


def test_synthesized_steps_the_full_analyses_contradict_leave_the_full_search_as_it_was(monkeypatch):
    """A synthesized search whose answer the full analyses there contradict (here: every synthesized step
    is the one of twice the batch, so it answers about half) is dropped: the full search starts where it
    starts without synthesized steps and finds the same answer."""
    keywords = dict(seq=64, policies=("eager",), target="cuda")
    budget = tracer.analyze("llama-debug", batch=7, seq=64, target="cuda").policies["eager"].device.reserved_peak_bytes
    full = fit_budget("llama-debug", budget, analyze=lambda model, **kwargs: analyze_model(model, **kwargs),
                      **keywords).results["eager"]
    synthesized_reserved = _Runner.synthesized_reserved
    monkeypatch.setattr(_Runner, "synthesized_reserved",
                        lambda self, size, label: synthesized_reserved(self, 2 * size, label))
    off = fit_budget("llama-debug", budget, **keywords).results["eager"]
    assert off.reserved_synthesized > 0 and off.reserved_searches == full.reserved_searches
    assert dataclasses.replace(off, reserved_synthesized=0) == full


@pytest.mark.slow
def test_largest_sequence_at_a_fixed_batch():
    budget = tracer.analyze("llama-debug", batch=2, seq=200, target="cpu").policies["eager"].peak_bytes
    report = fit_budget("llama-debug", budget, seq=256, batch=2, policies=("eager",), target="cpu")
    result = report.results["eager"]
    assert report.dimension == "seq" and report.sample_sizes == (64, 128, 256)
    assert result.largest == 200 and result.peak_bytes == budget < result.next_peak_bytes


@pytest.mark.slow
def test_on_a_cuda_target_the_answer_is_the_size_whose_reserved_peak_fits():
    """What runs out on a GPU is the caching allocator's reserved memory (its segments, which hold the
    requested peak with the cuBLAS workspaces, rounding and cached free blocks): the CUDA fit's answer is
    the largest batch whose reserved peak fits, and the table shows the requested peak beside it. The same
    budget fits a larger batch on the CPU, where the requested peak is what counts."""
    at_5 = tracer.analyze("llama-debug", batch=5, seq=64, gpu="a100").policies["eager"].device
    report = fit_budget("llama-debug", at_5.reserved_peak_bytes, seq=64, policies=("eager",), gpu="a100")
    result = report.results["eager"]
    # segments come in 2 MiB steps, so larger batches may reserve no more than batch 5 does
    assert result.largest >= 5 and result.reserved_bytes <= at_5.reserved_peak_bytes < result.next_reserved_bytes
    checked = tracer.analyze("llama-debug", batch=result.largest, seq=64, gpu="a100").policies["eager"].device
    assert (checked.reserved_peak_bytes, checked.peak_bytes) == (result.reserved_bytes, result.peak_bytes)
    assert result.peak_bytes < result.reserved_bytes
    text = render_fit(report)
    assert "judged by the reserved peak" in text and "cuBLAS workspaces" in text and "requested" in text
    on_cpu = fit_budget("llama-debug", at_5.reserved_peak_bytes, seq=64, policies=("eager",), target="cpu")
    assert on_cpu.results["eager"].largest > 5


@pytest.mark.slow
def test_fit_gpu_takes_the_device_total_less_the_context_and_a_margin():
    """`--fit gpu`: the budget is the capacity the report's verdict uses (the GPU's reported total less the
    CUDA context); a margin is kept free below it, and the header says what the budget is made of."""
    capacity = tracer.analyze("llama-debug", batch=1, seq=64, gpu="t4").policies["eager"].device.capacity_bytes
    report = fit_budget("llama-debug", "gpu", seq=64, policies=("eager",), gpu="t4", margin="1GiB")
    assert report.budget_bytes == capacity and report.margin_bytes == 2**30 and report.context_bytes == 512 * 2**20
    assert report.results["eager"].reserved_bytes <= capacity - 2**30 < report.results["eager"].next_reserved_bytes
    assert "the GPU's reported total 15.00 GiB less 512.00 MiB for the CUDA context" in render_fit(report)
    with pytest.raises(UsageError, match="needs a CUDA target"):
        fit_budget("llama-debug", "gpu", seq=64, policies=("eager",), target="cpu")
    with pytest.raises(UsageError, match="leaves nothing"):
        fit_budget("llama-debug", "1MiB", seq=64, policies=("eager",), target="cpu", margin="2MiB")


@pytest.mark.slow
def test_nothing_fits():
    report = fit_budget("llama-debug", "1MiB", seq=64, policies=("eager",))
    result = report.results["eager"]
    assert result.largest == 0 and result.peak_bytes is None and result.next_peak_bytes > 2**20


def test_budget_strings_are_parsed_and_checked():
    with pytest.raises(UsageError, match="cannot read"):
        fit_budget("llama-debug", "eighty gigs", seq=64)
    with pytest.raises(UsageError, match="too short"):
        fit_budget("llama-debug", "1GiB", seq=2, batch=1)


class _FakePolicy:
    """What fit_budget reads from a PolicyAnalysis: live bytes per op, phase peaks, the peak."""

    def __init__(self, live_during):
        self.liveness = type("L", (), {"live_during": tuple(live_during)})()
        self.peak_bytes = max(live_during)
        self.phases = {"backward": type("P", (), {"peak_bytes": self.peak_bytes})()}


def test_a_graph_that_changes_with_the_size_is_searched_with_full_analyses():
    """Ops appear with the size (as the compiled partition under a memory budget does): the phase-peak
    fit is only a guess, and full analyses move it to the true boundary. True peak: 1000 + 10 b^2."""
    def analyze(model, *, batch, seq, policies):
        live = [1000 + 10 * batch * batch] + [5] * batch
        return type("A", (), {"policies": {p: _FakePolicy(live) for p in policies}})()

    report = fit_budget("fake", 1000 + 10 * 20**2, seq=8, policies=("eager",), analyze=analyze)
    result = report.results["eager"]
    assert not result.per_op and result.corrections > 0
    assert (result.largest, result.peak_bytes, result.next_peak_bytes) == (20, 5000, 1000 + 10 * 21**2)


@pytest.mark.slow
def test_under_sharding_the_fit_is_rank_zeros_peak():
    """--fit with --shard fits the per-rank peak (each rank runs --batch), not the single device's."""
    report = fit_budget("llama-debug", "3MiB", seq=64, policies=("eager",), target="cpu", shard="fsdp",
                        world_size=4)
    result = report.results["eager"]
    at_largest = tracer.analyze("llama-debug", batch=result.largest, seq=64, target="cpu", shard="fsdp",
                                world_size=4).policies["eager"]
    assert result.peak_bytes == at_largest.sharded.peak_bytes <= 3 * 2**20 < result.next_peak_bytes
    single = fit_budget("llama-debug", "3MiB", seq=64, policies=("eager",), target="cpu").results["eager"]
    assert result.largest > single.largest
