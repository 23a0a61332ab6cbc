"""`--fp8 RECIPE`: FP8 training as torchao's float8 recipes run it, put on the model where it is built, as
a training script does with `torchao.float8.convert_to_float8_training`.

`float8_source(source, recipe)` returns the `ModelSource` whose `build_model()` builds the user's model and
converts every nn.Linear except the output head whose in and out features are multiples of 16 (what the
float8 matmul needs; torchtitan filters the same way) to torchao's `Float8Linear` with
`Float8LinearConfig.from_recipe_name(recipe)`: tensorwise (one scale per tensor, dynamic), rowwise (one per
row, bf16 recommended), rowwise_with_gw_hp (rowwise, the weight gradient in high precision). The capture
then traces the converted step like any model file that converts itself: the float8 casts are tensor
subclasses whose inner tensors (the float8 data, the scales) the capture sees, what the recipe saves for
backward is what its autograd Function saves, and the Python backward's locals are watched
(python_lifetimes.py).

Measured against real CPU steps of the converted model (tests/accuracy/test_float8_training.py): exact
at the storage level in every phase. At the allocator a CPU without a float8 oneDNN kernel also emulates
torch._scaled_mm with float copies inside the kernel, named in a note and not counted.
Not modelled: torchao's float8 all-gather under FSDP2 (`enable_fsdp_float8_all_gather`), delayed scaling,
MX formats; the conversion of other layer types.
"""
from __future__ import annotations

import dataclasses

from torch import nn

from tracer.capture.lora import linears_except_head
from tracer.capture.model_input import ModelSource
from tracer.choices import FP8_RECIPES
from tracer.errors import UsageError, package_import_error

FLOAT8_MULTIPLE = 16           # in and out features of a converted linear are multiples of this


def float8_source(source: ModelSource, recipe: str) -> ModelSource:
    """`source` whose built model trains its linear layers (but the head) in FP8 with `recipe`."""
    if recipe not in FP8_RECIPES:
        raise UsageError(f"--fp8 {recipe!r} is not valid", hint=f"valid: {', '.join(FP8_RECIPES)}")

    def build_model():
        return convert_for_float8(source.build_model(), recipe)
    return dataclasses.replace(source, build_model=build_model)


def convert_for_float8(model: nn.Module, recipe: str) -> nn.Module:
    """The conversion of the module docstring, on a built model. Raises UsageError when torchao is missing
    or no linear layer qualifies."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError as exc:
        raise package_import_error("--fp8", ("torchao",), exc, install="pip install torchao") from exc
    chosen = {path for path in linears_except_head(model) if _float8_shaped(model.get_submodule(path))}
    if not chosen:
        raise UsageError(f"--fp8 {recipe}: {type(model).__name__} has no nn.Linear besides its head whose features "
                         f"are multiples of {FLOAT8_MULTIPLE}", hint="drop --fp8")
    return convert_to_float8_training(model, config=Float8LinearConfig.from_recipe_name(recipe),
                                      module_filter_fn=lambda module, fqn: fqn in chosen)


def _float8_shaped(linear: nn.Module) -> bool:
    return linear.in_features % FLOAT8_MULTIPLE == 0 and linear.out_features % FLOAT8_MULTIPLE == 0
