"""The model options of one analysis (batch, seq, precision, optimizer, foreach, step, zero_grad, target, gpu,
capture, hf_attn, moe_routing, lora_rank, lora_targets, tp, sp, ep, full_capture), defined once.

`MODEL_OPTIONS` is the single table behind the command-line flags (`add_model_arguments`) and the
`memory_budget` marker's keyword arguments; `analyze_kwargs(values)` validates a mapping of option name ->
value (missing names take the default) and returns the keyword arguments of `tracer.analyze`.
Names are the CLI's, with `_` for `-`, and `tracer.analyze`'s: `zero_grad` is "none" (set_to_none=True) or
"zeros" (one spelling everywhere; `options_fields` maps it to AnalysisOptions.zero_grad_set_to_none).
"""
from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Mapping

from tracer.choices import (DEFAULT_GPU, DEFAULT_TARGET, FP8_RECIPES, GPUS, OFFLOAD_MODES, OPTIMIZERS,
                            PIPELINE_SCHEDULES, PRECISIONS, QUANTIZED_BASES, TARGET_DEVICES)
from tracer.errors import UsageError


@dataclasses.dataclass(frozen=True)
class ModelOption:
    name: str                            # marker keyword; the flag is --name with '-' for '_'
    default: int | bool | str | None      # None: optional, no value means the documented default
    choices: tuple[str, ...] | None
    help: str
    cli: str | None = None               # the flag's name when it differs from `name` (--lora for lora_rank)
    kind: str | None = None              # "count": None or a positive int; "names": a tuple of names (a,b on the CLI);
                                         # "switch": None (the default stated in help), True or False (--x/--no-x)

    @property
    def flag(self) -> str:
        return "--" + (self.cli or self.name).replace("_", "-")


