"""The what-if table: the levers people pull when a step does not fit, each simulated on the captured step.

`LEVERS` is the one registry: a lever is a name and the `AnalysisOptions` fields it sets on top of the
user's own settings (a policy, an optimizer, a precision, accumulation, LoRA, offload, sharding), so every
row is a full analysis through the same pipeline as the main command, never a formula on the side.
Combinations are levers too. `run_levers` captures the joint forward and backward once per distinct
setting of it (policies, optimizers, accumulation's steps and offload are scheduled on one capture;
sharding and the device view are passes over it; the CLI spreads these captures over one process per
CPU core: a deep model's baseline group cut to 4 blocks, synthesized and its rows analysed in a worker while
the calling process captures it cut to 6 blocks and checks the synthesis; a group that changes every block
alike (`_UNIFORM_FIELDS`: pure bf16, the micro-batch, LoRA, a 4-bit base, FP8, offloaded activations,
context parallelism) is cut to 4 blocks only and synthesized on the baseline group's check under the same
policies, noted; a model of 5 to 10 blocks, captured in full by one command, has its uniform groups cut the
same way, checked on the baseline's full capture; the baseline group's rows whose policy is cut in larger
units at once, a compiled policy planned for a CUDA target, are cut so from the start: `_AheadCut`) and
returns one `LeverRow` per lever;
`fit_levers` answers `--fit SIZE --levers`: the largest batch per lever (tracer/planning.py's fit).

A lever the user's settings already include is still shown (its row equals the baseline). A lever that
does not apply is listed with the reason: sharding needs `--world-size`; accumulation needs a batch it
can split into micro-batches (`--accumulate` keeps the global batch: micro-batch = batch / N).
Not modelled here: what a lever costs in time (only recomputed FLOPs are shown) and its effect on
convergence (8-bit state, Adafactor's factored moments, LoRA's capacity).
"""
from __future__ import annotations

import dataclasses
import gc
from typing import Callable

from tracer.depth_capture import BASE_DEPTH, CHECK_DEPTH, CutSteps
from tracer.errors import TracerError, UsageError, package_installed
from tracer.passes.attribution import MODEL_STATE_CATEGORIES
from tracer.pipeline import (AnalysisOptions, analyze_captured, analyze_one, block_list, capture_cut_variants,
                             capture_variants, load_source, spaced_collections)

ACCUMULATE_STEPS = 4
LORA_RANK = 16


@dataclasses.dataclass(frozen=True)
class Lever:
    name: str
    settings: tuple[tuple[str, object], ...] = ()     # AnalysisOptions fields set on top of the user's
    policy: str | None = None                         # the recompute policy (None: the user's first)
    needs_world_size: bool = False                    # sharding: only at the --world-size given


def _lever(name: str, policy: str | None = None, *, needs_world_size: bool = False, **settings) -> Lever:
    return Lever(name=name, settings=tuple(settings.items()), policy=policy, needs_world_size=needs_world_size)


LEVERS: tuple[Lever, ...] = (
    _lever("baseline"),
    _lever("full checkpointing", "full"),
    _lever("selective checkpointing", "selective"),
    _lever("torch.compile", "compiled"),
    _lever("8-bit AdamW", optimizer="adamw8bit"),
    _lever("Adafactor", optimizer="adafactor"),
    _lever("pure bf16", precision="bf16-pure"),
    _lever(f"accumulate {ACCUMULATE_STEPS}", accumulate=ACCUMULATE_STEPS),
    _lever(f"LoRA r={LORA_RANK}", lora_rank=LORA_RANK),
    _lever(f"QLoRA: 4-bit base + LoRA r={LORA_RANK}", "eager", quantized_base="4bit", lora_rank=LORA_RANK),
    _lever("FP8 (torchao, tensorwise)", fp8="tensorwise"),
    _lever("offload optimizer", offload="optimizer"),
    _lever("offload activations (save_on_cpu)", "eager", offload="activations"),
    _lever("ZeRO-2", shard="zero2", needs_world_size=True),
    _lever("FSDP", shard="fsdp", needs_world_size=True),
    _lever("pipeline 1F1B (a stage of --world-size)", "eager", pp=0, needs_world_size=True),
    _lever("context parallel (a rank of --world-size)", cp=0, needs_world_size=True),
    _lever("full + 8-bit AdamW", "full", optimizer="adamw8bit"),
    _lever("full + pure bf16", "full", precision="bf16-pure"),
    _lever(f"full + LoRA r={LORA_RANK}", "full", lora_rank=LORA_RANK),
    _lever("selective + pure bf16 + 8-bit AdamW", "selective", precision="bf16-pure", optimizer="adamw8bit"),
    _lever("full + FSDP", "full", shard="fsdp", needs_world_size=True),
)


