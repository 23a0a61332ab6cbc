"""The built-in model zoo (import it as `tracer.models`, which loads this module on first use): reference models addressed by name (`llama-88m`, `gpt2-124m`, `gpt3-layer`, ...).

Every name has a tiny `-debug` flavour (`llama-88m-debug`, `gpt2-124m-debug`, ...) with the same code
path and a few-thousand-parameter config, for tests. `zoo_entry(name)` returns a `ZooEntry` with
`build_model()` and `example_batch(batch, seq)`; an unknown name raises `KeyError` listing the valid ones.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tracer.models import gpt2, gpt3_layer, llama


@dataclasses.dataclass(frozen=True)
class ZooEntry:
    name: str
    description: str
    build_model: Callable[[], object]
    example_batch: Callable[[int, int], tuple]


def _family(prefix: str, module, model_cls, sizes: dict[str, object]) -> dict[str, ZooEntry]:
    entries = {}
    debug_cfg = sizes["debug"]
    for size, cfg in sizes.items():
        if size == "debug":
            continue
        name = f"{prefix}-{size}" if prefix != "gpt3-layer" or size != "175b" else prefix
        for full_name, c in ((name, cfg), (f"{name}-debug", debug_cfg)):
            entries[full_name] = ZooEntry(
                name=full_name,
                description=f"{model_cls.__name__} {c}",
                build_model=lambda c=c: model_cls(c),
                example_batch=lambda batch, seq, c=c: module.example_batch(c, batch, seq),
            )
    entries[f"{prefix}-debug"] = entries[f"{name}-debug"]
    return entries


ZOO: dict[str, ZooEntry] = {
    **_family("llama", llama, llama.Llama, llama.LLAMA_SIZES),
    **_family("gpt2", gpt2, gpt2.GPT2, gpt2.GPT2_SIZES),
    **_family("gpt3-layer", gpt3_layer, gpt3_layer.GPT3Layer,
              gpt3_layer.GPT3_LAYER_SIZES),
}

from tracer.models import DEFAULT_MODEL  # noqa: E402,F401 - defined without torch


def zoo_entry(name: str) -> ZooEntry:
    try:
        return ZOO[name]
    except KeyError:
        raise KeyError(f"unknown model name {name!r}; valid names: {', '.join(sorted(ZOO))}") from None
