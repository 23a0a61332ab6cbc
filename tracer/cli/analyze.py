"""`python -m tracer [analyze] [MODEL] [options]`: predict the memory of one training step. A thin layer:
parse, call the library (tracer.pipeline, tracer.planning, tracer.levers), render (tracer.reports).

Every flag and output path is checked before the analysis runs; exit codes: tracer.cli.entry.
"""
from __future__ import annotations

import json
import os
import sys

from tracer.cli.progress import Progress
from tracer.errors import ExitCode

PROG = "python -m tracer"
SUMMARY = "predict the memory of one training step (the default command)"


def build_parser(epilog: str = ""):
    import argparse

    from tracer.cli import args as groups
    from tracer.cli.compare import add_target_arguments

    p = argparse.ArgumentParser(prog=PROG, description=(
        "Predict the memory of one training step (forward, loss, backward, optimizer step) without a GPU: "
        "the peak, its phase, the bill by category, and the lines and layers holding memory at the peak."),
        epilog=epilog, formatter_class=argparse.RawDescriptionHelpFormatter)
    groups.add_model_group(p)
    groups.add_policy_group(p)
    p.add_argument("--trainer-args", metavar="JSON",
                   help="a Hugging Face Trainer's TrainingArguments (the JSON to_json_string() writes): its batch, "
                        "accumulation, bf16/fp16, optim, torch_compile and gradient checkpointing replace the "
                        "matching flags")
    planning = p.add_argument_group("planning")
    planning.add_argument("--fit", metavar="SIZE",
                          help="largest batch at --seq (with an explicit --batch: largest --seq) whose peak fits "
                               "SIZE, per policy; checked by full analyses. SIZE 'gpu': the --gpu's reported total "
                               "less the CUDA context (--cuda-context)")
    planning.add_argument("--fit-margin", metavar="SIZE", default="0",
                          help="with --fit: memory to keep free below the budget (default 0)")
    planning.add_argument("--levers", action="store_true",
                          help="what-if table: one row per training lever and combination (checkpointing, compile, "
                               "8-bit AdamW, Adafactor, pure bf16, accumulation, LoRA, offload, ZeRO-2/FSDP at "
                               "--world-size), each a full analysis; with --fit SIZE: the largest batch per lever")
    planning.add_argument("--by-depth", action="store_true",
                          help="analyse the model cut to 3, 4, 5 blocks and extrapolate to its depth (exact; refused "
                               "when blocks differ) - fast for very deep models")
    groups.add_sharding_group(p)
    add_target_arguments(p)   # --alloc-conf --cublas-workspace-config --compare --tolerance --compare-json
    groups.add_output_group(p)
    groups.add_display_group(p)
    return p


def parse_args(argv: list[str]):
    from tracer.cli import epilog

    args = build_parser(epilog()).parse_args(argv)
    args.batch_given = any(a == "--batch" or a.startswith("--batch=") for a in argv)
    return args


def run(args) -> int:
    from tracer.cli.args import check_output_paths

    check_output_paths(args)
    if args.no_cache:
        os.environ["TRACER_NO_CACHE"] = "1"
    return _run(args)


def _plan(args, options) -> int:
    """--fit and --by-depth: the same options as the full analysis, sizes varied by the planner."""
    from tracer.pipeline import default_workers
    from tracer.planning import analyze_by_depth, fit_budget
    from tracer.reports.planning_text import render_depth, render_fit

    keywords = options.planner_keywords()
    budget = next((b for b in options.memory_budgets if b is not None), None)
    names = options.policies
    progress = Progress.from_args(args)
    if args.fit:
        report = fit_budget(args.model, args.fit, seq=args.seq, batch=args.batch if args.batch_given else None,
                            policies=names, memory_budget=budget, on_progress=progress, margin=args.fit_margin,
                            workers=default_workers(), **keywords)
        sys.stdout.write(render_fit(report))
    else:
        sys.stdout.write(render_depth(analyze_by_depth(args.model, batch=args.batch, seq=args.seq, policies=names,
                                                       memory_budget=budget, on_progress=progress, **keywords)))
    progress.done()
    return int(ExitCode.OK)