@dataclasses.dataclass(frozen=True)
class LeverRow:
    lever: str
    options: AnalysisOptions | None      # None: the lever does not apply (see `reason`)
    reason: str = ""
    peak_bytes: int | None = None        # per rank under sharding
    saved_bytes: int | None = None       # saved activations
    state_bytes: int | None = None       # parameters + gradients + optimizer state on the device at the peak
    host_bytes: int | None = None        # host memory (offload)
    recompute_flops: int | None = None
    out_of_memory: bool | None = None    # on a CUDA target: the allocator's reserved peak vs the GPU's memory


@dataclasses.dataclass(frozen=True)
class LeverTable:
    baseline: LeverRow
    rows: tuple[LeverRow, ...]
    captures: int                        # distinct captures run


def lever_options(lever: Lever, base: AnalysisOptions, world_size: int | None = None
                  ) -> tuple[AnalysisOptions | None, str]:
    """The options of `lever` on top of `base`, or (None, why it does not apply). `world_size`: the ranks
    the sharding levers use (default: base's)."""
    settings = dict(lever.settings)
    world_size = world_size or base.world_size
    if lever.needs_world_size and world_size is None:
        return None, "give --world-size N"
    if "shard" in settings:
        settings["world_size"] = world_size
    if "pp" in settings:             # as many stages as ranks; the accumulation lever's micro-batches where they
        settings["pp"] = world_size  # split the batch (one capture for both), else micro-batches of one
        settings["microbatches"] = ACCUMULATE_STEPS if base.batch % ACCUMULATE_STEPS == 0 else base.batch
    if "cp" in settings:             # the sequence split over every rank, each ringing attention with the others
        settings["cp"] = world_size
    if "quantized_base" in settings and not (package_installed("bitsandbytes") and package_installed("peft")):
        return None, "needs bitsandbytes and peft (pip install bitsandbytes peft)"
    if "fp8" in settings and not package_installed("torchao"):
        return None, "needs torchao (pip install torchao)"
    if "offload" in settings and _unified_memory(base):
        return None, (f"the {base.gpu}'s CPU and GPU share one memory: offloading to the host frees none of it")
    if "accumulate" in settings:
        steps = settings["accumulate"]
        if base.batch % steps or base.batch < steps:
            return None, f"--batch {base.batch} does not split into {steps} micro-batches"
        settings["batch"] = base.batch // steps
    policy = lever.policy or base.policies[0]
    try:
        return dataclasses.replace(base, policies=(policy,), memory_budgets=(None,), **settings), ""
    except UsageError as exc:                  # a combination AnalysisOptions refuses: shown, not fatal
        return None, str(exc).splitlines()[0]


def _unified_memory(options: AnalysisOptions) -> bool:
    """A CUDA target whose GPU shares its memory with the CPU (the DGX Spark)."""
    from tracer.capture.target import parse_target
    target = parse_target(options.target, options.gpu)
    return target.is_cuda and target.gpu.unified


def _check_world_size(world_size) -> None:
    if world_size is not None and (not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1):
        raise UsageError(f"--world-size {world_size!r} is not valid", hint="a positive integer")


@spaced_collections()
def run_levers(model, base: AnalysisOptions, *, world_size: int | None = None, levers: tuple[Lever, ...] = LEVERS,
               on_progress: Callable[[str], None] | None = None, workers: int = 1) -> LeverTable:
    """One row per lever. Levers that change only the policy or the step around forward and backward
    (optimizer, accumulation's steps, offload, sharding) share one joint capture. `workers` > 1 (the CLI
    passes one per CPU core) runs the capture groups of a model named by a string in that many processes."""
    from tracer.capture import joint_key

    _check_world_size(world_size)
    planned = [(lever, *lever_options(lever, base, world_size)) for lever in levers]
    groups: dict = {}
    for i, (_, options, _) in enumerate(planned):
        if options is not None:
            groups.setdefault(joint_key(options.capture_options()), []).append(i)
    jobs = [tuple((i, planned[i][0].name, planned[i][1]) for i in members) for members in groups.values()]
    rows = {i: LeverRow(lever=lever.name, options=None, reason=reason)
            for i, (lever, options, reason) in enumerate(planned) if options is None}
    for group_rows in _run_groups(model, base, jobs, workers, on_progress):
        rows.update(group_rows)
    ordered = tuple(rows[i] for i in range(len(planned)))
    return LeverTable(baseline=ordered[0], rows=ordered, captures=len(groups))


