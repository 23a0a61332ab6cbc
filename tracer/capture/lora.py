"""`--lora RANK [--lora-targets a,b]`: LoRA adapters on the user's model, put there where the model is built.

`lora_source(source, rank, targets)` returns the `ModelSource` whose `build_model()` builds the user's model
and wraps it with peft, as a training script does: `peft.get_peft_model(model, LoraConfig(r=rank,
target_modules=..., lora_dropout=0.0))`. peft freezes every base parameter (`requires_grad=False`: no
gradient, no optimizer state) and adds the trainable `lora_A` / `lora_B` weights; the adapted layers run
`base(x) + lora_B(lora_A(x)) * scaling`, all of which the capture then sees like any other model code.
`apply_lora(model, rank, targets)` is the same wrapping for a real model (the accuracy tests use it).

Targets (`default_targets`): the names given; else, for a transformers model whose `config.model_type` peft
knows, peft's own default for that architecture (llama: q_proj, v_proj; gpt2: c_attn; bert: query, value);
else every `nn.Linear` except the output head (the model's `get_output_embeddings()` when it has one, else
the last `nn.Linear` registered). A name matches a module whose path is the name or ends in `.name`, as in
peft; names that match no module are refused with the model's linear layers listed.

A quantized base under the adapters (QLoRA) is `--base` (quantized_base.py), applied before them.
Not modelled: other peft methods (DoRA), and `lora_dropout > 0` (the adapters' dropout would save a mask); the scaling (`lora_alpha`) changes no memory.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from tracer.capture.model_input import ModelSource
from tracer.errors import UsageError, package_import_error


def lora_source(source: ModelSource, rank: int, targets: tuple[str, ...] = ()) -> ModelSource:
    """`source` whose built model carries LoRA adapters of `rank` on `targets` (() : `default_targets`)."""
    def build_model():
        return apply_lora(source.build_model(), rank, targets)
    return dataclasses.replace(source, build_model=build_model)


def apply_lora(model: nn.Module, rank: int, targets: tuple[str, ...] = ()) -> nn.Module:
    """`peft.get_peft_model(model, LoraConfig(r=rank, ...))`. Raises UsageError when peft is missing or no
    module matches `targets`."""
    try:
        import peft
    except ImportError as exc:
        raise package_import_error("--lora", ("peft",), exc, install="pip install peft") from exc
    chosen = _matching(model, targets) if targets else default_targets(model)
    if not chosen:
        raise UsageError(f"--lora: {type(model).__name__} has no nn.Linear to adapt",
                         hint="name the modules with --lora-targets")
    config = peft.LoraConfig(r=rank, target_modules=list(chosen), lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def default_targets(model: nn.Module) -> tuple[str, ...]:
    """peft's default target names for a transformers architecture it knows, else the paths of every
    nn.Linear except the output head."""
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as PEFT_DEFAULTS

    hf = _transformers_model(model)
    model_type = getattr(getattr(hf, "config", None), "model_type", None)
    if model_type in PEFT_DEFAULTS:
        return _matching(model, tuple(PEFT_DEFAULTS[model_type]))
    return linears_except_head(model)


def linears_except_head(model: nn.Module) -> tuple[str, ...]:
    """The paths of every nn.Linear except the output head (the transformers model's
    `get_output_embeddings()` when it has one, else the last nn.Linear registered)."""
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    head = _output_head(model, _transformers_model(model), linears)
    return tuple(name for name in linears if name != head)


def _transformers_model(model: nn.Module) -> nn.Module | None:
    """The outermost module with a transformers config (`hf:` models sit inside tracer's loss wrapper)."""
    return next((m for m in model.modules() if hasattr(getattr(m, "config", None), "model_type")), None)


def _output_head(model: nn.Module, hf: nn.Module | None, linears: list[str]) -> str | None:
    get_head = getattr(hf, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    if isinstance(head, nn.Module):
        return next((name for name, m in model.named_modules() if m is head), None)
    return linears[-1] if linears else None


def _matching(model: nn.Module, names: tuple[str, ...]) -> tuple[str, ...]:
    """The module paths that `names` match (peft's rule: the path, or a path ending in `.name`)."""
    matched = tuple(path for path, _ in model.named_modules()
                    if path and any(path == name or path.endswith("." + name) for name in names))
    if not matched:
        linears = [path for path, m in model.named_modules() if isinstance(m, nn.Linear)]
        shown = ", ".join(linears[:12]) + (" ..." if len(linears) > 12 else "")
        raise UsageError(f"--lora-targets {','.join(names)}: no module of {type(model).__name__} is named so",
                         hint=f"its linear layers: {shown or 'none'}")
    return matched
