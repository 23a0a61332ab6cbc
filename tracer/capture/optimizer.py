"""Capture `optimizer.step()` and `zero_grad()` by running them on fake tensors under a storage tracker.

The optimizer is the user's own object (or a standard one from --optimizer), run for real on fake
parameters and fake gradients, so foreach temporaries, lazily created state (first step) and every
Python-level free are seen as they happen: each aten op is recorded as an op, each new storage gets a
`weakref.finalize` that records the op after which it was released. Steady state runs one untracked
warm-up step first, so the state exists before the recorded step.
"""
from __future__ import annotations

from typing import Callable

import torch

from tracer.capture.convert import OpDraft
from tracer.capture.recorder import StepRecorder
from tracer.capture.storages import StorageTable
from tracer.errors import ModelRunError
from tracer.stepgraph import StorageRole

OPTIMIZERS = ("adamw", "sgd", "none")


def make_standard_optimizer(name: str, params, *, foreach: bool) -> torch.optim.Optimizer | None:
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    if name == "sgd":
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach)
    if name == "none":
        return None
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")


def capture_optimizer_step(model: torch.nn.Module, grad_sid_by_param: dict[int, int], table: StorageTable,
                           fake_mode, *, make_optimizer: Callable | None, optimizer_name: str, foreach: bool,
                           steady: bool, set_to_none: bool, grads_preexisting: bool,
                           ops_offset: int) -> list[OpDraft]:
    """Run step() + zero_grad() under the recorder; returns the optimizer-phase ops (indices from ops_offset)."""
    params = [p for p in model.parameters() if id(p) in grad_sid_by_param]
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    try:
        with fake_mode:
            if make_optimizer is not None:
                opt = make_optimizer(model.parameters())
            else:
                opt = make_standard_optimizer(optimizer_name, model.parameters(), foreach=foreach)
            if steady and opt is not None:
                _set_fake_grads(params)
                opt.step()
                opt.zero_grad(set_to_none=True)
    except Exception as exc:
        raise ModelRunError(f"the optimizer's warm-up step raised {type(exc).__name__}: {exc}",
                            hint="make_optimizer(params) must return a torch.optim.Optimizer") from exc
    recorder = StepRecorder(table, ops_offset)
    for tensor, name in _state_tensors(opt, names):
        if tensor not in table:
            sid = table.add(tensor, StorageRole.OPTIMIZER_STATE, preexisting=True, persistent=True, name=name)
            # an optimizer that replaces a state tensor (state["m"] = new_m) frees the old one in the step
            recorder.track_release(tensor, sid)
    tensor = None
    with fake_mode:
        for p, g in zip(params, _set_fake_grads(params)):
            table.alias(g, grad_sid_by_param[id(p)])
            recorder.track_release(g, grad_sid_by_param[id(p)])
        del g
    try:
        with fake_mode, recorder:
            if opt is not None:
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
            else:
                model.zero_grad(set_to_none=set_to_none)
        recorder.stop_tracking()            # whatever is still held after the step outlives it
    except Exception as exc:
        raise ModelRunError(f"optimizer.step() raised {type(exc).__name__}: {exc}",
                            hint="the optimizer runs on fake tensors; avoid .item()/.tolist() on its state") from exc
    for tensor, name in _state_tensors(opt, names):
        sid = table.lookup(tensor)
        if table.get(sid).role is StorageRole.INTERMEDIATE:
            table.update(sid, role=StorageRole.OPTIMIZER_STATE, persistent=True, name=name)
    for sid in recorder.created:
        if table.get(sid).released_after_op is None:
            table.update(sid, persistent=True)        # still referenced after the step (e.g. kept by the optimizer)
    return recorder.ops


def _set_fake_grads(params) -> list[torch.Tensor]:
    grads = [torch.empty_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    return grads


def _state_tensors(opt, names: dict[int, str]) -> list[tuple[torch.Tensor, str]]:
    """(tensor, "<param fqn>.<state key>") for every tensor in the optimizer's state."""
    if opt is None:
        return []
    out = []
    for param, state in opt.state.items():
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                out.append((value, f"{names.get(id(param), '?')}.{key}"))
    return out