def _levers(args) -> int:
    """--levers (with --fit: the largest batch per lever). --world-size alone sets the sharding levers' ranks."""
    from tracer.errors import UsageError
    from tracer.levers import fit_levers, run_levers
    from tracer.pipeline import default_workers
    from tracer.reports.levers_text import levers_json, render_lever_fits, render_levers

    if args.by_depth:
        raise UsageError("--levers and --by-depth cannot be combined", hint="drop one of them")
    world_size = args.world_size
    if args.shard is None:
        args.world_size = None             # the sharding levers take it; the baseline is one device
    options = analysis_options(args)
    progress = Progress.from_args(args)
    if args.fit:
        from tracer.planning import DEVICE_BUDGETS, parse_budget
        if args.fit.strip().lower() in DEVICE_BUDGETS or args.fit_margin != "0":
            raise UsageError("--levers --fit takes a size, without --fit-margin", hint="e.g. --levers --fit 80GiB")
        fits = fit_levers(args.model, args.fit, options, world_size=world_size, on_progress=progress,
                          workers=default_workers())
        sys.stdout.write(render_lever_fits(fits, budget_bytes=parse_budget(args.fit), seq=options.seq))
        progress.done()
        return int(ExitCode.OK)
    table = run_levers(args.model, options, world_size=world_size, on_progress=progress, workers=default_workers())
    sys.stdout.write(render_levers(table))
    if args.json:
        _write_json(args.json, levers_json(table))
    progress.done()
    return int(ExitCode.OK)


def _write_outputs(args, analysis, policy: str) -> None:
    """The single output flags, then --report: every output from the one table (tracer.reports.report_dir).
    --lines and --report show every line (top=None): --top is the text report's."""
    from tracer.cli.args import flag_dest
    from tracer.reports.report_dir import OUTPUTS, Rendering, write_report_dir

    device_memory = _size_flag(args, "device_memory")
    rendering = Rendering(analysis, policy=policy, layer=args.graph_layer, device_memory_bytes=device_memory)
    for output in OUTPUTS:
        value = output.flag and getattr(args, flag_dest(output.flag))
        if value:
            output.write(rendering, value)
    if args.report:
        write_report_dir(analysis, args.report, policy=policy, layer=args.graph_layer,
                         device_memory_bytes=device_memory)


def _write_json(path: str, data: dict) -> None:
    from tracer.outputs import write_output
    write_output(path, json.dumps(data, indent=2), what="--json")


def _size_flag(args, name: str) -> int | None:
    """A SIZE flag (`80GiB`, `256MiB`) in bytes, or None when not given; UsageError names the flag."""
    from tracer.errors import UsageError
    from tracer.reports.units import parse_bytes

    value = getattr(args, name, None)
    if not value:
        return None
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise UsageError(f"--{name.replace('_', '-')}: {exc}") from exc