def _run_groups(model, base: AnalysisOptions, jobs: list, workers: int, on_progress) -> list[dict]:
    """Each job's rows: in this process, or with `workers` processes (forked from this one once it has
    loaded the model, or where it cannot fork, spawned: each loads the model by its name). A deep model's
    group is captured cut to a few blocks (tracer/depth_capture.py's `capture_cut` steps); a capture is
    independent of the others, so the rows are the same either way. The first group (the baseline's) is
    captured at `BASE_DEPTH`, synthesized and its rows analysed in a worker while this
    process captures its `CHECK_DEPTH` step and checks the synthesis on it (`synthesis_differences`); a
    group that differs from it only in what every block's code sees the same way (`_UNIFORM_FIELDS`) is
    captured at `BASE_DEPTH` alone, synthesized and analysed in its worker. Rows made before the verdict are
    kept on it; a failed check captures the group again here as `capture_deep` does (its note says why),
    and the uniform groups that use a policy whose check failed with a check of their own. Any other group:
    both depths in workers, checked and synthesized here. A model too shallow to cut for one capture
    (`_shallow_blocks`): the baseline group captured in full in a worker, the uniform groups at
    `BASE_DEPTH`, and the check here on the baseline's full capture (`_checked_on_full`). Once this
    process has made its check capture and would wait for the baseline's worker, it takes back the other
    groups no worker has started yet, the last queued first, and runs them itself (`_run_queued_here`)."""
    count = min(2 * len(jobs), workers)
    if count <= 1 or not isinstance(model, str):
        return _group_results(model, base, jobs, _Inline(), on_progress)
    from tracer.capture.triton_target import forking_available
    from tracer.pipeline import capture_processes

    say = on_progress or (lambda message: None)
    say(f"capturing {len(jobs)} groups of levers in {count} processes ...")
    forked = forking_available()
    with capture_processes(count, forked=forked) as pool:
        if not forked:
            for _ in range(count):                       # start every process now: they import torch
                pool.submit(_started)                    # while this one loads the model
        # forked: the processes start with the first group's job, after this process has loaded the model
        # and built it once under fake tensors (block_list), and inherit both
        return _group_results(model, base, jobs, pool, on_progress)


# capture options a lever changes identically in every block of the model (the dtype; the micro-batch or the
# sequence a rank holds; an adapter, a 4-bit or a float8 form of every matching linear layer; saved tensors
# held on the host; attention's sequence split over ranks): the depth synthesis checked on the baseline's
# capture holds for them under the same policy
_UNIFORM_FIELDS = frozenset(("precision", "batch", "seq", "lora_rank", "lora_targets", "quantized_base", "fp8",
                             "offload", "cp"))


def _group_results(model, base: AnalysisOptions, jobs: list, pool, on_progress) -> list[dict]:
    say = on_progress or (lambda message: None)
    from tracer.capture import joint_key

    joints = [joint_key(job[0][2].capture_options()) for job in jobs]       # what decides each group's capture
    reuses = [j > 0 and _differs_only_in(joints[j], joints[0], _UNIFORM_FIELDS) for j in range(len(jobs))]
    order = [0] + sorted(range(1, len(jobs)), key=lambda j: -len(_variants(jobs[j])))   # the most captures first
    source = load_source(model, base)
    pending, blocks_by = {}, {}

    def blocks_of(job: tuple):
        # the block list a group's capture_deep would find: the model's modules, which its dtype does not change
        # (a model that cannot be built in a group's precision fails its cut capture, then its full one)
        first = next(iter(_variants(job).values()))
        probe = (first.seq, first.full_capture)
        if probe not in blocks_by:
            blocks_by[probe] = block_list(source, first)
        return blocks_by[probe]

    shallow = _shallow_blocks(source, jobs, reuses)
    checked_on = (f"the full capture of the same model under the {jobs[0][0][1]!r} lever" if shallow is not None
                  else f"a {CHECK_DEPTH}-block capture of the same model under the {jobs[0][0][1]!r} lever" if jobs
                  else None)
    ahead = _cut_ahead(jobs, shallow, blocks_of) if jobs else None
    if ahead is not None:
        # the baseline group's compiled rows leave its cuts in units of one block; their own cuts, the longest
        # captures of all, start first
        jobs = [tuple(row for row in jobs[0] if row not in ahead.job), *jobs[1:]]
        ahead.start(pool, model, base, say)
    queued: list[_Queued] = []        # the other groups' jobs, which this process may take back while it waits

    def submit(fn, *args) -> "_Queued":
        queued.append(_Queued(pool, fn, *args))
        return queued[-1]

    for j in order:
        blocks = blocks_of(jobs[j])
        if blocks is None and shallow is not None and (j == 0 or reuses[j]):
            pending[j] = (shallow, pool.submit(_rows_and_graphs, model, base, jobs[j],
                                               frozenset(key for key, _ in _check_variants(jobs, reuses).values()))
                          if j == 0 else
                          submit(_synthesized_rows, model, base, jobs[j], shallow, checked_on))
        elif blocks is None:
            pending[j] = (None, submit(_group_rows, model, base, jobs[j]))
        elif reuses[j]:                 # its rows made where it is captured, on the check's verdict to come
            pending[j] = (blocks, submit(_synthesized_rows, model, base, jobs[j], blocks, checked_on))
        elif j == 0:                    # its rows made where it is captured at BASE_DEPTH, the check made here
            pending[j] = (blocks, pool.submit(_unchecked_rows, model, base, jobs[j], blocks))
        else:
            pending[j] = (blocks, {depth: submit(_capture_cut, model, base, tuple(_variants(jobs[j]).values()), depth)
                                   for depth in (CHECK_DEPTH, BASE_DEPTH)})
    out: dict[int, dict] = {}
    checked: frozenset = frozenset()
    for j in order:
        try:
            rows, checked = _rows_of_group(j, jobs, pending[j], reuses, checked, source, base, say, on_progress,
                                           cut_again=_cut_again_beside(pool, model, base, jobs[j], source.name, say)
                                           if j == 0 else None,
                                           meanwhile=lambda awaited: _run_queued_here(queued, awaited))
        except TracerError as exc:
            if j == 0:
                raise                   # the baseline: without it no row means anything
            # a lever the model refuses (LoRA on a model with no linear layer) or whose step cannot be captured
            # (a quantized layer the model's code cannot run): its rows say why
            rows = _refused_rows(jobs[j], exc)
        out[j] = rows
    return [out[j] for j in range(len(jobs))] + ([ahead.rows(pool, model, source, base, say, on_progress)]
                                                  if ahead is not None else [])