MODEL_OPTIONS: tuple[ModelOption, ...] = (
    ModelOption("batch", 2, None, "batch size passed to example_batch (default 2)"),
    ModelOption("seq", 1024, None, "sequence length passed to example_batch (default 1024)"),
    ModelOption("precision", "fp32", PRECISIONS,
                "fp32; bf16 = torch.autocast(bfloat16) around forward and loss with fp32 weights; "
                "bf16-pure = bf16 weights and inputs, no autocast; fp16 = torch.autocast(float16) with fp32 "
                "weights and torch.amp.GradScaler (scaled loss, unscale_, update) (default fp32)"),
    ModelOption("optimizer", "adamw", OPTIMIZERS,
                "optimizer used when the model file defines no make_optimizer (default adamw): adam; sgd-momentum "
                "(momentum 0.9; sgd is its old name), sgd-plain (no momentum); adafactor (torch.optim), "
                "adafactor-hf (transformers'); lion; adamw8bit, paged-adamw8bit (bitsandbytes' state layout, "
                "simulated); none"),
    ModelOption("accumulate", 1, None,
                "gradient accumulation: micro-batches of --batch per optimizer step; from the second on the "
                "gradients are resident and accumulated in place (default 1)"),
    ModelOption("offload", None, OFFLOAD_MODES,
                "CPU offload (ZeRO-Offload, FSDP2 CPUOffloadPolicy): optimizer = optimizer state and step in host "
                "memory, gradients copied there as each completes; optimizer+params = the parameters too, copied "
                "to the device around their forward and backward uses; activations = the saved tensors, as "
                "torch.autograd.graph.save_on_cpu(pin_memory=True) around forward and loss (default: none)"),
    ModelOption("foreach", None, None,
                "foreach (multi-tensor) implementation of --optimizer; default: torch's own for the target's "
                "device (foreach on CUDA, the per-parameter loop on CPU)", kind="switch"),
    ModelOption("step", "steady", ("steady", "first"),
                "steady: optimizer state exists before the step; first: it is created in step() (default steady)"),
    ModelOption("zero_grad", "none", ("none", "zeros"),
                "zero_grad(set_to_none=True) (none, default) or set_to_none=False (zeros): gradients are kept "
                "between steps and accumulated in place"),
    ModelOption("target", DEFAULT_TARGET, TARGET_DEVICES,
                "device the step runs on: cuda (traced on CPU fake tensors with the CUDA SDPA kernels and "
                "autocast lists, plus the cuBLAS workspaces and the caching allocator's allocated and reserved "
                f"memory) or cpu (default {DEFAULT_TARGET})"),
    ModelOption("gpu", None, tuple(sorted(GPUS)),
                "GPU of the cuda target: picks the SDPA backend rules, the cuBLAS workspace size and the device "
                f"memory the step is checked against (default {DEFAULT_GPU})"),
    ModelOption("capture", "auto", ("auto", "export", "compile", "dispatch"),
                "auto: the joint graph, traced from the module, else through torch.export, else through "
                "torch.compile, falling back to running the step op by op on fake tensors (eager policy only); "
                "for the eager policy alone the op-by-op run comes first and is kept where it stands for the "
                "graph's step; export: the first two, no fallback; compile: torch.compile's joint only; "
                "dispatch: the op-by-op run directly (default auto)"),
    ModelOption("hf_attn", "sdpa", ("sdpa", "eager"),
                "hf: models: attn_implementation (default sdpa; eager saves the s x s probabilities)"),
    ModelOption("moe_routing", "balanced", None,
                "mixture of experts: how routers spread tokens, which sizes the data-dependent ops (nonzero, "
                "torch.where(mask), .item()): balanced (tokens x top_k / experts each), worst (every token picks "
                "the same top_k experts) or a JSON file of per-expert token counts (default balanced)"),
    ModelOption("lora_rank", None, None,
                "LoRA adapters of this rank (peft LoraConfig(r=RANK, lora_dropout=0)) on the model: base weights "
                "frozen (no gradient, no optimizer state), adapters trained (default: off)", cli="lora", kind="count"),
    ModelOption("lora_targets", (), None,
                "--lora: comma-separated module names to adapt, e.g. q_proj,v_proj (default: peft's targets for "
                "known transformers architectures, else every nn.Linear except the output head)", kind="names"),
    ModelOption("quantized_base", None, QUANTIZED_BASES,
                "a quantized, frozen base trained through LoRA adapters (--lora, rank 8 when not given): every "
                "nn.Linear but the head as bitsandbytes' layer, 4bit: QLoRA's NF4 with double quantization, "
                "8bit: LLM.int8; then peft's prepare_model_for_kbit_training; run op by op, eager only "
                "(default: off)", cli="base"),
    ModelOption("fp8", None, FP8_RECIPES,
                "FP8 training with torchao's float8 recipe: every nn.Linear but the head whose features are "
                "multiples of 16 converted by convert_to_float8_training (default: off)"),
    ModelOption("tp", 1, None,
                "Megatron tensor parallelism: the memory of one of N tensor-parallel ranks (column/row-parallel "
                "linears and vocab-parallel embeddings found from the captured graph) (default 1: off)"),
    ModelOption("sp", False, None,
                "--tp: Megatron sequence parallelism: the activations outside the tensor-parallel regions "
                "(layer norms, dropouts, residuals) are split along the sequence too (default off)"),
    ModelOption("ep", 1, None,
                "expert parallelism written into the model (torchtitan's style: experts split over "
                "dist.get_world_size() ranks, tokens exchanged by all-to-all): the model is built and stepped as "
                "rank 0 of N ranks of a fake process group, every rank routing as --moe-routing says (default 1: "
                "off)"),
    ModelOption("cp", 1, None,
                "context parallelism as torch's context_parallel runs it: the sequence split over N ranks, "
                "F.scaled_dot_product_attention run as its ring attention (key and value all-gathered, their "
                "gradients passed around the ring); the model is built and stepped as rank 0 of N ranks of a "
                "fake process group with --seq / N positions (default 1: off)"),
    ModelOption("pp", 1, None,
                "pipeline parallelism as torch.distributed.pipelining runs it: the memory of the busiest of N "
                "pipeline stages (the repeated blocks split evenly; every stage's peak in a note) (default 1: off)"),
    ModelOption("microbatches", None, None,
                "--pp: micro-batches per step, each --batch / M (default: as many as stages)", kind="count"),
    ModelOption("pp_schedule", "1f1b", PIPELINE_SCHEDULES,
                "--pp: the schedule, torch's Schedule1F1B, ScheduleGPipe or ScheduleInterleaved1F1B (several "
                "stages on each rank) (default 1f1b)"),
    ModelOption("pp_local_stages", None, None,
                "--pp-schedule interleaved-1f1b: the stages each rank holds, the model cut into N x this many "
                "(default 2)", kind="count"),
    ModelOption("pp_return_outputs", True, None,
                "--pp: the loop calls step(..., return_outputs=True), torch's default: the last stage keeps every "
                "micro-batch's output until the next step and concatenates them after the last backward; "
                "--no-pp-return-outputs for return_outputs=False"),
    ModelOption("gradient_checkpointing", None, ("reentrant", "non-reentrant"),
                "call the model's own gradient_checkpointing_enable (transformers' models), with use_reentrant "
                "as given, as Trainer(gradient_checkpointing=True) does (default off)"),
    ModelOption("full_capture", False, None,
                "capture every block of a deep model; by default a model with more than 10 identical blocks "
                "(more than 7 when a second core captures the 6 at once and no policy is compiled) is "
                "captured cut to 4 and 6 blocks and the full depth is synthesized from 4, after checking that "
                "the 6 synthesized equal the 6 captured op for op (else captured in full, with a note)"),
)
OPTION_NAMES = tuple(o.name for o in MODEL_OPTIONS)
MODEL_DEFAULTS = {o.name: o.default for o in MODEL_OPTIONS}   # AnalysisOptions' defaults (tracer/pipeline.py)


