"""The built-in model zoo: reference models addressed by name (`llama-88m`, `gpt2-124m`, `gpt3-layer`, ...).

`ZOO`, `ZooEntry` and `zoo_entry` live in tracer.models.zoo (which imports torch: the models are nn.Modules)
and are loaded on first use, so `import tracer.models` (the CLI's --help, `DEFAULT_MODEL`) does not import
torch.
"""
from __future__ import annotations

DEFAULT_MODEL = "llama-88m"
_ZOO_NAMES = ("ZOO", "ZooEntry", "zoo_entry")


def __getattr__(name: str):
    if name in _ZOO_NAMES:
        from tracer.models import zoo
        return getattr(zoo, name)
    raise AttributeError(f"module 'tracer.models' has no attribute {name!r}")