def _refused_rows(job: tuple, exc: TracerError) -> dict[int, LeverRow]:
    """A group's rows when the model refuses its lever (LoRA on a model with no linear layer) or its step
    cannot be captured (a quantized layer the model's code cannot run): each says why."""
    return {i: LeverRow(lever=name, options=None, reason=str(exc).splitlines()[0]) for i, name, _ in job}


@dataclasses.dataclass
class _AheadCut:
    """The baseline group's rows whose policy is cut in larger units at once (tracer/pipeline.py's
    `cut_ahead_units`: a compiled policy planned for a CUDA target), as a group of their own: both cuts in
    those units start in workers before every other capture (the deeper one is the longest capture of the
    command), instead of after a cut in units of one block that plans them twice and fails its check."""
    job: tuple
    blocks: object                      # the model's BlockList
    units: int
    futures: dict = dataclasses.field(default_factory=dict)      # depth -> Future of `_capture_cut`

    def start(self, pool, model, base: AnalysisOptions, say) -> None:
        from tracer.depth_capture import cut_depths

        variants = tuple(_variants(self.job).values())
        base_depth, check_depth = cut_depths(self.blocks.depth, self.units)
        say(f"capturing {', '.join(name for _, name, _ in self.job)} cut to {check_depth} and {base_depth} of "
            f"{self.blocks.depth} blocks in worker processes (Inductor's Triton plan hands buffers on across "
            f"blocks: cut in units of {self.units} blocks at once) ...")
        for depth in (check_depth, base_depth):
            self.futures[depth] = pool.submit(_capture_cut, model, base, variants, depth)

    def rows(self, pool, model, source, base: AnalysisOptions, say, on_progress) -> dict[int, LeverRow]:
        say(f"checking and synthesizing {len(self.job)} levers at {self.blocks.depth} blocks ...")
        try:
            return _group_rows(source, base, self.job, on_progress, cut=_cut_steps(self.blocks, self.futures,
                                                                                  self.units),
                               cut_again=_cut_again_beside(pool, model, base, self.job, source.name, say))
        except TracerError as exc:
            return _refused_rows(self.job, exc)


def _cut_ahead(jobs: list, shallow, blocks_of: Callable) -> _AheadCut | None:
    """The baseline group's rows cut in larger units at once (`_AheadCut`), where the group is cut (a model
    deeper than `shallow` covers), its baseline row is not among them (its rows decide the others') and
    such a cut pays (`cut_pays`); else None."""
    from tracer.depth_capture import cut_pays
    from tracer.pipeline import cut_ahead_units

    if shallow is not None or jobs[0][0][2].full_capture:
        return None
    units = {key: cut_ahead_units(*key) for key in _variants(jobs[0])}
    baseline_key = _step_key(jobs[0][0][2])
    if units[baseline_key] is not None or not any(group is not None for group in units.values()):
        return None
    blocks = blocks_of(jobs[0])
    if blocks is None:
        return None
    group = max(group for group in units.values() if group is not None)
    if not cut_pays(blocks.depth, group):
        return None
    return _AheadCut(tuple(row for row in jobs[0] if units[_step_key(row[2])] is not None), blocks, group)


