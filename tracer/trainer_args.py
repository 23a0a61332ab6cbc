"""Hugging Face `TrainingArguments` as tracer's options: `--trainer-args args.json` (the JSON that
`TrainingArguments.to_json_string()` writes, or any subset of its keys) gives the step the Trainer runs.

    trainer_options(path) -> dict of AnalysisOptions fields

Read: `per_device_train_batch_size` (batch), `gradient_accumulation_steps` (accumulate), `bf16` / `fp16`
(autocast around forward and loss, as the Trainer's accelerator runs it; fp16 with its GradScaler), `optim`
(the optimizer's state layout, named in the report; those without one here are refused by name; the
optimizer itself is built by transformers' `Trainer.create_optimizer` from the same file, as
`trainer_args`: tracer/capture/trainer_optimizer.py), `torch_compile` (the compiled
policy), and `gradient_checkpointing` / `activation_checkpointing` with their `*_kwargs` `use_reentrant`
(transformers 5 defaults it to False): the model's own `gradient_checkpointing_enable`, as the Trainer calls
it. Not modelled: `max_grad_norm`'s clipping (a 0-dim norm per gradient), the learning-rate schedule,
`every_n_layers` and `offload` in the checkpointing kwargs (refused when set), DeepSpeed and FSDP configs
(use --shard), and the Trainer's evaluation and logging.
"""
from __future__ import annotations

import json
import os

from tracer.errors import UsageError

# TrainingArguments.optim -> tracer's --optimizer (the same update and state layout)
OPTIMIZERS = {
    "adamw_torch": "adamw", "adamw_torch_fused": "adamw", "adamw_hf": "adamw", "adamw_torch_xla": "adamw",
    "adafactor": "adafactor-hf", "adamw_bnb_8bit": "adamw8bit", "adamw_8bit": "adamw8bit",
    "paged_adamw_8bit": "paged-adamw8bit", "sgd": "sgd-plain", "lion_32bit": "lion",
}


def trainer_options(path: str) -> dict:
    """The AnalysisOptions fields the Trainer's arguments in the JSON file at `path` decide. Raises
    UsageError for an unreadable file or an argument tracer cannot follow."""
    try:
        with open(path) as f:
            args = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--trainer-args {path}: {exc}",
                         hint="give the JSON that TrainingArguments.to_json_string() writes") from exc
    if not isinstance(args, dict):
        raise UsageError(f"--trainer-args {path}: not a JSON object of TrainingArguments")
    fields: dict = {}
    if "per_device_train_batch_size" in args:
        fields["batch"] = int(args["per_device_train_batch_size"])
    if "gradient_accumulation_steps" in args:
        fields["accumulate"] = int(args["gradient_accumulation_steps"])
    fields["precision"] = "bf16" if args.get("bf16") else "fp16" if args.get("fp16") else "fp32"
    optim = args.get("optim", "adamw_torch")
    if optim not in OPTIMIZERS:
        raise UsageError(f"--trainer-args {path}: optim {optim!r} has no optimizer of the same state here",
                         hint=f"one of {', '.join(OPTIMIZERS)}, or a model file's make_optimizer")
    fields["optimizer"] = OPTIMIZERS[optim]
    fields["trainer_args"] = os.path.abspath(path)   # the optimizer itself is built as the Trainer builds it
    if args.get("torch_compile"):
        fields["policies"] = ("compiled",)
    checkpointing = _checkpointing(args, path)
    if checkpointing is not None:
        fields["gradient_checkpointing"] = checkpointing
    return fields


def _checkpointing(args: dict, path: str) -> str | None:
    """"reentrant" / "non-reentrant" when the Trainer enables the model's gradient checkpointing, else None."""
    for flag, kwargs_key in (("activation_checkpointing", "activation_checkpointing_kwargs"),
                             ("gradient_checkpointing", "gradient_checkpointing_kwargs")):
        if not args.get(flag):
            continue
        kwargs = dict(args.get(kwargs_key) or {})
        unsupported = [k for k in ("every_n_layers", "offload") if kwargs.get(k) not in (None, 1, False)]
        if unsupported:
            raise UsageError(f"--trainer-args {path}: {kwargs_key} {', '.join(unsupported)} are not modelled",
                             hint="drop them, or write the checkpointing in a model file")
        return "reentrant" if kwargs.get("use_reentrant", False) else "non-reentrant"
    return None
