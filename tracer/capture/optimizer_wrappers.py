"""Optimizer wrappers that are a lever: a library class that moves an optimizer to the host is built as the
optimizer it wraps, and the step is then predicted as `--offload optimizer` predicts it (offload.py).

The registry `HOST_OFFLOAD_WRAPPERS` names each such class ("module:Class") with a function that takes the
arguments the model file passed and returns (the optimizers to step, what is offloaded). While
`make_optimizer` runs for a CUDA target, each registered class whose module is imported builds that instead
of itself (`wrapper_modules_imported` tells the caller to build again when make_optimizer imported one) (the instance becomes an OptimizerChain of the unwrapped optimizers; its own `__init__`, which needs a
device, never runs). For a CPU target nothing is replaced: the real class refuses to run without a GPU, and so does the
capture (optimizer.py's hint names this lever).

torchao's `CPUOffloadOptimizer(params, optimizer_class=AdamW, *, offload_gradients=False, minimal_size=4096,
**kwargs)`: parameters with at least `minimal_size` elements get one `optimizer_class` each over a pinned host
copy (with a pinned host gradient buffer), stepped on the host; smaller ones share one `optimizer_class` on the
device, stepped first. A CPU `AdamW` defaults to `fused=True`. `offload_gradients=True` frees each device
gradient once it is copied to the host; otherwise the device keeps it until `zero_grad`.
Not modelled: the copy stream's overlap (copies take no device memory in the timeline).
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
from typing import Callable

import torch


@dataclasses.dataclass(frozen=True)
class HostOffload:
    """What a wrapper moves to the host: the optimizers over these parameters step there."""
    wrapper: str                                # "module:Class", for the report
    host_parameter_ids: frozenset[int]          # id() of each parameter stepped on the host
    free_device_gradients: bool                 # the device gradient is freed once copied to the host


def _torchao_cpu_offload(params, optimizer_class=torch.optim.AdamW, *, offload_gradients: bool = False,
                         minimal_size: int = 4096, **kwargs):
    if optimizer_class is torch.optim.AdamW and "fused" not in kwargs:
        kwargs["fused"] = True                  # the wrapper's default: fused CPU AdamW
    groups = list(params)
    if groups and not isinstance(groups[0], dict):
        groups = [{"params": groups}]
    device_groups, host_groups, host_ids = [], [], set()
    for group in groups:
        options = {k: v for k, v in group.items() if k != "params"}
        trainable = [p for p in group["params"] if p.requires_grad]
        small = [p for p in trainable if p.numel() < minimal_size]
        large = [p for p in trainable if p.numel() >= minimal_size]
        if small:
            device_groups.append({"params": small, **options})
        host_groups += [{"params": [p], **options} for p in large]
        host_ids.update(id(p) for p in large)
    optimizers = ([optimizer_class(device_groups, **kwargs)] if device_groups else []) + \
                 [optimizer_class([group], **kwargs) for group in host_groups]
    return optimizers, (frozenset(host_ids), offload_gradients)


HOST_OFFLOAD_WRAPPERS: dict[str, Callable] = {
    "torchao.optim.cpu_offload:CPUOffloadOptimizer": _torchao_cpu_offload,
}


@contextlib.contextmanager
def unwrapped_host_offload(found: list[HostOffload], chain: type):
    """While active, each registered wrapper class builds the optimizers it wraps and appends what it
    offloads to `found`: its `__init__` is replaced, and the instance becomes a `chain` of them (optimizer.py's
    OptimizerChain; the wrapper's own `__init__`, which needs a device, never runs)."""
    patched = []
    for name, unwrap in HOST_OFFLOAD_WRAPPERS.items():
        module_name, _, class_name = name.partition(":")
        cls = getattr(sys.modules.get(module_name), class_name, None)   # imported by the model file, or not used
        if cls is None:
            continue

        def init(self, *args, _unwrap=unwrap, _name=name, **kwargs):
            optimizers, (host_ids, free_gradients) = _unwrap(*args, **kwargs)
            found.append(HostOffload(_name, host_ids, free_gradients))
            self.__class__ = chain
            self.__dict__.update(vars(chain(optimizers)))

        patched.append((cls, cls.__dict__.get("__init__")))
        cls.__init__ = init
    try:
        yield found
    finally:
        for cls, original in patched:
            if original is None:
                del cls.__init__
            else:
                cls.__init__ = original


def wrapper_modules_imported() -> frozenset[str]:
    """The registered wrappers' modules imported in this process (make_optimizer may import one itself)."""
    return frozenset(name.partition(":")[0] for name in HOST_OFFLOAD_WRAPPERS
                     if name.partition(":")[0] in sys.modules)
