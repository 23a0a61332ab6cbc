"""The command line's argument groups, shared by the subcommands; every choice comes from a registry.

    add_model_group(parser, *, only_given=False)    MODEL, the model options (tracer.checks.options), hf: options
    add_policy_group(parser, *, only_given=False)   --policy (tracer.policies) --memory-budget --blocks ...
    add_sharding_group(parser, *, only_given=False) --shard (tracer.passes.sharding.STRATEGIES) --world-size ...
    add_output_group(parser)                        --json --report --plot --graph --export-snapshot ...
    add_display_group(parser)                       --lines --top --verbose --quiet --progress
    deprecated_alias(group, old, new)               a hidden old spelling that prints a note and still works
    check_output_paths(args)                        before any analysis: every output path is writable (--json,
                                                    the table of outputs' PATH flags, --save-baseline, ...)
    flag_dest(flag)                                 where argparse stores a flag: --export-snapshot -> export_snapshot

`only_given`: a flag not on the command line leaves no attribute (`tracer check` then takes the baseline's
setting). Nothing here imports torch: `python -m tracer --help` must stay fast (tests/cli/test_help.py).
"""
from __future__ import annotations

import argparse
import os
import sys

from tracer.errors import UsageError


def add_model_group(parser: argparse.ArgumentParser, *, only_given: bool = False,
                    model_help: str | None = None) -> None:
    from tracer.checks.options import add_model_arguments
    from tracer.models import DEFAULT_MODEL
    from tracer.models.hf_tasks import TASKS

    group = parser.add_argument_group("model and step")
    if only_given:
        group.add_argument("model", help=model_help)
    else:
        group.add_argument("model", nargs="?", default=DEFAULT_MODEL, help=model_help or (
            f"zoo name (`python -m tracer models` lists them), path to a model file, or hf:<model_type> "
            f"(a transformers model built from its default config, no download: hf:llama, hf:roberta, hf:vit, "
            f"hf:whisper, ...) (default: {DEFAULT_MODEL})"))
    add_model_arguments(group, only_given=only_given)
    default = argparse.SUPPRESS if only_given else None
    group.add_argument("--hf-config", action="append", default=argparse.SUPPRESS if only_given else [],
                       metavar="KEY=VALUE",
                       help="hf: models: override a config field (repeatable), e.g. --hf-config num_hidden_layers=2")
    group.add_argument("--model-arg", dest="model_args", action="append",
                       default=argparse.SUPPRESS if only_given else [], metavar="KEY=VALUE",
                       help="a model file or module: a keyword argument of its build_model (or of the factory "
                            "named as pkg.module:factory), read as a Python literal, else as text (repeatable), "
                            "e.g. --model-arg n_layers=4")
    group.add_argument("--config-json", metavar="PATH", default=default,
                       help="hf: models: build from this local config.json (no download)")
    group.add_argument("--hf-task", choices=tuple(TASKS), metavar="TASK", default=default,
                       help=f"hf: models: the head whose loss is trained ({', '.join(TASKS)}; default: the "
                            f"config.json's architectures, else the first of these the architecture has: "
                            f"seq2seq, speech-seq2seq, masked-lm, causal-lm, image-classification, "
                            f"sequence-classification)")


def add_policy_group(parser: argparse.ArgumentParser, *, only_given: bool = False) -> None:
    from tracer.policies import ALL_POLICIES, POLICIES, SAVE_POLICIES

    group = parser.add_argument_group("recompute policies")
    group.add_argument("--policy", choices=POLICIES + ("all",),
                       default=argparse.SUPPRESS if only_given else "eager",
                       help="which recompute policy to simulate on the captured step: eager (what autograd saves), "
                            "compiled (torch.compile: Inductor's partition and buffer plan), selective or full "
                            "activation checkpointing of the blocks, compiled+selective / compiled+full "
                            "(checkpointed blocks inside torch.compile); all = one table with a row each for "
                            f"{', '.join(ALL_POLICIES)} (default eager)")
    if only_given:
        return
    group.add_argument("--memory-budget", metavar="B|sweep",
                       help="compiled: torch._functorch activation_memory_budget (0..1, a fraction of activation "
                            "bytes, not of the peak); 'sweep' adds one compiled row per budget 1.0, 0.9, ... 0.0")
    group.add_argument("--blocks", metavar="GLOB",
                       help="module paths of the blocks to checkpoint, e.g. 'layers.*' "
                            "(default: the repeated `name.N` modules)")
    group.add_argument("--checkpoint-every", type=int, default=1, metavar="K",
                       help="checkpoint every K-th block (default 1: all)")
    group.add_argument("--save-policy", default=None,
                       help=f"selective: a named save policy ({', '.join(SAVE_POLICIES)}); default: the model "
                            "file's save_policy(ctx, op, *args, **kwargs) if it defines one, else matmul-attention")
    group.add_argument("--save-ops", metavar="OPS",
                       help="selective: comma-separated aten ops whose outputs are kept, e.g. "
                            "mm,_scaled_dot_product_flash_attention (overrides --save-policy)")


