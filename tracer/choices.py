"""The name tables behind the command line's choices, importable without torch (one source of truth).

`python -m tracer --help` builds every flag's choices from these tables and from the other torch-free
registries (tracer.policies, tracer.passes.sharding's strategies, tracer.checks.options); the capture
code that implements each name imports its table from here, so a new optimizer, offload mode, precision or
GPU is added once. Nothing here imports torch or anything that does.
"""
from __future__ import annotations

import dataclasses

_GIB = 2**30

OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "sgd-plain", "adafactor", "adafactor-hf", "lion",
              "adamw8bit", "paged-adamw8bit", "none")          # tracer.capture.optimizer builds each
OFFLOAD_MODES = ("optimizer", "optimizer+params")               # tracer.capture.offload
PRECISIONS = ("fp32", "bf16", "bf16-pure", "fp16")             # tracer.capture.precision
TARGET_DEVICES = ("cpu", "cuda")                                # tracer.capture.target


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    sm: tuple[int, int]               # compute capability (major, minor)
    memory_bytes: int
    description: str
    sm_count: int                     # streaming multiprocessors (Inductor sizes split reductions by it)


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("v100", (7, 0), 32 * _GIB, "Volta V100 32GB", 80),
    GpuSpec("t4", (7, 5), 16 * _GIB, "Turing T4 16GB", 40),
    GpuSpec("a100", (8, 0), 80 * _GIB, "Ampere A100 80GB", 108),
    GpuSpec("a10g", (8, 6), 24 * _GIB, "Ampere A10G 24GB", 80),
    GpuSpec("l4", (8, 9), 24 * _GIB, "Ada L4 24GB", 58),
    GpuSpec("h100", (9, 0), 80 * _GIB, "Hopper H100 80GB", 132),
    GpuSpec("h200", (9, 0), 141 * 10**9, "Hopper H200 141GB", 132),
    GpuSpec("b200", (10, 0), 180 * 10**9, "Blackwell B200 180GB", 148),
)}
DEFAULT_GPU = "h100"                 # the GPU a prediction is for unless --gpu names another
DEFAULT_TARGET = "cuda"              # what every command predicts unless --target cpu