def _shallow_blocks(source, jobs: list, reuses: list):
    """The block list of a model too shallow to be cut for one capture (at most `BASE_DEPTH + CHECK_DEPTH`
    blocks) that the levers' uniform groups are cut on all the same: each of them is captured at
    `BASE_DEPTH` blocks only, checked on the baseline's full capture (`_checked_on_full`). None: no such
    group, no repeated block list deeper than `BASE_DEPTH`, or a model deep enough for `block_list`."""
    if not any(reuses):
        return None
    options = jobs[0][0][2]
    if options.full_capture:
        return None
    blocks = block_list(source, options, deeper_than=BASE_DEPTH)
    return blocks if blocks is not None and blocks.depth <= BASE_DEPTH + CHECK_DEPTH else None


def _rows_of_group(j: int, jobs: list, pending: tuple, reuses: list, checked: frozenset, source,
                   base: AnalysisOptions, say, on_progress, cut_again=None,
                   meanwhile: Callable = lambda awaited: None) -> tuple[dict, frozenset]:
    """Group `j`'s rows from what `_group_results` started for it (`pending`: its block list and futures),
    and the policies whose depth synthesis the baseline's check has passed (group 0 decides them; later
    groups read them). `cut_again`: how the baseline's group is cut in larger units when its check asks
    for that (`_cut_again_beside`); `meanwhile(awaited)`: called when the baseline's check capture is made
    and its worker's result (`awaited`) is still to come."""
    blocks, futures = pending
    if blocks is None:
        return futures.result(), checked
    if reuses[j]:
        # made before the verdict: kept when the baseline's check passed under every policy of the group, else
        # captured with a check of its own
        policies = {_step_key(options)[1] for _, _, options in jobs[j]}
        return (futures.result() if policies <= checked else _group_rows(source, base, jobs[j], on_progress)), checked
    if j == 0 and blocks.depth <= BASE_DEPTH + CHECK_DEPTH:
        say(f"capturing {source.name} cut to {BASE_DEPTH} blocks to check the synthesis of its {blocks.depth} on "
            "its full capture ...")
        return _checked_on_full(source, jobs, reuses, blocks, futures, meanwhile)
    if j == 0:
        say(f"capturing {source.name} cut to {CHECK_DEPTH} blocks to check the synthesis of its {blocks.depth} ...")
        rows, checked, cut = _checked_rows(source, base, jobs[j], blocks, futures, meanwhile)
        # a check that fails or cannot run: the group made here from its cut captures (or captured again when
        # one failed), its verdict and note as capture_deep's
        return (rows if rows is not None else
                _group_rows(source, base, jobs[j], on_progress, cut=cut, cut_again=cut_again)), checked
    say(f"checking and synthesizing {len(jobs[j])} levers at {blocks.depth} blocks ...")
    return _group_rows(source, base, jobs[j], on_progress, cut=_cut_steps(blocks, futures)), checked


def _unchecked_rows(model, base: AnalysisOptions, job: tuple, blocks) -> tuple:
    """A worker's job for the baseline's group: its captures cut to `BASE_DEPTH` blocks, the synthesized side
    of their depth check (`prepare_synthesis`, without the full-depth graphs) and, where every synthesis
    succeeds, its rows from the full-depth synthesis, made before the check's verdict: (rows or None,
    prepared, the cut captures). A TracerError is raised."""
    from tracer.depth_capture import prepare_synthesis

    source = load_source(model, base)
    variants = _variants(job)
    options = tuple(variants.values())
    cut = _capture_cut(source, base, options, BASE_DEPTH)
    prepared = prepare_synthesis(cut, lambda i, graph: analyze_one(graph, options[i]), blocks.depth)
    rows = None
    if not any(prepared.refused):
        graph_of = dict(zip(variants, prepared.full))
        rows = {i: _row(name, row_options, "", graph_of) for i, name, row_options in job}
    return rows, dataclasses.replace(prepared, full=()), cut


