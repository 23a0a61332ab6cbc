"""The what-if table: the levers people pull when a step does not fit, each simulated on the captured step.

`LEVERS` is the one registry: a lever is a name and the `AnalysisOptions` fields it sets on top of the
user's own settings (a policy, an optimizer, a precision, accumulation, LoRA, offload, sharding), so every
row is a full analysis through the same pipeline as the main command, never a formula on the side.
Combinations are levers too. `run_levers` captures the joint forward and backward once per distinct
setting of it (policies, optimizers, accumulation's steps and offload are scheduled on one capture;
sharding and the device view are passes over it) and returns one `LeverRow` per lever;
`fit_levers` answers `--fit SIZE --levers`: the largest batch per lever (tracer/planning.py's fit).

A lever the user's settings already include is still shown (its row equals the baseline). A lever that
does not apply is listed with the reason: sharding needs `--world-size`; accumulation needs a batch it
can split into micro-batches (`--accumulate` keeps the global batch: micro-batch = batch / N).
Not modelled here: what a lever costs in time (only recomputed FLOPs are shown) and its effect on
convergence (8-bit state, Adafactor's factored moments, LoRA's capacity).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tracer.errors import UsageError
from tracer.passes.attribution import MODEL_STATE_CATEGORIES
from tracer.pipeline import AnalysisOptions, analyze_captured, capture_variants, load_source

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
    _lever("offload optimizer", offload="optimizer"),
    _lever("ZeRO-2", shard="zero2", needs_world_size=True),
    _lever("FSDP", shard="fsdp", needs_world_size=True),
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


def run_levers(model, base: AnalysisOptions, *, world_size: int | None = None, levers: tuple[Lever, ...] = LEVERS,
               on_progress: Callable[[str], None] | None = None) -> LeverTable:
    """One row per lever. Levers that change only the policy or the step around forward and backward
    (optimizer, accumulation's steps, offload, sharding) share one joint capture."""
    from tracer.capture import joint_key

    source = load_source(model, base)
    planned = [(lever, *lever_options(lever, base, world_size)) for lever in levers]
    groups: dict = {}
    for _, options, _ in planned:
        if options is not None:      # levers differing only in passes over the step (sharding) share its graph
            groups.setdefault(joint_key(options.capture_options()), {}).setdefault(_step_key(options), options)
    graph_of: dict = {}
    for members in groups.values():
        variants = tuple(members.values())
        for key, graph in zip(members, capture_variants(source, variants, on_progress=on_progress)):
            graph_of[key] = graph
    rows = tuple(_row(lever.name, options, reason, graph_of) for lever, options, reason in planned)
    return LeverTable(baseline=rows[0], rows=rows, captures=len(groups))


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


def fit_levers(model: str, budget, base: AnalysisOptions, *, world_size: int | None = None,
               levers: tuple[Lever, ...] = LEVERS, on_progress: Callable[[str], None] | None = None) -> list[LeverFit]:
    """`--fit SIZE --levers`: the largest batch at --seq whose peak fits, per lever (accumulation: the
    largest micro-batch; sharding: per rank)."""
    from tracer.planning import fit_budget
    out = []
    for lever in levers:
        options, reason = lever_options(lever, dataclasses.replace(base, batch=max(base.batch, ACCUMULATE_STEPS)),
                                        world_size)
        if options is None:
            out.append(LeverFit(lever=lever.name, largest_batch=None, peak_bytes=None, reason=reason))
            continue
        keywords = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                    if f.name not in ("batch", "seq", "policies", "memory_budgets")}
        say = on_progress or (lambda message: None)
        report = fit_budget(model, budget, seq=options.seq, policies=options.policies,
                            on_progress=lambda message, lever=lever.name: say(f"{lever}: {message}"), **keywords)
        result = report.results[options.policy_specs()[0].label]
        out.append(LeverFit(lever=lever.name, largest_batch=result.largest, peak_bytes=result.peak_bytes))
    return out
