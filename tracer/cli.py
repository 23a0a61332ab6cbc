"""Command line: `python -m tracer [MODEL] [options]`. A thin layer: parse, call the library, render.

Exit codes (tracer.errors.ExitCode): 0 ok, 1 a memory check failed, 2 usage error (bad flags, missing
or invalid model file, unknown zoo name, unwritable output path), 3 analysis error (the model's code raised
or exited, export failed, any unexpected error), 130 interrupted (Ctrl-C); see tracer.entry. Every flag
and output path is checked before the analysis runs.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from tracer.errors import ExitCode
from tracer.policies import ALL_POLICIES, POLICIES
from tracer.target_cli import check_target_flags
from tracer.models import DEFAULT_MODEL, ZOO

EPILOG = f"""subcommands: python -m tracer snapshot STEP.pickle [--json PATH]  (read a real CUDA memory snapshot)
             python -m tracer check MODEL --baseline PATH [--tolerance 2%]  (fail on memory regressions)
zoo models: {', '.join(sorted(ZOO))}
exit codes: 0 ok, 1 memory check failed, 2 usage error (flags, model file, zoo name, output path),
            3 analysis error (the model raised or exited, or an unexpected error), 130 interrupted"""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tracer", description=(
        "Predict the memory of one training step (forward, loss, backward, optimizer step) without a GPU: "
        "the peak, its phase, the bill by category, and the lines and layers holding memory at the peak."),
        epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", nargs="?", default=DEFAULT_MODEL,
                   help=f"zoo name, path to a model file, or hf:<model_type> (a transformers model built from its "
                        f"default config, no download: hf:llama, hf:roberta, hf:vit, hf:whisper, ...) "
                        f"(default: {DEFAULT_MODEL})")
    from tracer.checks.options import add_model_arguments
    add_model_arguments(p)
    p.add_argument("--hf-config", action="append", default=[], metavar="KEY=VALUE",
                   help="hf: models: override a config field (repeatable), e.g. --hf-config num_hidden_layers=2")
    p.add_argument("--config-json", metavar="PATH", help="hf: models: build from this local config.json (no download)")
    from tracer.models.hf import TASKS
    p.add_argument("--hf-task", choices=tuple(TASKS), metavar="TASK",
                   help=f"hf: models: the head whose loss is trained ({', '.join(TASKS)}; default: the config.json's "
                        f"architectures, else seq2seq, speech-seq2seq, masked-lm, causal-lm, image-classification "
                        f"or sequence-classification, the first the architecture has)")
    p.add_argument("--policy", choices=POLICIES + ("all",), default="eager",
                   help="which recompute policy to simulate on the captured step: eager (what autograd saves), "
                        "compiled (torch.compile: Inductor's partition and buffer plan), selective or full activation "
                        "checkpointing of the blocks, compiled+selective / compiled+full (checkpointed blocks inside "
                        "torch.compile); all = one table with a row each for eager, compiled, selective and full "
                        "(default eager)")
    p.add_argument("--memory-budget", metavar="B|sweep",
                   help="compiled: torch._functorch activation_memory_budget (0..1, a fraction of activation "
                        "bytes, not of the peak); 'sweep' adds one compiled row per budget 1.0, 0.9, ... 0.0")
    p.add_argument("--blocks", metavar="GLOB", help="module paths of the blocks to checkpoint, e.g. 'layers.*' "
                                                     "(default: the repeated `name.N` modules)")
    p.add_argument("--checkpoint-every", type=int, default=1, metavar="K",
                   help="checkpoint every K-th block (default 1: all)")
    p.add_argument("--save-policy", default=None,
                   help="selective: a named save policy (matmul-attention, matmul, nothing, torchtitan); default: "
                        "the model file's save_policy(ctx, op, *args, **kwargs) if it defines one, else matmul-attention")
    p.add_argument("--save-ops", metavar="OPS",
                   help="selective: comma-separated aten ops whose outputs are kept, e.g. "
                        "mm,_scaled_dot_product_flash_attention (overrides --save-policy)")
    p.add_argument("--fit", metavar="SIZE", help="largest batch at --seq (with an explicit --batch: largest --seq) "
                                                 "whose peak fits SIZE, per policy; checked by full analyses")
    p.add_argument("--levers", action="store_true",
                   help="what-if table: one row per training lever and combination (checkpointing, compile, 8-bit "
                        "AdamW, Adafactor, pure bf16, accumulation, LoRA, offload, ZeRO-2/FSDP at --world-size), "
                        "each a full analysis; with --fit SIZE: the largest batch per lever")
    p.add_argument("--shard", choices=("ddp", "zero1", "zero2", "zero3", "fsdp"),
                   help="per-rank memory under data parallelism / ZeRO / FSDP2 (--batch is per rank)")
    p.add_argument("--world-size", type=int, metavar="N", help="--shard: number of ranks")
    p.add_argument("--no-reshard-after-forward", action="store_true", help="--shard fsdp: keep gathered blocks")
    p.add_argument("--fsdp-mixed-precision", action="store_true",
                   help="--shard fsdp: FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): bf16 "
                        "compute and gathered parameters, fp32 sharded parameters, gradients and optimizer state")
    p.add_argument("--by-depth", action="store_true",
                   help="analyse the model cut to 3, 4, 5 blocks and extrapolate to its depth (exact; refused when "
                        "blocks differ) - fast for very deep models")
    p.add_argument("--json", metavar="PATH", help="write the versioned JSON report to PATH")
    p.add_argument("--report", metavar="DIR", help="write DIR/report.html (self-contained) and its plots, tables, "
                                                   "layer graph and predicted snapshot")
    p.add_argument("--plot", metavar="PATH", help="peak timeline plot, .png or .svg (one panel per policy)")
    p.add_argument("--graph", metavar="PATH", help="per-layer liveness graph, .dot, .svg or .png (svg/png need graphviz)")
    p.add_argument("--graph-layer", metavar="NAME", help="layer for --graph/--report, e.g. blocks.3 "
                                                         "(default: the block holding most memory at the peak)")
    p.add_argument("--snapshot", metavar="PATH", help="write the predicted step as a torch.cuda.memory._dump_snapshot "
                                                      "pickle (opens in PyTorch's memory viewer)")
    p.add_argument("--device-memory", metavar="SIZE", help="device memory line on the plot, e.g. 80GiB")
    p.add_argument("--lines", action="store_true", help="print the full per-line table (grouped blocks, FLOPs)")
    p.add_argument("--save-baseline", metavar="PATH",
                   help="write a baseline for `python -m tracer check` (the JSON report plus what check compares)")
    p.add_argument("--top", type=int, default=10, help="number of source lines to show (default 10)")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    p.add_argument("--quiet", action="store_true", help="no progress messages on stderr")
    from tracer.target_cli import add_target_arguments
    add_target_arguments(p)   # --alloc-conf --cublas-workspace-config --compare --tolerance --compare-json
    return p


def build_snapshot_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tracer snapshot", description=(
        "Read a real CUDA memory snapshot (the pickle torch.cuda.memory._dump_snapshot writes): peak, phases, "
        "bytes live before the step, reserved memory, top lines. The pickle is loaded as plain data only."))
    p.add_argument("path", help="snapshot pickle")
    p.add_argument("--json", metavar="PATH", help="write the reading as JSON (same conventions as the prediction)")
    p.add_argument("--top", type=int, default=10, help="number of source lines to show (default 10)")
    p.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        from tracer.checks.cli import check_main
        return check_main(argv[1:])
    if argv[:1] == ["snapshot"]:
        args = build_snapshot_parser().parse_args(argv[1:])
        runner = _run_snapshot
    else:
        args = build_parser().parse_args(argv)
        args.batch_given = any(a == "--batch" or a.startswith("--batch=") for a in argv)
        runner = _run
    from tracer.entry import run_entry_point

    def body() -> int:
        _check_output_paths(args)
        return runner(args)
    return run_entry_point(body, prog="tracer", verbose=args.verbose)


_OUTPUT_FILES = ("json", "plot", "graph", "snapshot", "save_baseline", "compare_json")


def _check_output_paths(args) -> None:
    """Before any analysis: output paths may name folders that do not exist yet (`--plot out/step.png`):
    create them; every output's folder must be writable and the path must not be a folder (--report: must
    not be a file)."""
    import os

    from tracer.errors import UsageError
    paths = [(f"--{name.replace('_', '-')}", getattr(args, name, None)) for name in _OUTPUT_FILES]
    for flag, path in paths:
        if not path:
            continue
        if os.path.isdir(path):
            raise UsageError(f"{flag} {path} is a folder", hint="give a file path")
        _writable_folder(flag, os.path.dirname(path) or ".")
    report = getattr(args, "report", None)
    if report:
        if os.path.exists(report) and not os.path.isdir(report):
            raise UsageError(f"--report {report} is a file", hint="give a folder path")
        _writable_folder("--report", os.path.dirname(os.path.abspath(report)))


def _writable_folder(flag: str, folder: str) -> None:
    import os

    from tracer.errors import UsageError
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag}: cannot create the output folder {folder}: {exc.strerror}") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: the output folder {folder} is not writable")


def _run_snapshot(args) -> int:
    import os

    from tracer.errors import UsageError
    from tracer.reports.snapshot_text import render_snapshot, snapshot_json
    from tracer.snapshots.reader import read_snapshot

    if not os.path.isfile(args.path):
        raise UsageError(f"snapshot file not found: {args.path}")
    reading = read_snapshot(args.path)
    sys.stdout.write(render_snapshot(reading, top=args.top))
    if args.json:
        _write_json(args.json, snapshot_json(reading, top=args.top))
    return int(ExitCode.OK)


def _plan(args, options) -> int:
    """--fit and --by-depth: the same options as the full analysis, sizes varied by the planner."""
    from tracer.planning import analyze_by_depth, fit_budget
    from tracer.reports.planning_text import render_depth, render_fit

    keywords = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)
                if f.name not in ("batch", "seq", "policies", "memory_budgets")}
    budget = next((b for b in options.memory_budgets if b is not None), None)
    names = options.policies
    if args.fit:
        report = fit_budget(args.model, args.fit, seq=args.seq, batch=args.batch if args.batch_given else None,
                            policies=names, memory_budget=budget, **keywords)
        sys.stdout.write(render_fit(report))
    else:
        sys.stdout.write(render_depth(analyze_by_depth(args.model, batch=args.batch, seq=args.seq, policies=names,
                                                       memory_budget=budget, **keywords)))
    return int(ExitCode.OK)


def _levers(args) -> int:
    """--levers (with --fit: the largest batch per lever). --world-size alone sets the sharding levers' ranks."""
    from tracer.errors import UsageError
    from tracer.levers import fit_levers, run_levers
    from tracer.reports.levers_text import levers_json, render_lever_fits, render_levers

    if args.by_depth:
        raise UsageError("--levers and --by-depth cannot be combined", hint="drop one of them")
    world_size = args.world_size
    if args.shard is None:
        args.world_size = None             # the sharding levers take it; the baseline is one device
    options = analysis_options(args)
    if args.fit:
        from tracer.planning import parse_budget
        fits = fit_levers(args.model, args.fit, options, world_size=world_size)
        sys.stdout.write(render_lever_fits(fits, budget_bytes=parse_budget(args.fit), seq=options.seq))
        return int(ExitCode.OK)
    progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
    table = run_levers(args.model, options, world_size=world_size, on_progress=progress)
    sys.stdout.write(render_levers(table))
    if args.json:
        _write_json(args.json, levers_json(table))
    progress.done()
    return int(ExitCode.OK)