def _checked_rows(source, base: AnalysisOptions, job: tuple, blocks, unchecked,
                  meanwhile: Callable = lambda awaited: None) -> tuple[dict | None, frozenset, CutSteps | None]:
    """`unchecked`'s rows (the Future of `_unchecked_rows`) when the group's `CHECK_DEPTH`-block capture,
    made here, equals its synthesis op for op for every variant, else None; the policies of the variants
    whose synthesis equals its capture (empty when a capture fails); and both cut captures, from which the
    caller makes the group as `capture_deep` does when the rows are None (its note says why)."""
    from tracer.depth_capture import synthesis_differences
    from tracer.errors import TracerError

    variants = _variants(job)
    options = tuple(variants.values())
    try:
        check = _capture_cut(source, base, options, CHECK_DEPTH)
        meanwhile(unchecked)
        rows, prepared, cut = unchecked.result()
    except TracerError:
        return None, frozenset(), None
    differences = synthesis_differences(prepared, check, lambda i, graph: analyze_one(graph, options[i]))
    policies = [key[1] for key in variants]
    passed = frozenset(policies) - {policies[i] for i in differences}
    return (rows if rows is not None and not differences else None), passed, CutSteps(blocks, cut, check)


def _rows_and_graphs(model, base: AnalysisOptions, job: tuple, kept: frozenset = frozenset()) -> tuple[dict, dict]:
    """A worker's job for the baseline's group of a model captured in full: its rows, and the step graphs
    of the step keys in `kept` (those `_checked_on_full` compares; only they travel back)."""
    graphs = _group_graphs(load_source(model, base), job)
    return {i: _row(name, options, "", graphs) for i, name, options in job}, \
        {key: graph for key, graph in graphs.items() if key in kept}


def _check_variants(jobs: list, reuses: list) -> dict:
    """Policy -> (step key, options) of the baseline group's variants `_checked_on_full` compares: one per
    policy the uniform groups use, the baseline's first under that policy."""
    wanted = {_step_key(options)[1] for j in range(len(jobs)) if reuses[j] for _, _, options in jobs[j]}
    checks: dict = {}
    for key, options in _variants(jobs[0]).items():
        if key[1] in wanted:
            checks.setdefault(key[1], (key, options))
    return checks


def _checked_on_full(source, jobs: list, reuses: list, blocks, baseline,
                     meanwhile: Callable = lambda awaited: None) -> tuple[dict, frozenset]:
    """The baseline group's rows (`baseline`: the Future of `_rows_and_graphs`) and the policies under which
    its step synthesized from the model cut to `BASE_DEPTH` blocks, captured here, equals its full capture op
    for op (`_check_variants`). The synthesized side is analysed before the full capture arrives."""
    from tracer.depth_capture import first_difference
    from tracer.passes.depth import DepthError
    from tracer.passes.depth_graph import synthesize_depth

    checks = _check_variants(jobs, reuses)
    cut: tuple = ()
    try:
        cut = capture_cut_variants(source, tuple(options for _, options in checks.values()), BASE_DEPTH)
    except TracerError:
        pass
    synthesized = {}
    for (policy, (key, options)), graph in zip(checks.items(), cut):
        try:
            synthesized[policy] = analyze_one(synthesize_depth(graph, blocks.depth), options)
        except DepthError:
            continue
    meanwhile(baseline)
    rows, graphs = baseline.result()
    passed = {policy for policy, (key, options) in checks.items() if policy in synthesized and
              first_difference(synthesized[policy], analyze_one(graphs[key], options)) is None}
    return rows, frozenset(passed)


def _synthesized_rows(model, base: AnalysisOptions, job: tuple, blocks, checked_on: str) -> dict[int, LeverRow]:
    """A worker's job for a group that reuses the baseline's check: its captures cut to `BASE_DEPTH`
    blocks, synthesized at full depth (tracer/depth_capture.py: `checked_on`) and its rows analysed, so
    only the rows travel back."""
    from tracer.errors import TracerError

    source = load_source(model, base)
    try:
        cut = CutSteps(blocks, _capture_cut(source, base, tuple(_variants(job).values()), BASE_DEPTH), None,
                       checked_on=checked_on)
    except TracerError as exc:
        cut = CutSteps(blocks, None, None, exc)
    return _group_rows(source, base, job, cut=cut)


def _differs_only_in(options, reference, fields: frozenset) -> bool:
    return all(getattr(options, f.name) == getattr(reference, f.name)
               for f in dataclasses.fields(options) if f.name not in fields)


class _Inline:
    """`submit` runs the call now: the one-process path shares the pool path's code."""

    def submit(self, fn, *args):
        from concurrent.futures import Future
        future = Future()
        try:
            future.set_result(fn(*args))
        except BaseException as exc:             # kept for `result()`, as a pool keeps it
            future.set_exception(exc)
        return future


class _Queued:
    """A job submitted to the pool that this process takes back and runs itself if no worker has started it
    when it would otherwise wait (`_run_queued_here`); `result()` is the same either way (each job is
    independent of the others)."""

    def __init__(self, pool, fn: Callable, *args):
        self.fn, self.args = fn, args
        self.future = pool.submit(fn, *args)
        self.here = None                             # the Future of the run here, once taken back

    def take_back(self) -> bool:
        if self.here is not None or not self.future.cancel():     # a worker has it (or it is done)
            return False
        self.here = _Inline().submit(self.fn, *self.args)
        return True

    def result(self):
        return (self.here or self.future).result()