def analysis_options(args):
    """The parsed flags -> the pipeline's AnalysisOptions (every flag that changes the answer)."""
    from tracer.errors import UsageError
    from tracer.pipeline import AnalysisOptions

    if args.trainer_args:             # the Trainer's arguments decide the fields they name
        from tracer.trainer_args import trainer_options
        for name, value in trainer_options(args.trainer_args).items():
            setattr(args, "policy" if name == "policies" else name, value[0] if name == "policies" else value)
    if args.batch < 1 or args.seq < 1:
        raise UsageError("--batch and --seq must be positive integers")
    device_memory = _size_flag(args, "device_memory")
    from tracer.cli.compare import check_target_flags
    check_target_flags(args)
    names, budgets = policy_names_and_budgets(args)
    options = AnalysisOptions(
        batch=args.batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer, foreach=args.foreach,
        step=args.step, zero_grad_set_to_none=args.zero_grad == "none", policies=names, memory_budgets=budgets,
        blocks=args.blocks, checkpoint_every=args.checkpoint_every, save_policy=args.save_policy,
        save_ops=tuple(args.save_ops.split(",")) if args.save_ops else (), hf_config=tuple(args.hf_config),
        model_args=tuple(args.model_args),
        config_json=args.config_json, hf_attn=args.hf_attn, hf_task=args.hf_task, capture=args.capture, moe_routing=args.moe_routing,
        target=args.target,
        gpu=args.gpu, alloc_conf=args.alloc_conf, cublas_workspace_config=args.cublas_workspace_config,
        cudnn_workspace_cap_bytes=_size_flag(args, "cudnn_workspace_cap"),
        cuda_context_bytes=_size_flag(args, "cuda_context"), nccl_memory_bytes=_size_flag(args, "nccl_memory"),
        device_memory_bytes=device_memory, shard=args.shard, world_size=args.world_size,
        reshard_after_forward=not args.no_reshard_after_forward, fsdp_mixed_precision=args.fsdp_mixed_precision,
        accumulate=args.accumulate, offload=args.offload, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
        quantized_base=args.quantized_base, fp8=args.fp8, trainer_args=args.trainer_args, tp=args.tp, sp=args.sp, ep=args.ep, cp=args.cp, pp=args.pp, microbatches=args.microbatches,
        pp_schedule=args.pp_schedule, pp_return_outputs=args.pp_return_outputs, pp_local_stages=args.pp_local_stages, full_capture=args.full_capture, gradient_checkpointing=args.gradient_checkpointing)
    return options                          # AnalysisOptions validates every field when made: before any capture


def _run(args) -> int:
    import torch

    import tracer
    from tracer.pipeline import default_workers, run_analysis
    from tracer.cli.compare import run_target_outputs
    from tracer.reports.json_report import report_json
    from tracer.reports.text import render_text

    if args.levers:
        return _levers(args)
    options = analysis_options(args)
    if args.fit or args.by_depth:
        return _plan(args, options)
    progress = Progress.from_args(args)
    analysis = run_analysis(args.model, options, on_progress=progress, workers=default_workers())
    specs = options.policy_specs()
    shown = None if args.policy == "all" or len(specs) > 1 else specs[0].label
    if args.shard:                          # what one rank holds is the answer asked for: it comes first
        from tracer.reports.planning_text import render_sharding
        sharded = {label: policy.sharded for label, policy in analysis.policies.items()}
        sys.stdout.write(render_sharding(sharded, single_device_peaks={
            k: p.peak_bytes for k, p in analysis.policies.items()}) + "\n")
    sys.stdout.write(render_text(analysis, policy=shown, top=args.top))
    if args.json:
        versions = {"tracer_version": tracer.__version__, "torch_version": torch.__version__}
        _write_json(args.json, report_json(analysis, top=args.top, versions=versions))
    if args.save_baseline:
        from tracer.checks import save_baseline
        save_baseline(analysis, args.save_baseline, top=args.top)
    _write_outputs(args, analysis, shown or next(iter(analysis.policies)))
    code = run_target_outputs(args, analysis, shown or next(iter(analysis.policies)))
    progress.done()
    return code


BUDGET_SWEEP = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


def policy_names_and_budgets(args) -> tuple[tuple[str, ...], tuple[float | None, ...]]:
    """--policy and --memory-budget -> (policy names, compiled memory budgets). A budget adds compiled."""
    from tracer.errors import UsageError
    from tracer.policies import ALL_POLICIES

    names = ALL_POLICIES if args.policy == "all" else (args.policy,)
    budgets: tuple = (None,)
    if args.memory_budget is not None:
        if args.memory_budget == "sweep":
            budgets = BUDGET_SWEEP
        else:
            try:
                budgets = (float(args.memory_budget),)
            except ValueError:
                raise UsageError(f"--memory-budget {args.memory_budget!r} is not a number or 'sweep'") from None
            if not 0.0 <= budgets[0] <= 1.0:
                raise UsageError("--memory-budget must be between 0 and 1 (a fraction of activation bytes)")
        if "compiled" not in names:
            names = names + ("compiled",)
    return names, budgets