def _write_visual_outputs(args, analysis, policy: str) -> None:
    from tracer.errors import UsageError
    from tracer.reports.units import parse_bytes

    device_memory = None
    if args.device_memory:
        try:
            device_memory = parse_bytes(args.device_memory)
        except ValueError as exc:
            raise UsageError(f"--device-memory: {exc}") from exc
    if args.lines:
        from tracer.reports.line_table import build_line_table, render_line_table
        sys.stdout.write("\n" + render_line_table(build_line_table(analysis, policy), top=None))
    if args.plot:
        from tracer.reports.timeline import render_timeline
        render_timeline(analysis, args.plot, device_memory_bytes=device_memory)
    if args.graph:
        from tracer.reports.layer_graph import render_layer_graph, write_layer_graph
        write_layer_graph(render_layer_graph(analysis, layer=args.graph_layer, policy=policy), args.graph)
    if args.snapshot:
        from tracer.reports.memviz import write_memviz_snapshot
        write_memviz_snapshot(analysis, args.snapshot, policy=policy)
    if args.report:
        from tracer.reports.report_dir import write_report_dir
        write_report_dir(analysis, args.report, policy=policy, layer=args.graph_layer,
                         device_memory_bytes=device_memory)


def _write_json(path: str, data: dict) -> None:
    from tracer.outputs import write_output
    write_output(path, json.dumps(data, indent=2), what="--json")


