"""Leave the process as it was found: `process_state_kept()` restores every piece of global torch and Python
state that a capture, or the user's code it runs, may change.

tracer runs inside other people's processes (the pytest marker in a user's test session, `tracer.analyze`
in a notebook). Building a model draws from the global RNG (parameter init), a model file may call
`torch.manual_seed`, `torch.set_default_dtype` or set an Inductor flag at import, and capture paths flip
torch's config modules. After `process_state_kept()` the process holds again:

- the CPU generator's state (`torch.get_rng_state`), Python's `random` state and, when NumPy is imported,
  NumPy's global `RandomState`;
- the default dtype and default device, grad mode, anomaly mode, deterministic-algorithms mode (with its
  warn-only flag), the intra-op thread count, `float32_matmul_precision` and the cuDNN/TF32 flags;
- every entry of every torch config module (`torch._inductor.config`, `torch._functorch.config`, ...,
  found as `ConfigModule`s among the imported modules): its value and whether it is visible. An entry that
  was deleted (torch hides it) is set back, which makes it visible again.

Not restored: config modules first imported during the block (they are at their defaults unless the code
inside set them, and torch reads them only when it compiles); inference mode and the inter-op thread
count (torch offers no way to set them back once used); CUDA generators (there is no GPU here).
"""
from __future__ import annotations

import contextlib
import random
import sys
from typing import Any, Iterator

import torch
from torch.utils._config_module import ConfigModule


def config_modules() -> dict[str, ConfigModule]:
    """Every torch config module imported so far, by module name."""
    return {name: module for name, module in list(sys.modules.items()) if isinstance(module, ConfigModule)}


def config_state(module: ConfigModule) -> dict[str, tuple[bool, Any]]:
    """Each entry of `module`: (hidden, value). A hidden entry (deleted, as `delattr` or pytest's
    monkeypatch undo does) raises AttributeError when read, which breaks every later compile."""
    values = module.get_config_copy()
    return {name: (entry.hide, values.get(name)) for name, entry in module._config.items()}


def changed_config_entries(before: dict[str, dict[str, tuple[bool, Any]]]) -> list[str]:
    """'module.entry' for each config entry that differs from `before` (a `torch_config_states()`)."""
    changed = []
    modules = config_modules()
    for module_name, entries in before.items():
        now = config_state(modules[module_name]) if module_name in modules else {}
        changed += [f"{module_name}.{name}" + (" (deleted)" if now.get(name, (True,))[0] else "")
                    for name, state in entries.items() if now.get(name) != state]
    return changed


def torch_config_states() -> dict[str, dict[str, tuple[bool, Any]]]:
    return {name: config_state(module) for name, module in config_modules().items()}


def restore_config_states(before: dict[str, dict[str, tuple[bool, Any]]]) -> None:
    modules = config_modules()
    for module_name, entries in before.items():
        module = modules.get(module_name)
        if module is None:
            continue
        now = config_state(module)
        for name, (hidden, value) in entries.items():
            if now.get(name) == (hidden, value):
                continue
            if hidden:
                delattr(module, name)
            else:
                setattr(module, name, value)


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Run the block, then put every piece of global state listed in the module docstring back."""
    numpy = sys.modules.get("numpy")
    rng = torch.get_rng_state()
    python_random = random.getstate()
    numpy_random = numpy.random.get_state() if numpy is not None else None
    default_dtype = torch.get_default_dtype()
    default_device = torch.get_default_device()
    grad_enabled = torch.is_grad_enabled()
    anomaly = torch.is_anomaly_enabled(), torch.is_anomaly_check_nan_enabled()
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    threads = torch.get_num_threads()
    matmul_precision = torch.get_float32_matmul_precision()
    backend_flags = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
                     torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32)
    configs = torch_config_states()
    try:
        yield
    finally:
        torch.set_rng_state(rng)
        random.setstate(python_random)
        if numpy_random is not None:
            numpy.random.set_state(numpy_random)
        torch.set_default_dtype(default_dtype)
        torch.set_default_device(None if default_device == torch.device("cpu") else default_device)
        torch.set_grad_enabled(grad_enabled)
        torch.set_anomaly_enabled(*anomaly)
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        torch.set_float32_matmul_precision(matmul_precision)
        (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic,
         torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32) = backend_flags
        restore_config_states(configs)