def _run_queued_here(queued: list[_Queued], awaited) -> None:
    """While `awaited` is not done, runs here the queued jobs no worker has started, the last submitted
    first (the pool would start it last): the calling process, which would wait for `awaited`, is a third
    lane beside the workers, so the command does not end on one worker running the queue's tail alone."""
    for job in reversed(queued):
        if awaited.done():
            return
        job.take_back()


def _started() -> None:
    """A worker process's first job: the imports every later one needs."""
    import tracer.capture  # noqa: F401


def _cut_steps(blocks, futures: dict, group: int = 1) -> CutSteps:
    """The two cut captures in units of `group` blocks (`futures`: depth -> Future, `cut_depths`) as
    `capture_cut` makes them in one process: the first TracerError (the shallower capture's before the
    deeper one's) is kept; any other error is raised."""
    from tracer.depth_capture import cut_depths
    from tracer.errors import TracerError

    base_depth, check_depth = cut_depths(blocks.depth, group)
    try:
        base = futures[base_depth].result()
    except TracerError as exc:
        return CutSteps(blocks, None, None, exc, group=group)
    try:
        return CutSteps(blocks, base, futures[check_depth].result(), group=group)
    except TracerError as exc:
        return CutSteps(blocks, base, None, exc, group=group)


def _capture_cut(model, base: AnalysisOptions, variants: tuple, depth: int) -> tuple:
    """A worker process's job: the variants' graphs of the model cut to `depth` blocks."""
    return capture_cut_variants(load_source(model, base), variants, depth)


def _variants(job: tuple) -> dict:
    """The distinct step graphs of a capture group: step key -> the options of its first row."""
    variants: dict = {}
    for _, _, options in job:
        variants.setdefault(_step_key(options), options)
    return variants


def _group_rows(model, base: AnalysisOptions, job: tuple, on_progress=None, cut=None,
                cut_again=None) -> dict[int, LeverRow]:
    """The rows of one capture group (row index, lever name, options): its distinct step graphs captured
    together (`cut`: its cut captures, when already made; `cut_again`: as `capture_variants`), each row
    analysed with its own options (only the rows travel back from a worker)."""
    graphs = _group_graphs(load_source(model, base), job, on_progress, cut, cut_again)
    return {i: _row(name, options, "", graphs) for i, name, options in job}


def _group_graphs(source, job: tuple, on_progress=None, cut=None, cut_again=None) -> dict:
    """Step key -> the step graph of each distinct variant of a capture group, from one joint capture."""
    variants = _variants(job)
    return dict(zip(variants, capture_variants(source, tuple(variants.values()), on_progress=on_progress,
                                               cut=cut, cut_again=cut_again)))


def _cut_again_beside(pool, model, base: AnalysisOptions, job: tuple, name: str, say) -> Callable:
    """`capture_variants`' `cut_again` for a group: the variants at `indices` cut in units of `group` blocks,
    the shallower cut in a worker of `pool` (once one is free) while this process captures the deeper one:
    the `CutSteps` of `capture_cut`, whose first TracerError (the shallower capture's first) is kept."""
    from tracer.depth_capture import cut_depths

    variants = tuple(_variants(job).values())

    def cut_again(blocks, indices: tuple, group: int) -> CutSteps:
        chosen = tuple(variants[i] for i in indices)
        base_depth, check_depth = cut_depths(blocks.depth, group)
        say(f"capturing {name} cut to {check_depth} and (in a worker process) {base_depth} of its {blocks.depth} "
            "blocks under fake tensors ...")
        shallower = pool.submit(_capture_cut, model, base, chosen, base_depth)
        try:
            deeper, deeper_error = _capture_cut(model, base, chosen, check_depth), None
        except TracerError as exc:
            deeper, deeper_error = None, exc
        try:
            cut = shallower.result()
        except TracerError as exc:
            return CutSteps(blocks, None, None, exc, group=group)
        return CutSteps(blocks, cut, deeper, deeper_error, group=group)

    return cut_again


def _step_key(options: AnalysisOptions) -> tuple:
    """What decides a lever's captured step graph: its capture options and its policy."""
    return options.capture_options(), options.policy_specs()[0]