def analysis_options(args):
    """The parsed flags -> the pipeline's AnalysisOptions (every flag that changes the answer)."""
    from tracer.errors import UsageError
    from tracer.pipeline import AnalysisOptions
    from tracer.reports.units import parse_bytes

    if args.batch < 1 or args.seq < 1:
        raise UsageError("--batch and --seq must be positive integers")
    device_memory = None
    if getattr(args, "device_memory", None):
        try:
            device_memory = parse_bytes(args.device_memory)
        except ValueError as exc:
            raise UsageError(f"--device-memory: {exc}") from exc
    check_target_flags(args)
    names, budgets = policy_names_and_budgets(args)
    options = AnalysisOptions(
        batch=args.batch, seq=args.seq, precision=args.precision, optimizer=args.optimizer, foreach=args.foreach,
        step=args.step, zero_grad_set_to_none=args.zero_grad == "none", policies=names, memory_budgets=budgets,
        blocks=args.blocks, checkpoint_every=args.checkpoint_every, save_policy=args.save_policy,
        save_ops=tuple(args.save_ops.split(",")) if args.save_ops else (), hf_config=tuple(args.hf_config),
        config_json=args.config_json, hf_attn=args.hf_attn, hf_task=args.hf_task, capture=args.capture, moe_routing=args.moe_routing,
        target=args.target,
        gpu=args.gpu, alloc_conf=args.alloc_conf, cublas_workspace_config=args.cublas_workspace_config,
        device_memory_bytes=device_memory, shard=args.shard, world_size=args.world_size,
        reshard_after_forward=not args.no_reshard_after_forward, fsdp_mixed_precision=args.fsdp_mixed_precision,
        accumulate=args.accumulate, offload=args.offload, lora_rank=args.lora_rank, lora_targets=args.lora_targets,
        tp=args.tp, sp=args.sp)
    return options                          # AnalysisOptions validates every field when made: before any capture


