"""Planning questions answered with a few analyses: the largest batch or sequence that fits a memory
budget, per policy (`fit_budget`); per-rank memory under data parallelism (`shard_policies`); and a deep
model from three shallow copies of it (`analyze_by_depth`).

`fit_budget` analyses the step (rank 0's, under --shard) at three small sizes (all policies from one capture per size;
side by side in `workers` processes, as are the checks at each answer and the next size), recovers
each op's live bytes as a polynomial of the size (tracer/passes/fit.py: degree 1 in the batch, 2 in the
sequence), solves for the largest size under the budget, then checks every answer with full analyses at
that size and the next one (`peak_bytes` fits, `next_peak_bytes` does not). If a check disagrees (only
possible when the graph changes with the size, as the compiled partition under a memory budget does, and
the phase-peak fallback was used) full analyses search from the guess (doubling away from it, then
bisection); `corrections` counts those extra analyses. On a CUDA target the answer is the size whose
reserved peak (the caching allocator's) fits: that search runs first on steps synthesized from the
samples' graphs (tracer/passes/size_graph.py, an allocator replay per size, `reserved_synthesized`), and
its answer and the next size are analysed in full; the full search goes on from there where they
disagree (`reserved_searches`). Every number reported comes from a full analysis.

`analyze_by_depth` builds the model with its repeated block list (the longest `nn.ModuleList` or
`nn.Sequential` of one module type) cut to 3, 4 and 5 blocks, analyses each, and extrapolates every
policy to the full depth (tracer/passes/depth.py, which checks that the shallow steps differ only by
identical blocks and raises DepthError otherwise). A model whose forward needs all its blocks (indexes
them by a config count, say) cannot be cut: DepthError, analyse it in full.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tracer.errors import TracerError, UsageError
from tracer.passes.depth import DepthError, DepthEstimate, extrapolate_depth
from tracer.passes.fit import FitError, PeakModel, fit_peak_model, largest_fitting_size
from tracer.depth_capture import cut_source
from tracer.policies import ALL_POLICIES, parse_policy_label

# `tracer.analyze`'s options that choose how an hf: model is built (load_model_source's keywords)
HF_OPTIONS = ("hf_config", "config_json", "hf_attn", "hf_task", "model_args")   # what loading the model reads

MAX_CORRECTIONS = 24


@dataclasses.dataclass(frozen=True)
class FitResult:
    policy: str
    largest: int                     # the largest batch (or seq) that fits; 0 when size 1 does not
    peak_bytes: int | None           # full analysis at `largest` (None when largest is 0)
    next_size: int                   # largest + multiple
    next_peak_bytes: int             # full analysis at next_size: over the budget
    predicted_peak_bytes: int | None # the peak model at `largest`
    per_op: bool                     # exact per-op model (False: from phase peaks)
    corrections: int
    reserved_bytes: int | None = None  # the caching allocator's reserved peak at `largest` (CUDA targets)
    next_reserved_bytes: int | None = None   # ... at next_size (CUDA targets: the size it no longer fits)
    reserved_searches: int = 0       # full analyses beyond the first two that searched the reserved peak
    reserved_synthesized: int = 0    # steps synthesized from the samples that searched it first (`_synthesized_guess`)


@dataclasses.dataclass(frozen=True)
class FitReport:
    budget_bytes: int
    dimension: str                   # "batch" (at `seq`) or "seq" (at `batch`)
    batch: int | None
    seq: int
    sample_sizes: tuple[int, ...]
    results: dict[str, FitResult]
    analyses_run: int
    margin_bytes: int = 0            # kept free: the peak must fit budget_bytes - margin_bytes
    extra_bytes: int = 0             # device memory outside the step counted in every peak (cuBLAS workspaces)
    context_bytes: int | None = None # the budget is the device's total less this CUDA context (`--fit gpu`)
    nccl_bytes: int = 0              # and less the NCCL communicators' buffers (a sharded or tensor-parallel rank)
    cuda: bool = False               # a CUDA target (reserved peaks are known)


def fit_budget(model: str, budget: int | str, *, seq: int, batch: int | None = None,
               policies: tuple[str, ...] = ALL_POLICIES, multiple: int = 1, analyze: Callable | None = None,
               on_progress: Callable[[str], None] | None = None, margin: int | str = 0, workers: int = 1,
               **options) -> FitReport:
    """The largest batch at `seq` (or, when `batch` is given, the largest sequence at `batch`) whose peak
    is at most `budget` less `margin` (bytes, or size strings such as "80GiB"; `budget` "gpu": the target
    GPU's reported total less the CUDA context, the capacity the report's "fits" verdict uses), for each
    policy. `options` go to `tracer.analyze` (precision, optimizer, target, ...). The peak is the bytes the
    step requests at its peak; on a CUDA target it counts the cuBLAS workspaces too, and each answer's
    reserved peak (the caching allocator's segments, which is what runs out) is reported beside it.
    `on_progress(message)` is told each analysis before it runs. `workers` > 1 (the CLI passes one per CPU
    core): the analyses that do not wait for each other's answers (the sample sizes; the checks at each
    answer and the size after it) run in that many processes at once, forked from this one where it can
    fork, for a model named by a string and the default `analyze`; the answers are the same. Raises
    UsageError for a bad budget or size."""
    if workers > 1 and isinstance(model, str) and analyze is None:
        from tracer.capture.triton_target import forking_available
        from tracer.pipeline import capture_processes

        lanes = min(workers, SAMPLES)
        with capture_processes(lanes, forked=forking_available()) as pool:
            return _fit_budget(model, budget, seq, batch, policies, multiple, analyze_model, on_progress, margin,
                               options, pool, lanes)
    return _fit_budget(model, budget, seq, batch, policies, multiple, analyze or analyze_model, on_progress, margin,
                       options, None)


def _fit_budget(model, budget, seq: int, batch: int | None, policies: tuple[str, ...], multiple: int,
                analyze: Callable, on_progress, margin, options: dict, pool, lanes: int = 1) -> FitReport:
    """`fit_budget`, its independent analyses run in `pool` of `lanes` processes and here (None: here, one
    after the other)."""
    from_device = isinstance(budget, str) and budget.strip().lower() in DEVICE_BUDGETS
    budget_bytes = None if from_device else parse_budget(budget)
    margin_bytes = _parse_margin(margin)
    dimension = "batch" if batch is None else "seq"
    if dimension == "batch" and options.get("pp", 1) > 1:       # a pipeline splits the batch into micro-batches
        multiple = max(multiple, options.get("microbatches") or options["pp"])
    degree = 1 if dimension == "batch" else 2
    samples = _sample_sizes(dimension, seq, multiple)
    runner = _Runner(analyze, model, dimension, batch, seq, policies, options, on_progress or (lambda message: None),
                     pool, lanes)
    runner.sample_sizes = frozenset(samples)
    rows: dict[str, list] = {}
    phase_rows: dict[str, list] = {}
    runner.prefetch([(size, label) for size in samples for label in policies])
    for size in samples:
        for label, (live_during, phases) in runner.profiles(size, policies).items():
            rows.setdefault(label, []).append(live_during)
            phase_rows.setdefault(label, []).append(phases)
    if not runner.cuda:
        runner.graphs.clear()              # only a reserved peak's search synthesizes steps from them
    models = {}
    for label in rows:
        try:
            models[label] = fit_peak_model(samples, rows[label], degree), True
        except FitError:
            common = set.intersection(*(set(p) for p in phase_rows[label]))
            table = [[p[name] for name in sorted(common)] for p in phase_rows[label]]
            models[label] = fit_peak_model(samples, table, degree, check=False), False
    if from_device:
        if runner.capacity_bytes is None:
            raise UsageError(f"--fit {budget} needs a CUDA target: the budget is the GPU's memory",
                             hint="give --gpu NAME (or a size, such as --fit 80GiB)")
        budget_bytes = runner.capacity_bytes
    if budget_bytes - margin_bytes <= 0:
        raise UsageError(f"the margin ({margin_bytes:,} B) leaves nothing of the budget ({budget_bytes:,} B)")
    target_bytes = budget_bytes - margin_bytes
    step = max(1, multiple)
    largest = {label: largest_fitting_size(m, target_bytes, multiple=step) for label, (m, _) in models.items()}
    runner.prefetch([(size, label) for label, n in largest.items() for size in (n, n + step) if size])
    results = {label: _check(runner, label, peak_model, per_op, target_bytes, largest[label], step)
               for label, (peak_model, per_op) in models.items()}
    if runner.cuda:       # what runs out is the allocator's reserved memory: the answer is the size it fits
        results = {label: _check_reserved(runner, r, target_bytes, step) for label, r in results.items()}
    return FitReport(budget_bytes=budget_bytes, dimension=dimension, batch=batch, seq=seq,
                     sample_sizes=tuple(samples), results=results, analyses_run=runner.runs,
                     margin_bytes=margin_bytes, extra_bytes=runner.extra_bytes,
                     context_bytes=runner.context_bytes if from_device else None,
                     nccl_bytes=runner.nccl_bytes if from_device else 0, cuda=runner.cuda)


@dataclasses.dataclass(frozen=True)
class DepthReport:
    model: str
    block_list: str                  # module path of the cut block list, e.g. "blocks"
    depth: int                       # blocks in the full model
    sample_depths: tuple[int, ...]
    policies: dict[str, DepthEstimate]


def analyze_by_depth(model: str, *, batch: int, seq: int, policies: tuple[str, ...] = ("eager",),
                     sample_depths: tuple[int, ...] = (3, 4, 5), on_progress: Callable[[str], None] | None = None,
                     **options) -> DepthReport:
    """The step of `model` at its full depth, extrapolated from analyses of the model cut to
    `sample_depths` blocks. `options` are `tracer.analyze`'s. Raises DepthError when the model cannot be
    cut or the cut steps are not the same step with fewer identical blocks."""
    from tracer.capture import load_model_source
    load_options = {k: options[k] for k in HF_OPTIONS if k in options}   # also kept: the settings record them
    source = load_model_source(model, **load_options)
    seen: dict = {}
    samples = {}
    for k in sorted(sample_depths):
        if on_progress is not None:
            on_progress(f"by depth: the model cut to {k} blocks ...")
        try:
            samples[k] = analyze_model(cut_source(source, k, seen), batch=batch, seq=seq, policies=policies,
                                       on_progress=on_progress, **options)
        except DepthError:
            raise
        except TracerError as exc:
            raise DepthError(f"{model} cut to {k} blocks cannot be analysed: {exc}",
                             hint="its forward may need every block; analyse it in full") from exc
        if seen["depth"] <= max(sample_depths):
            raise DepthError(f"{model} has {seen['depth']} blocks in {seen['path']}: analyse it in full")
    estimates = {label: extrapolate_depth({k: a.policies[label] for k, a in samples.items()}, seen["depth"])
                 for label in samples[min(samples)].policies}
    return DepthReport(model=model, block_list=seen["path"], depth=seen["depth"],
                       sample_depths=tuple(sorted(samples)), policies=estimates)


def shard_policies(analysis, strategy: str, world_size: int, **options) -> dict:
    """`tracer.passes.sharding.shard_memory` for every policy of an `Analysis`."""
    from tracer.passes.sharding import shard_memory
    return {label: shard_memory(policy, strategy, world_size, **options)
            for label, policy in analysis.policies.items()}


def _check(runner: "_Runner", label: str, peak_model: PeakModel, per_op: bool, budget_bytes: int, largest: int,
           step: int) -> FitResult:
    """Full analyses at `largest` and the next size. If they disagree with the model, search with full
    analyses (doubling away from the guess, then bisection) until one size fits and the next does not."""
    predicted = peak_model.peak_bytes(largest) if largest else None
    low, high, corrections = _search(lambda size: size == 0 or runner.peak(size, label) <= budget_bytes,
                                     largest, step, label)
    return FitResult(policy=label, largest=low, peak_bytes=runner.peak(low, label) if low else None,
                     next_size=high, next_peak_bytes=runner.peak(high, label), predicted_peak_bytes=predicted,
                     per_op=per_op, corrections=corrections,
                     reserved_bytes=runner.reserved.get((low, label)) if low else None)


def _check_reserved(runner: "_Runner", result: FitResult, budget_bytes: int, step: int) -> FitResult:
    """The largest size whose reserved peak fits, searched with full analyses from the requested-peak answer
    scaled by reserved/requested there (the allocator's overhead grows about in proportion)."""
    label, largest = result.policy, result.largest
    if not largest:
        return dataclasses.replace(result, next_reserved_bytes=runner.reserved_peak(result.next_size, label))
    ratio = runner.reserved_peak(largest, label) / max(runner.peak(largest, label), 1)
    guess = max(0, int(largest / max(ratio, 1.0)) // step * step)
    guess, synthesized = _synthesized_guess(runner, label, guess, step, budget_bytes)
    runner.sized.pop(label, None)
    low, high, corrections = _search(lambda size: size == 0 or runner.reserved_peak(size, label) <= budget_bytes,
                                     guess, step, label)
    return dataclasses.replace(result, largest=low, peak_bytes=runner.peak(low, label) if low else None,
                               next_size=high, next_peak_bytes=runner.peak(high, label),
                               reserved_bytes=runner.reserved_peak(low, label) if low else None,
                               next_reserved_bytes=runner.reserved_peak(high, label),
                               reserved_searches=corrections, reserved_synthesized=synthesized)


def _synthesized_guess(runner: "_Runner", label: str, guess: int, step: int, budget_bytes: int) -> tuple[int, int]:
    """(the size the full search of the reserved peak starts from, steps synthesized to find it): the same
    search run on steps synthesized from the samples (`_Runner.synthesized_reserved`: no capture, an
    allocator replay each), its answer and the next size then analysed in full at once. The answer is
    always the full analyses': a synthesized step only picks where they start. Where their verdicts differ
    from the synthesized ones (a kernel's buffer padded to a multiple of rows is one thing the polynomials
    miss), the full search starts from `guess`, as it does without synthesized steps (and where they
    cannot be synthesized: then 0 steps)."""
    before = len(runner.synthesized)
    try:
        low, high, _ = _search(lambda size: size == 0 or runner.synthesized_reserved(size, label) <= budget_bytes,
                               guess, step, label)
    except TracerError:            # SizeError, a search too long (FitError), a size the passes refuse
        return guess, 0
    runner.prefetch([(size, label) for size in (low, high) if size])
    agreed = (low == 0 or runner.reserved_peak(low, label) <= budget_bytes) and \
        runner.reserved_peak(high, label) > budget_bytes
    return (low if agreed else guess), len(runner.synthesized) - before


def _search(fits: Callable[[int], bool], guess: int, step: int, label: str) -> tuple[int, int, int]:
    """(low, high, analyses beyond the guess's two): low fits, high = low + step does not, from `guess`."""
    largest = guess
    corrections = 0
    low, high = largest, largest + step            # want: fits(low) and not fits(high)
    distance = step

    def corrected() -> int:
        if corrections >= MAX_CORRECTIONS:
            raise FitError(f"{label}: the peak model needed more than {MAX_CORRECTIONS} full analyses to correct",
                           hint="the step's structure changes with the size")
        return corrections + 1

    while not fits(low):                           # the guess is too large: step down, doubling
        high, low = low, max(0, low - distance)
        distance, corrections = distance * 2, corrected()
    while fits(high):                              # too small: step up, doubling
        low, high = high, high + distance
        distance, corrections = distance * 2, corrected()
    while high - low > step:
        mid = low + (high - low) // (2 * step) * step
        low, high = (mid, high) if fits(mid) else (low, mid)
        corrections = corrected()
    return low, high, corrections


# the sample sizes a fit analyses before it solves (`_sample_sizes`): at most this many analyses run at once
SAMPLES = 3


@dataclasses.dataclass(frozen=True)
class _Measured:
    """What a fit keeps of one policy's analysis at one size (all a pool process sends back)."""
    peak_bytes: int                              # `_peak_bytes`
    profile: tuple                               # `_profile`: live bytes per op, peak per phase
    device: tuple | None                         # reserved peak, capacity, context, NCCL and extra bytes (CUDA)
    graph: object = None                         # the analysed StepGraph, where the fit synthesizes from it


def _measure(analyze: Callable, model, names: tuple[str, ...], kwargs: dict, options: dict,
             keep_graphs: bool = False) -> dict[str, _Measured]:
    """One analysis at one size (`kwargs`: batch and seq), reduced to what the fit reads, per policy label;
    `keep_graphs`: with each policy's step graph (a sample the reserved-peak search synthesizes from)."""
    analysis = analyze(model, policies=names, **kwargs, **options)
    return {label: _measured(policy, keep_graphs) for label, policy in analysis.policies.items()}


def _measured(policy, keep_graph: bool = False) -> _Measured:
    """What the fit reads of one policy's analysis."""
    device = getattr(policy, "device", None)
    return _Measured(_peak_bytes(policy), _profile(policy), None if device is None else (
        device.reserved_peak_bytes, device.capacity_bytes, device.context_bytes, device.nccl_bytes,
        device.extra_bytes), policy.graph if keep_graph else None)


class _Runner:
    """Runs `analyze` once per size (all requested policies together) and keeps only the numbers needed;
    `pool`: where the analyses that `prefetch` asks for at once run side by side, `lanes` of them, and here
    (pipeline.results_side_by_side; None: one after the other here)."""

    def __init__(self, analyze, model, dimension, batch, seq, policies, options, say, pool=None, lanes: int = 1):
        self.analyze, self.model, self.dimension = analyze, model, dimension
        self.batch, self.seq, self.policies, self.options, self.say = batch, seq, policies, options, say
        self.pool, self.lanes = pool, lanes
        self.peaks: dict[tuple[int, str], int] = {}
        self.reserved: dict[tuple[int, str], int] = {}
        # size -> (the labels asked for, label -> `_profile` of each analysed policy) of its last analysis
        self.profiled: dict[int, tuple[tuple, dict[str, tuple]]] = {}
        self.runs = 0
        self.capacity_bytes = self.context_bytes = None       # the device's, on a CUDA target
        self.nccl_bytes = 0
        self.extra_bytes, self.cuda = 0, False
        # the sample sizes whose step graphs are kept, label -> size -> StepGraph, and what is built from them
        # (`synthesized_reserved`); only for the default analysis, whose passes a synthesized step can be given
        self.sample_sizes: frozenset = frozenset()
        self.graphs: dict[str, dict[int, object]] = {}
        self.sized: dict[str, object] = {}
        self.synthesized: dict[tuple[int, str], int] = {}

    def profiles(self, size: int, labels) -> dict[str, tuple]:
        """Each policy's `_profile` at `size`, from the analysis `prefetch` made there when it covered
        `labels`, else from a new one."""
        asked, made = self.profiled.get(size, ((), None))
        return made if made is not None and set(labels) <= set(asked) else self._run(size, labels)

    def prefetch(self, requests) -> None:
        """One analysis per distinct size for the (size, policy) pairs not analysed yet; in the pool, all at
        once."""
        by_size: dict[int, list[str]] = {}
        for size, label in requests:
            if (size, label) not in self.peaks and label not in by_size.get(size, []):
                by_size.setdefault(size, []).append(label)
        if self.pool is None or len(by_size) < 2:
            for size, labels in sorted(by_size.items()):
                self._run(size, labels)
            return
        from tracer.pipeline import results_side_by_side

        sizes = sorted(by_size)
        calls = [(_measure, (self.analyze, self.model, *self._request(size, by_size[size]), self.options,
                             self._keeps_graphs(size))) for size in sizes]
        for size, measured in zip(sizes, results_side_by_side(self.pool, self.lanes, calls)):
            self._record(size, by_size[size], measured)

    def reserved_peak(self, size: int, label: str) -> int:
        if (size, label) not in self.reserved:
            self._run(size, (label,))
        return self.reserved[(size, label)]

    def peak(self, size: int, label: str) -> int:
        if (size, label) not in self.peaks:
            self._run(size, (label,))
        return self.peaks[(size, label)]

    def _run(self, size: int, labels) -> dict[str, tuple]:
        """`labels` are analysis keys (`compiled@0.5` is the compiled policy under `memory_budget`); returns
        each analysed policy's `_profile`."""
        return self._record(size, labels, _measure(self.analyze, self.model, *self._request(size, labels),
                                                   self.options, self._keeps_graphs(size)))

    def _keeps_graphs(self, size: int) -> bool:
        return size in self.sample_sizes and self.analyze is analyze_model

    def synthesized_reserved(self, size: int, label: str) -> int:
        """The reserved peak at `size` of `label`'s step synthesized from the sample sizes' steps
        (tracer/passes/size_graph.py) and analysed as a captured step is; SizeError where the samples are
        not one step whose integers are polynomials of the size (or none were kept)."""
        from tracer.passes.size_graph import SizedSteps, SizeError
        from tracer.pipeline import analyze_captured, options_from_keywords

        if (size, label) not in self.synthesized:
            if label not in self.sized:
                samples = self.graphs.pop(label, {})      # the template keeps what it needs of them
                if len(samples) < len(self.sample_sizes):
                    raise SizeError(f"{label}: no step graphs of the sample sizes to synthesize from")
                self.sized[label] = SizedSteps(samples)
            options = options_from_keywords(**self._sizes(size), policies=(parse_policy_label(label)[0],),
                                            **self.options)
            policy = analyze_captured({label: self.sized[label].at(size)}, options).policies[label]
            device = _measured(policy).device
            if device is None:
                raise SizeError(f"{label}: the synthesized step has no device view")
            self.synthesized[(size, label)] = device[0]
        return self.synthesized[(size, label)]

    def _sizes(self, size: int) -> dict:
        return {"batch": size, "seq": self.seq} if self.dimension == "batch" else {"batch": self.batch, "seq": size}

    def _request(self, size: int, labels) -> tuple[tuple[str, ...], dict]:
        """The policy names and the batch and seq of one analysis at `size`, announced (`say`)."""
        kwargs = self._sizes(size)
        names = tuple(dict.fromkeys(parse_policy_label(label)[0] for label in labels))
        self.say(f"fit: analysis {self.runs + 1} at {self.dimension} {size} ({', '.join(names)}) ...")
        self.runs += 1
        return names, kwargs

    def _record(self, size: int, labels, measured: dict[str, _Measured]) -> dict[str, tuple]:
        for label, numbers in measured.items():
            self.peaks[(size, label)] = numbers.peak_bytes
            if numbers.graph is not None:
                self.graphs.setdefault(label, {})[size] = numbers.graph
            if numbers.device is not None:
                reserved, self.capacity_bytes, self.context_bytes, self.nccl_bytes, extra = numbers.device
                self.reserved[(size, label)] = reserved
                self.extra_bytes, self.cuda = max(self.extra_bytes, extra), True
        self.profiled[size] = (tuple(labels), {label: numbers.profile for label, numbers in measured.items()})
        return self.profiled[size][1]


def _profile(policy) -> tuple[tuple[int, ...], dict[str, int]]:
    """(bytes live during each op, peak per phase) that the fit models: rank 0's under --shard."""
    extra = _extra_bytes(policy)
    if getattr(policy, "sharded", None) is not None:
        return (tuple(b + extra for b in policy.sharded.live_during),
                {name: b + extra for name, b in policy.sharded.phases.items()})
    return (tuple(b + extra for b in policy.liveness.live_during),
            {name: p.peak_bytes + extra for name, p in policy.phases.items()})


def _peak_bytes(policy) -> int:
    """The peak a budget is checked against: rank 0's under --shard, with the device's extra bytes."""
    sharded = getattr(policy, "sharded", None)
    peak = sharded.peak_bytes if sharded is not None else policy.peak_bytes
    return peak + _extra_bytes(policy)


def _extra_bytes(policy) -> int:
    """Device memory outside the step graph (a CUDA target's cuBLAS workspaces), which counts against the
    budget like the step's own bytes."""
    return policy.device.extra_bytes if getattr(policy, "device", None) is not None else 0


DEVICE_BUDGETS = ("gpu", "device")     # `--fit gpu`: the target GPU's capacity


def _parse_margin(margin: int | str) -> int:
    from tracer.reports.units import parse_bytes
    try:
        value = parse_bytes(margin) if isinstance(margin, str) else margin
    except ValueError as exc:
        raise UsageError(f"--fit-margin: {exc}") from exc
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise UsageError(f"the fit margin must be a size of at least 0, not {margin!r}", hint="e.g. --fit-margin 2GiB")
    return value


def parse_budget(budget: int | str) -> int:
    from tracer.reports.units import parse_bytes
    if isinstance(budget, str):
        try:
            budget = parse_bytes(budget)
        except ValueError as exc:
            raise UsageError(f"--fit: {exc}") from exc
    if budget <= 0:
        raise UsageError(f"the memory budget must be positive, not {budget}")
    return budget


def _sample_sizes(dimension: str, seq: int, multiple: int) -> list[int]:
    step = max(1, multiple)
    if dimension == "batch":
        return [step, 2 * step, 3 * step]
    sizes = sorted({max(step, seq // 4 // step * step), max(step, seq // 2 // step * step), seq})
    if len(sizes) < 3:
        raise UsageError(f"--fit at a fixed batch samples seq/4, seq/2 and seq: --seq {seq} is too short",
                         hint="give a --seq of at least 4 (times the multiple)")
    return sizes


def analyze_model(model, *, batch: int, seq: int, policies: tuple[str, ...],
                  on_progress: Callable[[str], None] | None = None, **options):
    """`tracer.analyze` with AnalysisOptions' field names (zero_grad_set_to_none), for a model argument or a
    `ModelSource`."""
    from tracer.pipeline import options_from_keywords, run_analysis
    return run_analysis(model, options_from_keywords(batch=batch, seq=seq, policies=policies, **options),
                        on_progress=on_progress)