def add_model_arguments(parser: argparse.ArgumentParser, *, only_given: bool = False) -> None:
    """Add --batch --seq --precision --optimizer --foreach/--no-foreach --step --zero-grad --target --gpu
    --capture --hf-attn to `parser` (dest = the option name). Pass `vars(args)` to `analyze_kwargs`.
    `only_given`: a flag not on the command line leaves no attribute (`tracer check` then takes the
    baseline's setting)."""
    for option in MODEL_OPTIONS:
        default = argparse.SUPPRESS if only_given else option.default
        if option.kind == "switch" or isinstance(option.default, bool):
            parser.add_argument(option.flag, dest=option.name, action=argparse.BooleanOptionalAction,
                                default=default, help=option.help)
        elif option.kind is not None:
            parser.add_argument(option.flag, dest=option.name, default=default, help=option.help,
                                type=int if option.kind == "count" else comma_names,
                                metavar=option.name.rsplit("_", 1)[-1].upper() if option.kind == "count" else "NAMES")
        elif isinstance(option.default, int):
            parser.add_argument(option.flag, dest=option.name, type=int, default=default, help=option.help)
        elif option.choices is None:
            parser.add_argument(option.flag, dest=option.name, default=default, help=option.help)
        else:
            parser.add_argument(option.flag, dest=option.name, choices=option.choices, default=default,
                                help=option.help)


def check_option_value(option: ModelOption, value) -> None:
    """Raises UsageError naming `option` and its valid values when `value` is not one of them (free-text
    options parse themselves: moe_routing)."""
    if option.kind == "count":
        ok, wanted = value is None or (isinstance(value, int) and not isinstance(value, bool) and value >= 1), \
            "None or a positive integer"
    elif option.kind == "switch":
        ok, wanted = value is None or isinstance(value, bool), "None (the default), True or False"
    elif option.kind == "names":
        ok, wanted = isinstance(value, tuple) and all(isinstance(v, str) and v for v in value), \
            "a tuple of names, e.g. ('q_proj', 'v_proj')"
    elif isinstance(option.default, bool):
        ok, wanted = isinstance(value, bool), "True or False"
    elif isinstance(option.default, int):
        ok, wanted = isinstance(value, int) and not isinstance(value, bool) and value >= 1, "a positive integer"
    elif option.choices is None:
        ok, wanted = isinstance(value, str), "a string"
        if ok and option.name == "moe_routing":
            from tracer.capture.routing import parse_routing
            parse_routing(value)
    else:
        ok = value in option.choices or (option.default is None and value is None)
        wanted = "one of " + ", ".join(option.choices) + (" or None" if option.default is None else "")
    if not ok:
        raise UsageError(f"{option.name}={value!r} is not valid", hint=f"{option.name} must be {wanted}")


def comma_names(text: str) -> tuple[str, ...]:
    """"q_proj, v_proj" -> ("q_proj", "v_proj")."""
    return tuple(name.strip() for name in text.split(",") if name.strip())


def analyze_kwargs(values: Mapping[str, object]) -> dict:
    """Option name -> value (other keys are ignored; missing names take the default) -> the keyword
    arguments of `tracer.analyze`. Raises UsageError naming the option on a bad value."""
    out: dict[str, object] = {}
    for option in MODEL_OPTIONS:
        value = values.get(option.name, option.default)
        if option.kind == "names":
            value = comma_names(value) if isinstance(value, str) else tuple(value) if isinstance(value, list) else value
        check_option_value(option, value)
        out[option.name] = value
    return out


def options_fields(kwargs: Mapping[str, object]) -> dict:
    """`analyze_kwargs`' result (or part of it) -> AnalysisOptions fields: zero_grad ("none" | "zeros") is
    the field zero_grad_set_to_none."""
    fields = dict(kwargs)
    if "zero_grad" in fields:
        fields["zero_grad_set_to_none"] = fields.pop("zero_grad") == "none"
    return fields