def add_sharding_group(parser: argparse.ArgumentParser, *, only_given: bool = False) -> None:
    from tracer.passes.sharding import STRATEGIES

    group = parser.add_argument_group("data parallelism")
    default = argparse.SUPPRESS if only_given else None
    group.add_argument("--shard", choices=tuple(STRATEGIES), default=default,
                       help="per-rank memory under data parallelism / ZeRO / FSDP2 (--batch is per rank)")
    group.add_argument("--world-size", type=int, metavar="N", default=default, help="--shard: number of ranks")
    if only_given:
        return
    group.add_argument("--no-reshard-after-forward", action="store_true", help="--shard fsdp: keep gathered blocks")
    group.add_argument("--fsdp-mixed-precision", action="store_true",
                       help="--shard fsdp: FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): "
                            "bf16 compute and gathered parameters, fp32 sharded parameters, gradients and "
                            "optimizer state")


def add_output_group(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("files written")
    group.add_argument("--json", metavar="PATH", help="write the versioned JSON report to PATH")
    group.add_argument("--report", metavar="DIR", help="write DIR/report.html (self-contained) and its plots, "
                                                       "tables, layer graph and predicted snapshot")
    group.add_argument("--plot", metavar="PATH", help="peak timeline plot, .png or .svg (one panel per policy)")
    group.add_argument("--graph", metavar="PATH",
                       help="per-layer liveness graph, .dot, .svg or .png (svg/png need graphviz)")
    group.add_argument("--graph-layer", metavar="NAME", help="layer for --graph/--report, e.g. blocks.3 "
                                                             "(default: the block holding most memory at the peak)")
    group.add_argument("--export-snapshot", metavar="PATH",
                       help="write the predicted step as a torch.cuda.memory._dump_snapshot pickle (opens in "
                            "PyTorch's memory viewer; `python -m tracer snapshot PATH` reads a real one)")
    deprecated_alias(group, "--snapshot", "--export-snapshot")
    group.add_argument("--device-memory", metavar="SIZE", help="device memory line on the plot, e.g. 80GiB")
    group.add_argument("--save-baseline", metavar="PATH",
                       help="write a baseline for `python -m tracer check` (the JSON report plus what check compares)")


def add_display_group(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("display")
    group.add_argument("--top", type=int, default=10, help="number of source lines to show (default 10)")
    group.add_argument("--lines", action="store_true", help="print the full per-line table (grouped blocks, FLOPs)")
    group.add_argument("--verbose", action="store_true", help="on error, show the full chained traceback")
    group.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    group.add_argument("--progress", action="store_true",
                       help="progress lines on stderr even when it is not a terminal (default: only on a terminal)")
    group.add_argument("--no-cache", action="store_true",
                       help="capture again instead of reusing a cached capture of the same model, code and options "
                            "(also TRACER_NO_CACHE=1; the cache lives in $TRACER_CACHE_DIR or ~/.cache/tracer)")


class _DeprecatedAlias(argparse.Action):
    """An old spelling: stores into the new flag's dest and prints one note on stderr."""

    def __init__(self, option_strings, dest, *, new_flag: str, **kwargs):
        super().__init__(option_strings, dest, **kwargs)
        self.new_flag = new_flag

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"tracer: note: {option_string} is deprecated, use {self.new_flag}", file=sys.stderr)
        setattr(namespace, self.dest, values)


def deprecated_alias(group, old: str, new: str, **kwargs) -> None:
    """`old` keeps working (hidden from --help) for the flag `new`, with a deprecation note."""
    group.add_argument(old, dest=flag_dest(new), action=_DeprecatedAlias, new_flag=new,
                       default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kwargs)


def flag_dest(flag: str) -> str:
    """The attribute argparse stores a flag in: `--export-snapshot` -> `export_snapshot`."""
    return flag.lstrip("-").replace("-", "_")


def _output_path_flags() -> tuple[str, ...]:
    """Every flag that names a file to write, in --help's order: the PATH flags of the table of outputs
    (tracer.reports.report_dir) and what the command line writes itself (the JSON report, the baseline, the
    comparison)."""
    from tracer.reports.report_dir import OUTPUTS

    table = tuple(output.flag for output in OUTPUTS if output.flag and not output.switch)
    return ("--json", *table, "--save-baseline", "--compare-json")


def check_output_paths(args) -> None:
    """Before any analysis: output paths may name folders that do not exist yet (`--plot out/step.png`):
    create them; every output's folder must be writable and the path must not be a folder (--report: must
    not be a file)."""
    for flag in _output_path_flags():
        path = getattr(args, flag_dest(flag), None)
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
    try:
        os.makedirs(folder, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{flag}: cannot create the output folder {folder}: {exc.strerror}") from exc
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{flag}: the output folder {folder} is not writable")
