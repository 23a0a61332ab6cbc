"""`--base 4bit|8bit`: the model's linear layers as a quantized, frozen base (QLoRA; LLM.int8), put there where
the model is built, as a fine-tuning script does it with bitsandbytes and peft.

`quantized_base_source(source, base, precision)` returns the `ModelSource` whose `build_model()` builds the
user's model, then:
  1. replaces every `nn.Linear` except the output head (lora.py's `linears_except_head`; transformers'
     `BitsAndBytesConfig` skips the head the same way) and nn.MultiheadAttention's output projection (its
     parent reads the weight itself), and every transformers `Conv1D` (GPT-2's attention
     and MLP projections, whose weight is stored (in, out)), by bitsandbytes' layer of the same in and out
     features and bias, as transformers' `replace_with_bnb_linear` does:
       * `4bit`: `Linear4bit(quant_type="nf4", compress_statistics=True)`, the QLoRA paper's NF4 with double
         quantization (`BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
         bnb_4bit_use_double_quant=True)`), computing in the step's dtype (bf16 under bf16 autocast or
         bf16-pure, fp16 under fp16, else fp32: `bnb_4bit_compute_dtype`);
       * `8bit`: `Linear8bitLt(has_fp16_weights=False)` (`load_in_8bit=True`);
  2. moves the model to the device, which is where bitsandbytes quantizes each weight: half a byte per
     4-bit weight (one byte per 8-bit one) plus its quantization state (per 64 weights one uint8 absmax,
     per 256 of those one fp32 scale, the code maps; LLM.int8: one fp32 scale per row);
  3. runs peft's `prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)`: every
     parameter frozen, every fp16/bf16 parameter that is not quantized (embeddings, norms, the head) cast to
     fp32.
The capture (capture/__init__.py) then adds LoRA adapters (`--lora`, rank 8 when not given) and runs the step
op by op (dispatch.py): bitsandbytes' layers are traced through their CPU kernels, and their memory is
exact against real CPU steps (tests/accuracy/test_quantized_base.py). The layers' new weights are
bitsandbytes' own initialisation: a quantized base's memory does not depend on the values.
Not modelled: other quantizers (GPTQ, AWQ, HQQ, torchao's int4), layers other than nn.Linear and transformers'
Conv1D (refused when there is none but the head), `llm_int8_skip_modules` beyond the head,
and CUDA's fused 4-bit kernel for calls of at most 1,536 tokens (it allocates only the output; the CPU kernel
traced here dequantizes the weight, as CUDA does above that size).
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

from tracer.capture.lora import linears_except_head
from tracer.capture.model_input import ModelSource
from tracer.choices import QUANTIZED_BASES
from tracer.errors import UsageError, package_import_error

QLORA_RANK = 8                 # LoRA adapters' rank when --base is given without --lora


def quantized_base_source(source: ModelSource, base: str, precision: str) -> ModelSource:
    """`source` whose built model has its linear layers (but the head) quantized as `base`."""
    if base not in QUANTIZED_BASES:
        raise UsageError(f"--base {base!r} is not valid", hint=f"valid: {', '.join(QUANTIZED_BASES)}")

    def build_model():
        return quantize_base(source.build_model(), base, compute_dtype(precision))
    return dataclasses.replace(source, build_model=build_model)


def compute_dtype(precision: str) -> torch.dtype:
    """The 4-bit layers' compute dtype for the step's precision."""
    if precision.startswith("bf16"):
        return torch.bfloat16
    return torch.float16 if precision.startswith("fp16") else torch.float32


def quantize_base(model: nn.Module, base: str, compute: torch.dtype) -> nn.Module:
    """Steps 1-3 of the module docstring on a built model. Raises UsageError when bitsandbytes or peft is
    missing, or the model has no linear layer to quantize."""
    try:
        import bitsandbytes as bnb
        from peft import prepare_model_for_kbit_training
    except ImportError as exc:
        raise package_import_error("--base", ("bitsandbytes", "peft"), exc,
                                   install="pip install bitsandbytes peft") from exc
    paths = tuple(path for path in linears_except_head(model)
                  if not isinstance(model.get_submodule(path), _READ_BY_PARENT)) + _conv1d_paths(model)
    if not paths:
        raise UsageError(f"--base {base}: {type(model).__name__} has no nn.Linear besides its head to quantize",
                         hint="nn.Linear layers and transformers' Conv1D are quantized here; other layers are not")
    for path in paths:
        parent_path, _, name = path.rpartition(".")
        parent = model.get_submodule(parent_path) if parent_path else model
        linear = getattr(parent, name)
        features_in, features_out = _features(linear)
        if base == "4bit":
            layer = bnb.nn.Linear4bit(features_in, features_out, bias=linear.bias is not None,
                                      compute_dtype=compute, quant_type="nf4", compress_statistics=True)
        else:
            layer = bnb.nn.Linear8bitLt(features_in, features_out, bias=linear.bias is not None,
                                        has_fp16_weights=False)
        setattr(parent, name, layer)
    model = model.to("cpu")                 # bitsandbytes quantizes each weight as it moves to the device
    return prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)


# linears whose parent reads their weight itself, which a quantized layer's packed weight cannot serve:
# nn.MultiheadAttention hands `out_proj.weight` to F.multi_head_attention_forward (torch marks that layer
# NonDynamicallyQuantizableLinear so that quantization passes leave it alone)
_READ_BY_PARENT = (nn.modules.linear.NonDynamicallyQuantizableLinear,)


def _conv1d_paths(model: nn.Module) -> tuple[str, ...]:
    """The paths of transformers' `Conv1D` layers (GPT-2 style), which transformers quantizes as linears."""
    conv1d = _transformers_conv1d()
    return () if conv1d is None else tuple(name for name, m in model.named_modules() if isinstance(m, conv1d))


def _transformers_conv1d():
    try:
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        return None
    return Conv1D


def _features(layer: nn.Module) -> tuple[int, int]:
    """(in, out) features: an nn.Linear's, or a Conv1D's from its (in, out) weight."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    features_in, features_out = layer.weight.shape
    return features_in, features_out