def _row(name: str, options: AnalysisOptions | None, reason: str, graph_of: dict) -> LeverRow:
    if options is None:
        return LeverRow(lever=name, options=None, reason=reason)
    label = options.policy_specs()[0].label
    result = analyze_captured({label: graph_of[_step_key(options)]}, options).policies[label]
    sharded = result.sharded
    categories = sharded.by_category_at_peak if sharded is not None else result.at_peak.by_category
    device = result.rank_device or result.device
    return LeverRow(lever=name, options=options,
                    peak_bytes=sharded.peak_bytes if sharded is not None else result.peak_bytes,
                    saved_bytes=result.saved.activation_bytes,
                    state_bytes=sum(categories.get(c, 0) for c in MODEL_STATE_CATEGORIES),
                    host_bytes=result.host.peak_bytes if result.host is not None else None,
                    recompute_flops=result.recompute_flops,
                    out_of_memory=device.oom is not None if device is not None else None)


@dataclasses.dataclass(frozen=True)
class LeverFit:
    lever: str
    largest_batch: int | None            # None: the lever does not apply (see `reason`)
    peak_bytes: int | None
    reason: str = ""


@spaced_collections()
def fit_levers(model: str, budget, base: AnalysisOptions, *, world_size: int | None = None,
               levers: tuple[Lever, ...] = LEVERS, on_progress: Callable[[str], None] | None = None,
               workers: int = 1) -> list[LeverFit]:
    """`--fit SIZE --levers`: the largest batch at --seq whose peak fits, per lever (accumulation: the
    largest micro-batch; sharding: per rank). Each lever's fit is independent (`fit_budget` on its
    options); `workers` > 1 (the CLI passes one per CPU core) runs them in that many processes, forked from
    this one where it can fork, the fits of compiled policies (an Inductor plan per analysis) first."""
    _check_world_size(world_size)
    sized = dataclasses.replace(base, batch=max(base.batch, ACCUMULATE_STEPS))
    planned = [(lever, *lever_options(lever, sized, world_size)) for lever in levers]
    applicable = [i for i, (_, options, _) in enumerate(planned) if options is not None]
    # the longest fits first, so that the last ones to finish are short
    order = sorted(applicable, key=lambda i: not planned[i][1].policy_specs()[0].policy.compiled_any)
    count = min(workers, len(applicable))
    if count <= 1 or not isinstance(model, str):
        return _lever_fits(model, budget, planned, order, None, on_progress)
    from tracer.capture.triton_target import forking_available
    from tracer.pipeline import capture_processes

    with capture_processes(count, forked=forking_available()) as pool:
        return _lever_fits(model, budget, planned, order, pool, on_progress if _picklable(on_progress) else None)


def _lever_fits(model, budget, planned: list, order: list, pool, on_progress) -> list[LeverFit]:
    """Each lever's LeverFit, its fit submitted to `pool` in `order` (None: made here, one after the other):
    a lever the settings refuse says why, as does one whose fit raises a UsageError, except the baseline's
    (without it no row means anything), whose error is raised and the fits not yet started dropped."""
    futures = {} if pool is None else {
        i: pool.submit(_fit_lever, model, budget, planned[i][0].name, planned[i][1], on_progress) for i in order}
    out = []
    for i, (lever, options, reason) in enumerate(planned):
        if options is None:
            out.append(LeverFit(lever=lever.name, largest_batch=None, peak_bytes=None, reason=reason))
            continue
        try:
            out.append(futures[i].result() if futures else _fit_lever(model, budget, lever.name, options, on_progress))
        except UsageError as exc:
            if i == 0:
                for future in futures.values():
                    future.cancel()
                raise
            out.append(LeverFit(lever=lever.name, largest_batch=None, peak_bytes=None,
                                reason=str(exc).splitlines()[0]))
    return out


def _fit_lever(model, budget, name: str, options: AnalysisOptions, on_progress) -> LeverFit:
    """One lever's fit: `fit_budget` on its options, its progress lines named after it. A UsageError is
    raised."""
    from tracer.planning import fit_budget

    say = on_progress or (lambda message: None)
    report = fit_budget(model, budget, seq=options.seq, policies=options.policies,
                        on_progress=lambda message: say(f"{name}: {message}"), **options.planner_keywords())
    result = report.results[options.policy_specs()[0].label]
    # the analyses' reference cycles wait for a full collection, which collections spaced for the tracer's
    # work make rare: a process that runs fit after fit grew to 2.4 GiB on llama-88m without this (0.25 s)
    gc.collect()
    return LeverFit(lever=name, largest_batch=result.largest, peak_bytes=result.peak_bytes)


def _picklable(value) -> bool:
    """Whether `value` can travel to a pool process (a lambda cannot: its progress lines stay unprinted)."""
    import pickle
    try:
        pickle.dumps(value)
    except Exception:           # noqa: BLE001 - pickling raises many kinds of error
        return False
    return True