def _run(args) -> int:
    import torch

    import tracer
    from tracer.pipeline import run_analysis
    from tracer.target_cli import run_target_outputs
    from tracer.reports.json_report import report_json
    from tracer.reports.text import render_text

    if args.levers:
        return _levers(args)
    options = analysis_options(args)
    if args.fit or args.by_depth:
        return _plan(args, options)
    progress = _Progress(enabled=not args.quiet and sys.stderr.isatty())
    analysis = run_analysis(args.model, options, on_progress=progress)
    specs = options.policy_specs()
    shown = None if args.policy == "all" or len(specs) > 1 else specs[0].label
    sys.stdout.write(render_text(analysis, policy=shown, top=args.top))
    if args.json:
        versions = {"tracer_version": tracer.__version__, "torch_version": torch.__version__}
        _write_json(args.json, report_json(analysis, top=args.top, versions=versions))
    if args.save_baseline:
        from tracer.checks import save_baseline
        save_baseline(analysis, args.save_baseline, top=args.top)
    _write_visual_outputs(args, analysis, shown or next(iter(analysis.policies)))
    if args.shard:
        from tracer.reports.planning_text import render_sharding
        sharded = {label: policy.sharded for label, policy in analysis.policies.items()}
        sys.stdout.write("\n" + render_sharding(sharded, single_device_peaks={
            k: p.peak_bytes for k, p in analysis.policies.items()}))
    code = run_target_outputs(args, analysis, shown or next(iter(analysis.policies)))
    progress.done()
    return code


BUDGET_SWEEP = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0)


def policy_names_and_budgets(args) -> tuple[tuple[str, ...], tuple[float | None, ...]]:
    """--policy and --memory-budget -> (policy names, compiled memory budgets). A budget adds compiled."""
    from tracer.errors import UsageError

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


class _Progress:
    def __init__(self, enabled: bool):
        self.enabled = enabled
        self.start = time.monotonic()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"[{time.monotonic() - self.start:5.1f}s] {message}", file=sys.stderr)

    def done(self) -> None:
        self("done")
