"""Capture `optimizer.step()` and `zero_grad()` by running them on fake tensors under a storage tracker.

The optimizer is the user's own object (or a standard one from --optimizer), run for real on fake
parameters and fake gradients, so foreach temporaries, lazily created state (first step) and every
Python-level free are seen as they happen: each aten op is recorded as an op, each new storage gets a
`weakref.finalize` that records the op after which it was released. Steady state runs one untracked
warm-up step first, so the state exists before the recorded step. The step is recorded once per capture
(`record_optimizer_step`) and spliced into each policy's step graph (`splice_optimizer_step`): it does
not depend on how the forward and backward were scheduled.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

import torch

from tracer.capture.convert import OpDraft
from tracer.capture.compiled_calls import CompiledCalls, compiled_calls_planned
from tracer.capture.optimizer_wrappers import unwrapped_host_offload, wrapper_modules_imported
from tracer.capture.recorder import StepRecorder, distinct_fake_data_pointers
from tracer.capture.splice import copy_storages, relocated_ops
from tracer.capture.storages import StorageTable, memory_parts
from tracer.errors import ModelRunError, UsageError


class NotAnOptimizer(Exception):
    """make_optimizer returned something without step(); the argument is what it returned."""
from tracer.stepgraph import StorageRole

from tracer.choices import OPTIMIZERS  # noqa: E402 - the names, without torch, for the CLI


def make_standard_optimizer(name: str, params, *, foreach: bool | None,
                            kernels_run: bool = False) -> torch.optim.Optimizer | None:
    """The optimizer of `--optimizer name`. `sgd` keeps its old meaning (momentum 0.9, = sgd-momentum);
    adafactor-hf is transformers' Adafactor as its docs advise for fine-tuning (scale_parameter=False,
    relative_step=False, lr=1e-3: the relative step reads a tensor's value, which fake tensors lack);
    adamw8bit and paged-adamw8bit are bitsandbytes' AdamW8bit and PagedAdamW8bit: the classes themselves
    when their kernels run here (`kernels_run`, a CPU target) and bitsandbytes is installed, else simulated
    by their state layout (bnb8bit.py; the CUDA kernels allocate nothing)."""
    if name == "adamw":
        return torch.optim.AdamW(params, lr=1e-3, foreach=foreach)
    if name == "adam":
        return torch.optim.Adam(params, lr=1e-3, foreach=foreach)
    if name in ("sgd", "sgd-momentum"):
        return torch.optim.SGD(params, lr=1e-2, momentum=0.9, foreach=foreach)
    if name == "sgd-plain":
        return torch.optim.SGD(params, lr=1e-2, foreach=foreach)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=1e-2, foreach=foreach)
    if name == "adafactor-hf":
        from transformers.optimization import Adafactor
        return Adafactor(params, lr=1e-3, scale_parameter=False, relative_step=False, warmup_init=False)
    if name == "lion":
        from tracer.capture.lion import Lion
        return Lion(params, lr=1e-4)
    if name in ("adamw8bit", "paged-adamw8bit"):
        from tracer.capture.bnb8bit import STANDARD, SimulatedBnbOptimizer, installed_class
        real = installed_class(name) if kernels_run else None
        return real(params, lr=1e-3) if real is not None else SimulatedBnbOptimizer(
            params, STANDARD[name], label=name, cpu_kernels_missing=kernels_run)
    if name == "none":
        return None
    raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)}")


class OptimizerChain:
    """Several optimizers stepped in order as one: `make_optimizer` returning a list or tuple of them (Muon
    for the hidden matrices and AdamW for the rest, as the modded-nanogpt speedrun writes it). The loop
    calls each one's step() in order, then each one's zero_grad()."""

    def __init__(self, optimizers):
        self.optimizers = tuple(optimizers)

    @property
    def state(self) -> dict:
        return {param: state for opt in self.optimizers for param, state in opt.state.items()}

    @property
    def param_groups(self) -> list:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def notes(self) -> tuple[str, ...]:
        return tuple(note for opt in self.optimizers for note in optimizer_notes(opt))


def as_optimizer(made, *, kernels_run: bool = False):
    """What make_optimizer returned, as one object with step() and zero_grad(): a list or tuple of
    optimizers becomes an `OptimizerChain`; None or anything without step() raises NotAnOptimizer.
    `kernels_run`: the target's custom-op kernels are traced (a CPU target), so a bitsandbytes optimizer
    runs as it is; otherwise its state layout is simulated (its fused CUDA kernels allocate nothing)."""
    def prepared(opt):
        return opt if kernels_run else simulated_if_bitsandbytes(opt)
    if isinstance(made, (list, tuple)) and made and all(callable(getattr(o, "step", None)) for o in made):
        return OptimizerChain(prepared(o) for o in made)
    if made is None or not callable(getattr(made, "step", None)):
        raise NotAnOptimizer(made)
    return prepared(made)


def optimizer_notes(opt) -> tuple[str, ...]:
    """What the report must say about how `opt` is simulated (bitsandbytes' state layout, paging)."""
    notes = getattr(opt, "notes", None)
    return tuple(notes()) if callable(notes) else ()


def simulated_if_bitsandbytes(opt):
    """A user's bitsandbytes optimizer (recognised by its class's module) is replaced by its simulation:
    its CUDA kernels cannot run on fake CPU tensors."""
    from tracer.capture.bnb8bit import is_bitsandbytes_optimizer, simulate_bitsandbytes
    return simulate_bitsandbytes(opt) if is_bitsandbytes_optimizer(opt) else opt


@dataclasses.dataclass
class OptimizerRecording:
    """step() + zero_grad() recorded once, over a table of its own: op indices from 0; the parameters'
    and gradients' entries stand for the storages a step graph gives them (`splice_optimizer_step`)."""
    ops: list[OpDraft]
    table: StorageTable
    grad_sids: dict[int, int]                  # id(parameter) -> the entry of its gradient in `table`
    notes: tuple[str, ...] = ()                # how the optimizer is simulated, for the report
    host_offload: object = None                # optimizer_wrappers.HostOffload: a wrapper moved it to the host
    device_state_names: frozenset[str] = frozenset()   # with host_offload: state the device keeps


def record_optimizer_step(model: torch.nn.Module, params_with_grad: set[int], fake_mode, *,
                          make_optimizer: Callable | None, optimizer_name: str, foreach: bool | None, steady: bool,
                          set_to_none: bool, target: str = "cpu", grad_scaler=None) -> OptimizerRecording:
    """Run step() + zero_grad() under the recorder, for the parameters whose ids are `params_with_grad`.
    `target` "cuda[:gpu]": an optimizer built without foreach=/fused= takes CUDA's default (foreach).
    `grad_scaler`: a torch.amp.GradScaler (fp16): unscale_, step and update run as `scaler.step` runs them
    when no gradient overflowed; its scale and growth tracker exist before the step."""
    from tracer.capture.target import cuda_optimizer_defaults, parse_target
    parsed = parse_target(target)
    with cuda_optimizer_defaults(parsed):
        return _record_optimizer_step(model, params_with_grad, fake_mode, make_optimizer=make_optimizer,
                                      optimizer_name=optimizer_name, foreach=foreach, steady=steady,
                                      set_to_none=set_to_none, grad_scaler=grad_scaler,
                                      kernel_device=None if parsed.is_cuda else "cpu")


def no_gradient_error() -> ModelRunError:
    """A step in which no parameter gets a gradient: the real loss.backward() raises (the loss does not
    require grad), so it is the model's failure, refused for every capture path."""
    return ModelRunError("no parameter gets a gradient in this step (every parameter is frozen, the model has "
                         "none, or the loss is computed under torch.no_grad): a real loss.backward() raises",
                         hint="the step needs a loss that requires grad; unfreeze a parameter or compute the "
                              "loss outside no_grad")


def _needs_a_device(exc: Exception) -> bool:
    """The error says the code wants a GPU (CUDA, XPU) that this CPU build does not have."""
    text = f"{exc}".lower()
    return any(word in text for word in ("cuda", "xpu", "gpu"))


def _differentiates_gradients(exc: Exception) -> bool:
    """autograd's error for differentiating a tensor with no graph: here, a gradient the step computed
    without create_graph=True."""
    return isinstance(exc, RuntimeError) and "does not require grad and does not have a grad_fn" in str(exc)


def not_an_optimizer_error(opt) -> UsageError:
    return UsageError(f"make_optimizer(params) returned {type(opt).__name__}, not an optimizer",
                      hint="return a torch.optim.Optimizer, or a list of them stepped in order; for no "
                           "optimizer, drop make_optimizer and pass --optimizer none")


def _record_optimizer_step(model: torch.nn.Module, params_with_grad: set[int], fake_mode, *,
                           make_optimizer: Callable | None, optimizer_name: str, foreach: bool | None, steady: bool,
                           set_to_none: bool, grad_scaler, kernel_device: str | None) -> OptimizerRecording:
    from tracer.capture.lightning_loop import optimizer_factory
    make_optimizer = optimizer_factory(model, make_optimizer)
    params = [p for p in model.parameters() if id(p) in params_with_grad]
    if not params:
        raise no_gradient_error()
    names = {id(p): fqn for fqn, p in model.named_parameters()}
    # A step may read a tensor's value (`p.norm().item()` in torch's Adafactor, Prodigy's step size): fake
    # tensors have none, so each read is taken as 0 and named in a note with its line. A standard optimizer's
    # reads only scale the update; a user's may also decide a branch or a size, and its note says so.
    reads_as_zero = True
    # torch.compile called while the optimizer is built or stepped (torchao's per-parameter update, a user's
    # compiled step) is planned by Inductor into the recorder that is active (capture/compiled_calls.py)
    active: list = [None]
    compiled = CompiledCalls()
    wrapped: list = []                   # a CUDA target's host-offload wrappers (optimizer_wrappers.py)
    wrappers_before = wrapper_modules_imported()
    try:
        with fake_mode, compiled_calls_planned(lambda: active[0], fake_mode, compiled), distinct_fake_data_pointers(), \
                (unwrapped_host_offload(wrapped, OptimizerChain) if kernel_device is None else contextlib.nullcontext()):
            if make_optimizer is not None:
                opt = as_optimizer(make_optimizer(model.parameters()), kernels_run=kernel_device is not None)
            else:
                opt = make_standard_optimizer(optimizer_name, model.parameters(), foreach=foreach,
                                              kernels_run=kernel_device is not None)
            _train_mode(opt)
            if grad_scaler is not None:
                grad_scaler._lazy_init_scale_growth_tracker(torch.device("cpu"))   # made by the first scale()
            if steady and opt is not None:
                with StepRecorder(StorageTable(), 0, read_scalars_as_zero=reads_as_zero,
                                  kernel_device=kernel_device) as active[0]:
                    set_fake_grads(params)
                    _optimizer_step(opt, grad_scaler)
                    opt.zero_grad(set_to_none=True)
                active[0] = None
    except NotAnOptimizer as exc:
        raise not_an_optimizer_error(exc.args[0]) from None
    except UsageError:
        raise
    except Exception as exc:
        active[0] = None
        if kernel_device is None and make_optimizer is not None and wrapper_modules_imported() - wrappers_before:
            # make_optimizer imported a wrapper's module itself: built again, the wrapper is unwrapped
            return _record_optimizer_step(model, params_with_grad, fake_mode, make_optimizer=make_optimizer,
                                          optimizer_name=optimizer_name, foreach=foreach, steady=steady,
                                          set_to_none=set_to_none, grad_scaler=grad_scaler, kernel_device=kernel_device)
        if _needs_a_device(exc):
            raise ModelRunError(f"building or stepping the optimizer raised {type(exc).__name__}: {exc}",
                                hint="the capture runs on the CPU whatever the target, so code that needs a "
                                     "CUDA device cannot run in it: return the optimizer it wraps from "
                                     "make_optimizer and give the matching option (torchao's CPUOffloadOptimizer "
                                     "is modelled for a CUDA target as --offload optimizer)") from exc
        if _differentiates_gradients(exc):
            raise ModelRunError(f"stepping the optimizer raised {type(exc).__name__}: {exc}: it differentiates "
                                "the gradients (a second-order step such as SophiaH or AdaHessian)",
                                hint="its loop calls loss.backward(create_graph=True): say so with "
                                     "create_graph = True in the model file") from exc
        raise ModelRunError(f"building or stepping the optimizer raised {type(exc).__name__}: {exc}",
                            hint="make_optimizer(params) and its step() run on fake tensors (no values); "
                                 "fix what the error names") from exc
    table = StorageTable()
    recorder = StepRecorder(table, 0, read_scalars_as_zero=reads_as_zero, kernel_device=kernel_device)
    for fqn, p in model.named_parameters():
        for part in memory_parts(p):              # a DTensor parameter's memory is its local shard
            if part not in table:
                recorder.add_existing(part, StorageRole.PARAMETER, name=fqn)
    if grad_scaler is not None:
        for tensor, name in ((grad_scaler._scale, "GradScaler scale"), (grad_scaler._growth_tracker,
                                                                        "GradScaler growth tracker")):
            recorder.add_existing(tensor, StorageRole.OPTIMIZER_STATE, name=name)
    for tensor, name in optimizer_held_tensors(opt, names):
        if tensor not in table:
            # an optimizer that replaces a state tensor (state["m"] = new_m) frees the old one in the step
            recorder.add_existing(tensor, StorageRole.OPTIMIZER_STATE, name=name)
    tensor = None
    grad_sids = {}
    g = None
    with fake_mode:
        for p, g in zip(params, set_fake_grads(params)):
            part = memory_parts(g)[0]             # a DTensor gradient's memory is its local shard
            grad_sids[id(p)] = table.add(part, StorageRole.GRADIENT)
            recorder.track_release(part, grad_sids[id(p)])
        del g, part
    active[0] = recorder
    try:
        with fake_mode, recorder, compiled_calls_planned(lambda: active[0], fake_mode, compiled), \
                distinct_fake_data_pointers():
            if opt is not None:
                _optimizer_step(opt, grad_scaler)
                opt.zero_grad(set_to_none=set_to_none)
            else:
                model.zero_grad(set_to_none=set_to_none)
        active[0] = None
        recorder.stop_tracking()            # whatever is still held after the step outlives it
    except Exception as exc:
        active[0] = None
        raise ModelRunError(f"optimizer.step() raised {type(exc).__name__}: {exc}",
                            hint="the optimizer runs on fake tensors; avoid .item()/.tolist() on its state") from exc
    for tensor, name in optimizer_held_tensors(opt, names):
        sid = table.lookup(tensor)
        if table.get(sid).role is StorageRole.INTERMEDIATE:
            table.update(sid, role=StorageRole.OPTIMIZER_STATE, persistent=True, name=name)
    for sid in recorder.created:
        if table.get(sid).released_after_op is None:
            table.update(sid, persistent=True)        # still referenced after the step (e.g. kept by the optimizer)
    effect = ("it scales the update and sizes no tensor" if make_optimizer is None else
              "if it decides a branch or a tensor's size in step(), the step's memory may differ there")
    label = optimizer_name if make_optimizer is None else f"{type(opt).__name__}"
    reads = [f"{label}.step() reads a tensor's value at {loc.short() if loc else 'an unknown line'}: taken as 0 "
             f"({effect})" for loc in dict.fromkeys(recorder.scalar_reads)]
    traced = (f"custom-op kernels the step runs on the {kernel_device}, traced through their Python code: "
              + ", ".join(recorder.traced_kernels),) if recorder.traced_kernels else ()
    host = wrapped[0] if wrapped else None
    device_state = frozenset(name for _, name in optimizer_held_tensors(opt, names)
                             if host is not None and not any(name.startswith(f"{names[id(p)]}.") for p in params
                                                             if id(p) in host.host_parameter_ids))
    return OptimizerRecording(ops=recorder.ops, table=table, grad_sids=grad_sids,
                              host_offload=host, device_state_names=device_state,
                              notes=optimizer_notes(opt) + tuple(reads) + traced + compiled.notes(
                                  "C++" if kernel_device == "cpu" else "C++ (a CUDA run fuses these kernels with Triton's "
                                  "rules, not planned for the optimizer step)"))


def splice_optimizer_step(recording: OptimizerRecording, model: torch.nn.Module, grad_sid_by_param: dict[int, int],
                          table: StorageTable, *, ops_offset: int) -> list[OpDraft]:
    """The recorded optimizer ops over `table`, after the step graph's `ops_offset` ops: parameters and
    gradients become the graph's own storages (a gradient freed by zero_grad is freed there), every other
    storage (state, temporaries) is copied in."""
    if set(grad_sid_by_param) != set(recording.grad_sids):
        raise ModelRunError("the optimizer was recorded for another set of parameters with gradients")
    sid_map = {}
    for param in model.parameters():
        for part in memory_parts(param):
            if part in recording.table and part in table:
                sid_map[recording.table.lookup(part)] = table.lookup(part)
    for param_id, grad_sid in recording.grad_sids.items():
        sid_map[grad_sid] = grad_sid_by_param[param_id]
        released = recording.table.get(grad_sid).released_after_op
        if released is not None:
            table.update(grad_sid_by_param[param_id], released_after_op=released + ops_offset)
    copy_storages(recording.table, table, sid_map, ops_offset=ops_offset)
    return relocated_ops(recording.ops, sid_map, ops_offset=ops_offset)


def _train_mode(opt) -> None:
    """An optimizer with train and eval modes (schedule-free optimizers: `opt.train()` before training,
    `opt.eval()` before evaluating, which swaps the parameters' values) is stepped in train mode, as the
    training loop puts it there."""
    for each in getattr(opt, "optimizers", (opt,)):
        if callable(getattr(each, "train", None)) and callable(getattr(each, "eval", None)):
            each.train()


def _optimizer_step(opt, grad_scaler) -> None:
    """opt.step(), or with a GradScaler what `scaler.step(opt); scaler.update()` runs when no gradient is
    inf or NaN (scaler.step's `.item()` check cannot run on fake tensors and allocates nothing)."""
    if grad_scaler is None:
        opt.step()
        return
    for each in getattr(opt, "optimizers", (opt,)):
        grad_scaler.unscale_(each)
    opt.step()
    grad_scaler.update()


def set_fake_grads(params) -> list[torch.Tensor]:
    """A gradient of each parameter's shape and dtype (values unset: made under a fake mode, none exist)."""
    grads = [torch.empty_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    return grads


def optimizer_held_tensors(opt, names: dict[int, str] | None = None) -> list[tuple[torch.Tensor, str]]:
    """(tensor, name) for every tensor the optimizer holds, each once: its per-parameter state, also inside
    nested lists, tuples and dicts (SOAP's and Shampoo's preconditioners: "<param fqn>.GG[0]"); tensors in
    its param groups other than the parameters (a learning rate kept as a tensor: "param_groups[0].lr");
    tensors held on the optimizer object itself (a quantization code map: "<attribute>"); and the inner
    tensors of a tensor subclass (`__tensor_flatten__`: a quantized moment's codes and scales). The
    parameters themselves and their gradients are not state. `names`: parameter id -> its fqn. The one
    reader of an optimizer's state, for the capture and for the tests' measured steps alike."""
    if opt is None:
        return []
    if isinstance(opt, OptimizerChain):
        found = {}
        for each in opt.optimizers:
            for tensor, name in optimizer_held_tensors(each, names):
                found.setdefault(id(tensor), (tensor, name))
        return list(found.values())
    names = names or {}
    params = {id(p) for group in getattr(opt, "param_groups", ()) for p in group.get("params", ())}
    found: dict[int, tuple[torch.Tensor, str]] = {}
    seen: set[int] = set()
    for param, state in getattr(opt, "state", {}).items():
        _walk_state(state, names.get(id(param), "?"), 0, params, found, seen)
    for i, group in enumerate(getattr(opt, "param_groups", ())):
        _walk_state({key: value for key, value in group.items() if key != "params"}, f"param_groups[{i}]", 0,
                    params, found, seen)
    for attribute, value in vars(opt).items():
        if attribute not in ("state", "param_groups"):
            _walk_state(value, attribute, 0, params, found, seen)
    return list(found.values())


_MAX_STATE_DEPTH = 16       # containers nested deeper than any optimizer keeps are not read


def _walk_state(value, name: str, depth: int, params: set[int], found: dict, seen: set[int]) -> None:
    """`optimizer_held_tensors`' walk, a module-level function: a nested one that calls itself is a reference
    cycle (the function, its cell) holding what it found until a garbage collection, and a state tensor the
    step replaces (state["m"] = new_m) would then outlive its replacement by as long as the collector waits,
    where a real step frees it at once."""
    if depth > _MAX_STATE_DEPTH or id(value) in seen:
        return
    if isinstance(value, torch.Tensor):
        if id(value) in params:
            return
        inner = _inner_tensors(value)
        if inner is None:
            found.setdefault(id(value), (value, name))
        for attribute, tensor in inner or ():
            _walk_state(tensor, f"{name}.{attribute}", depth + 1, params, found, seen)
        return
    if isinstance(value, (list, tuple, dict)):
        seen.add(id(value))
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            _walk_state(item, f"{name}.{key}" if isinstance(value, dict) else f"{name}[{key}]", depth + 1,
                        params, found, seen)


def _inner_tensors(tensor: torch.Tensor) -> list[tuple[str, torch.Tensor]] | None:
    """A traceable tensor subclass's inner tensors (its `__tensor_flatten__` attributes), or None for a
    plain tensor (a fake tensor is one: it holds its own storage)."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not is_traceable_wrapper_subclass(tensor):
        return None
    attributes, _ = tensor.__tensor_flatten__()
    return [(attribute, getattr(tensor, attribute)) for attribute in attributes]
