"""Build the user's model and example batch under fake tensors: nothing real at model size, and no
initialiser that needs a tensor's values.

A fake tensor has metadata (dtype, shape, strides, storage, requires_grad) but no values, and some build
idioms read values: `nn.init.trunc_normal_` (`.item()` and `mask.any()` in torch 2.13), timm's drop-path
schedule (`[x.item() for x in torch.linspace(0, rate, depth)]`), `torch.equal`, `.tolist()`. While the
model is built, `_BuildValues` (a TorchDispatchMode above the fake mode) keeps the real value of every
small tensor whose value is determined: an op with no random tag whose inputs all have known values and
whose outputs have at most `SMALL_NUMEL` elements runs a second time on the real values (the fake result
stays the tensor the model holds: metadata, aliasing and storages come from the fake mode). A value read of
such a tensor is answered exactly. A value read of a tensor whose values the build cannot know (a random
initialiser's output, a tensor too large to compute) is answered with 0 / False (`nonzero`: no element),
and each such read is reported as a note with its user line. Weight values never change memory; a value
that decides a shape or a module's structure would, and the note says where to look.

A tensor held as a plain module attribute since the build is made a non-persistent buffer of its module
(tracing would take it for a constant, which export refuses for a fake tensor); it exists before the step
either way.

A tensor made from a Python list that holds tensors (`torch.tensor([f / s for f in freqs])`, torchtune's
RoPE scaling) reads each one's data, which a fake tensor lacks: each is replaced by its known value (else
0, noted), and the new tensor's value is known in turn (`_TensorsFromKnownValues`).

Two more things a real build does that fake tensors refuse, made to work while the build runs:
- `copy.deepcopy(module)` (`clones()`, `nn.TransformerEncoder`) copies a fake tensor's `fake_mode`
  attribute, giving the copy a mode of its own ("Mixing fake modes NYI" at the first op): the mode is a
  context, not data, so deep copies share it.
- `module.to(...)` (peft's `get_peft_model`, `model.to(torch.bfloat16)`) swaps fake parameters in place
  (`torch.utils.swap_tensors`), which refuses a tensor with a weak reference; the fake mode's own memo of
  recently made fakes holds one. The memo entries of the two tensors are dropped before the swap (the memo
  only matters while the op that made the tensor runs).

Not handled: a value read whose answer changes the model's structure or sizes (`nn.Linear(int(t.item()),
...)` with an unknown `t`) builds the model the note's assumption describes; real tensors made outside
torch's dispatcher (numpy) are used as they are.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import sys
import warnings
from collections.abc import Mapping

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_flatten, tree_leaves, tree_map, tree_unflatten

from tracer.capture.model_input import ModelSource
from tracer.capture.source import WRAPPED_ATTR, exception_location, loc_from_python_stack
from tracer.errors import ModelRunError, TracerError, UsageError

SMALL_NUMEL = 1 << 16                 # outputs up to this many elements are computed for real while building
KNOWN_BYTES_LIMIT = 64 << 20          # real bytes kept for known values, in all; beyond, values are not kept
_UNANSWERED = object()


@dataclasses.dataclass(frozen=True)
class FakeBuild:
    model: nn.Module                  # the user's model, with fake parameters
    batch: tuple                      # fake example batch: forward's positional args, or a dict's values
    batch_keys: tuple[str, ...] | None   # the keyword names when example_batch returned a dict
    notes: tuple[str, ...]            # assumptions the build made (value reads it could not answer)


def build_fake(source: ModelSource, batch: int, seq: int, precision: str, fake_mode, *,
               where=None) -> FakeBuild:
    """Build the user's model and example batch under `fake_mode` (no real memory at model size).
    `where(exc)` names the user line of an exception for the error message."""
    default_dtype = torch.get_default_dtype()
    set_module_caches_aside(fake_mode)
    values = _BuildValues(fake_mode)
    try:
        with fake_mode, values, _TensorsFromKnownValues(values), _deep_copies_share_the_fake_mode(), \
                _swappable_fakes(), _bounded_module_count(source.name), _parameter_subclasses_of_fakes(), \
                warnings.catch_warnings():
            # deepcopy asks a fake tensor for its data pointer, which warns
            warnings.filterwarnings("ignore", message="Accessing the data pointer of FakeTensor")
            if precision == "bf16-pure":
                torch.set_default_dtype(torch.bfloat16)
            model = source.build_model()
            args = source.example_batch(batch, seq)
    except TracerError:
        raise                      # tracer's own refusal (--lora-targets naming no module, an hf: --seq too long)
    except Exception as exc:
        at = where(exc) if where is not None else exception_location(exc, source.name)
        raise ModelRunError(f"{at}: building the model or its example batch raised "
                            f"{type(exc).__name__}: {exc}", hint=source.failure_hint or "fix build_model()/example_batch()") from exc
    finally:
        torch.set_default_dtype(default_dtype)
        values.forget()
    if not isinstance(model, nn.Module):
        raise ModelRunError(f"build_model() of {source.name} returned {type(model).__name__}, not an nn.Module")
    keys = None
    if isinstance(args, dict):
        keys, args = tuple(args), tuple(args.values())
    elif not isinstance(args, tuple):
        args = (args,)
    grads = [keys[i] if keys else str(i) for i, leaf in enumerate(args)
             if any(isinstance(t, torch.Tensor) and t.requires_grad for t in tree_leaves(leaf))]
    if grads:
        raise UsageError(f"example_batch of {source.name} returned a tensor with requires_grad=True (argument "
                         f"{grads[0]}): tracer predicts steps whose inputs are data, and a gradient of an input "
                         f"is not modelled", hint="return the batch without requires_grad")
    if precision == "bf16-pure":
        with fake_mode:
            args = tuple(a.to(torch.bfloat16) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
                         for a in args)
    model.train()
    _tensor_attributes_as_buffers(model)
    return FakeBuild(model=model, batch=args, batch_keys=keys, notes=values.notes())


# Submodules and parameters a build may register. The largest models people train register about a
# hundred thousand (DeepSeek-V3: 61 layers x 256 experts x 3 linears, about 48k modules and as many
# weights); a build past this is a size that no GPU trains (a layer count of 10**9), which would run for
# days before any answer. Reaching the bound costs two to three minutes of building on a 2-core machine.
MAX_BUILD_REGISTRATIONS = 200_000


@contextlib.contextmanager
def _bounded_module_count(name: str):
    """Refuse the build once it has registered `MAX_BUILD_REGISTRATIONS` submodules and parameters
    (torch's global registration hooks see every `self.x = module`, `add_module`, container append and
    `nn.Parameter` assignment, including those of modules not yet attached to the model)."""
    registered = [0]

    def count(owner, attribute, value):
        registered[0] += 1
        if registered[0] > MAX_BUILD_REGISTRATIONS:
            raise UsageError(f"building {name} registered over {MAX_BUILD_REGISTRATIONS:,} submodules and "
                             f"parameters (at {type(owner).__name__}.{attribute}): the build was stopped",
                             hint="check the model's sizes (a layer count in its config); tracer builds "
                                  f"models of up to {MAX_BUILD_REGISTRATIONS:,} modules and parameters")
        return None

    handles = (nn.modules.module.register_module_module_registration_hook(count),
               nn.modules.module.register_module_parameter_registration_hook(count))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def _tensor_attributes_as_buffers(model: nn.Module) -> None:
    """A tensor the model holds as a plain attribute since its build (`self.freqs_cis = precompute(...)` in
    the reference Llama) exists before the step like a buffer, but a trace takes it for a constant, which
    export refuses as a fake constant: it is registered as a non-persistent buffer of its module."""
    for module in model.modules():
        for name, value in list(vars(module).items()):
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) \
                    and name not in module._parameters and name not in module._buffers:
                del module.__dict__[name]
                module.register_buffer(name, value, persistent=False)


class _TensorsFromKnownValues(TorchFunctionMode):
    """`torch.tensor(data)` / `torch.as_tensor(data)` whose Python list holds tensors (torchtune's RoPE
    scaling: a loop over a small computed tensor, then `torch.tensor(new_freqs)`): torch reads each tensor's
    data, which a fake tensor has none of. Each is replaced by its value where the build knows it (else 0,
    noted as every unknown read is), and the new tensor's value is known in turn."""

    def __init__(self, values: "_BuildValues"):
        super().__init__()
        self._values = values

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.tensor, torch.as_tensor) and args and isinstance(args[0], (list, tuple)) \
                and any(isinstance(leaf, torch.Tensor) and _is_fake(leaf) for leaf in tree_leaves(args[0])):
            data = self._values.python_values(args[0])
            out = func(data, *args[1:], **kwargs)
            if isinstance(out, torch.Tensor) and out.numel() <= SMALL_NUMEL:
                real_kwargs = {k: v for k, v in kwargs.items() if k != "device"}
                with _disable_current_modes():
                    self._values.remember(out, torch.tensor(data, **real_kwargs))
            return out
        return func(*args, **kwargs)


class _BuildValues(TorchDispatchMode):
    """Real values of the small tensors whose values the build determines; answers value reads (see the
    module docstring). Entered inside the fake mode, so it sees each op first and calls the fake mode."""

    def __init__(self, fake_mode):
        super().__init__()
        self._fake_mode = fake_mode
        # id(fake) -> (fake, real value, fake storage key); the fake is held so its id is not reused
        self._known: dict[int, tuple[torch.Tensor, torch.Tensor, int]] = {}
        self._by_storage: dict[int, set[int]] = {}
        self._known_bytes = 0
        self._assumed: dict[tuple, str] = {}          # (file, line, op) -> note

    def notes(self) -> tuple[str, ...]:
        return tuple(self._assumed.values())

    def forget(self) -> None:
        self._known.clear()
        self._by_storage.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            answer = self._read_value(func, args, kwargs)
            if answer is _UNANSWERED:
                raise
            return answer
        self._follow(func, args, kwargs, out)
        return out

    def _read_value(self, func, args, kwargs):
        """An op whose result depends on values: exact from known values, else an assumption, noted."""
        real = self._real_inputs(args, kwargs)
        if real is not None:
            with _disable_current_modes():
                result = func(*real[0], **real[1])
            return tree_map(self._fake_of, result)
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            dtype = args[0].dtype
            answer = False if dtype == torch.bool else (0.0 if dtype.is_floating_point or dtype.is_complex else 0)
        elif func in (aten.equal.default, aten.allclose.default, aten.is_nonzero.default):
            answer = False
        elif func is aten.nonzero.default:
            answer = torch.empty((0, args[0].dim()), dtype=torch.long, device=args[0].device)
        else:
            return _UNANSWERED
        loc = loc_from_python_stack()
        where = loc.short() if loc is not None else "an unknown line"
        shown = "no element" if isinstance(answer, torch.Tensor) else repr(answer)
        self._assumed.setdefault((loc.file if loc else None, loc.line if loc else None, str(func)),
                                 f"building the model read a value the build does not compute ({func.name()} at "
                                 f"{where}, e.g. of a randomly initialised tensor): taken as {shown}")
        return answer

    def _follow(self, func, args, kwargs, out) -> None:
        """Compute `out` for real when its inputs are known and it is small; else forget what it wrote."""
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        computable = (isinstance(func, torch._ops.OpOverload)
                      and torch.Tag.nondeterministic_seeded not in func.tags
                      and self._known_bytes < KNOWN_BYTES_LIMIT
                      and all(t.numel() <= SMALL_NUMEL for t in outs)
                      and not any(not _is_fake(t) for t in _written(func, args, kwargs)))
        real = self._real_inputs(args, kwargs) if computable else None
        if real is None:
            for t in _written(func, args, kwargs):
                self._forget_storage(t)
            return
        try:
            with _disable_current_modes():
                result = func(*real[0], **real[1])
        except Exception:          # the value cannot be computed here (e.g. another device): it stays unknown
            for t in _written(func, args, kwargs):
                self._forget_storage(t)
            return
        for fake, value in zip(tree_leaves(out), tree_leaves(result)):
            if isinstance(fake, torch.Tensor) and isinstance(value, torch.Tensor) and _is_fake(fake):
                self._remember(fake, value)

    def _real_inputs(self, args, kwargs):
        """(args, kwargs) with every fake tensor replaced by its known value; None if one is unknown."""
        flat, spec = tree_flatten((args, kwargs))
        real = []
        for a in flat:
            if isinstance(a, torch.Tensor) and _is_fake(a):
                entry = self._known.get(id(a))
                if entry is None or entry[2] != _storage_key(a) or entry[1].shape != a.shape \
                        or entry[1].dtype != a.dtype:
                    return None
                a = entry[1]
            real.append(a)
        return tree_unflatten(real, spec)

    def python_values(self, data):
        """`data` (nested lists and tuples) with each fake tensor replaced by its known value as Python numbers
        (`tolist()`); an unknown one is zeros of its shape, noted with the line that asked."""
        if isinstance(data, (list, tuple)):
            return type(data)(self.python_values(item) for item in data)
        if not (isinstance(data, torch.Tensor) and _is_fake(data)):
            return data
        entry = self._known.get(id(data))
        if entry is not None and entry[2] == _storage_key(data):
            return entry[1].tolist()
        loc = loc_from_python_stack()
        where = loc.short() if loc is not None else "an unknown line"
        self._assumed.setdefault((loc.file if loc else None, loc.line if loc else None, "tensor"),
                                 f"building the model made a tensor from a list holding tensors whose values the "
                                 f"build does not compute (at {where}): taken as 0")
        with _disable_current_modes():
            return torch.zeros(data.shape, dtype=data.dtype).tolist()

    def remember(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        self._remember(fake, value)

    def _remember(self, fake: torch.Tensor, value: torch.Tensor) -> None:
        if value.shape != fake.shape or value.dtype != fake.dtype:
            return
        key = _storage_key(fake)
        if id(fake) not in self._known:
            self._known_bytes += value.numel() * value.element_size()
        self._known[id(fake)] = (fake, value, key)
        self._by_storage.setdefault(key, set()).add(id(fake))

    def _forget_storage(self, t: torch.Tensor) -> None:
        """`t` was written by an op not computed here: no tensor on its storage has a known value now."""
        if not _is_fake(t):
            return
        for ident in self._by_storage.pop(_storage_key(t), ()):
            self._known.pop(ident, None)

    def _fake_of(self, value):
        if not isinstance(value, torch.Tensor):
            return value
        fake = self._fake_mode.from_tensor(value, static_shapes=True)
        self._remember(fake, value)
        return fake


def _is_fake(t) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor
    return isinstance(t, FakeTensor)


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _written(func, args, kwargs) -> list[torch.Tensor]:
    """The tensor arguments `func` writes into (in-place and out= arguments)."""
    schema = getattr(func, "_schema", None)
    if schema is None:
        return []
    written = []
    for i, arg in enumerate(schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        written += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return written


@contextlib.contextmanager
def _deep_copies_share_the_fake_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    had = "__deepcopy__" in vars(FakeTensorMode)
    saved = vars(FakeTensorMode).get("__deepcopy__")
    FakeTensorMode.__deepcopy__ = lambda self, memo: self
    try:
        yield
    finally:
        if had:
            FakeTensorMode.__deepcopy__ = saved
        else:
            del FakeTensorMode.__deepcopy__


_CACHE_ENTRIES = 64          # a library's cache of tensors by name is small; larger dicts are tables
_SET_ASIDE: dict[tuple[int, object], tuple[dict, torch.Tensor]] = {}   # (id(dict), key) -> (dict, real tensor)


def _module_tensor_caches():
    """(dict, key, tensor) for each tensor in a small module-level dict of any imported module."""
    for module in list(sys.modules.values()):
        for value in list(getattr(module, "__dict__", {}).values()):
            if type(value) is dict and 0 < len(value) <= _CACHE_ENTRIES:
                for key, item in list(value.items()):
                    if isinstance(item, torch.Tensor):
                        yield value, key, item


def set_module_caches_aside(fake_mode) -> None:
    """A library that caches a tensor it made in a module-level dict (bitsandbytes' quantization code maps,
    `functional.name2qmap`) would hand a build under `fake_mode` a real tensor, or a fake one of an earlier
    capture, which the fake mode refuses: such entries are taken out, so the library makes them again (real
    ones are kept aside for `restore_module_caches`)."""
    from torch._subclasses.fake_tensor import FakeTensor

    for cache, key, tensor in _module_tensor_caches():
        if isinstance(tensor, FakeTensor):
            if tensor.fake_mode is not fake_mode:
                del cache[key]
        else:
            _SET_ASIDE[(id(cache), key)] = (cache, tensor)
            del cache[key]


def restore_module_caches() -> None:
    """After a capture: the fake tensors it left in module-level caches are dropped and the real ones set
    aside are put back, so the process's libraries hold nothing of the capture."""
    from torch._subclasses.fake_tensor import FakeTensor

    for cache, key, tensor in _module_tensor_caches():
        if isinstance(tensor, FakeTensor):
            del cache[key]
    for (_, key), (cache, tensor) in list(_SET_ASIDE.items()):
        cache.setdefault(key, tensor)
    _SET_ASIDE.clear()


@contextlib.contextmanager
def _parameter_subclasses_of_fakes():
    """`torch.Tensor._make_subclass(cls, data)` with a fake `data` (a library's Parameter subclass, such as
    bitsandbytes' `Params4bit` and `Int8Params`, made in the build): torch refuses to give a fake tensor's
    TensorImpl a second Python object. The fake tensor itself becomes the instance: its class is extended
    with `cls` (a class deriving from both), so the library's methods and attributes work on it and the
    fake mode still runs its ops."""
    from torch._subclasses.fake_tensor import FakeTensor

    original = torch.Tensor._make_subclass          # TensorBase's; torch.Tensor gets its own while building

    def make_subclass(cls, data, require_grad=False, *args, **kwargs):
        if not isinstance(data, FakeTensor) or args or kwargs:
            return original(cls, data, require_grad, *args, **kwargs)
        fake = data.detach()
        fake.__class__ = fake_subclass(cls, type(data))
        return fake.requires_grad_(require_grad)

    torch.Tensor._make_subclass = staticmethod(make_subclass)
    try:
        yield
    finally:
        del torch.Tensor._make_subclass


@functools.lru_cache(maxsize=None)
def fake_subclass(cls: type, fake_type: type) -> type:
    """The class of a fake tensor that is also an instance of `cls` (see `_parameter_subclasses_of_fakes`).
    Its `detach()` keeps the class and the library's attributes, as `nn.Parameter(t)` and `Module._apply`'s
    swap of a converted parameter require of a Parameter subclass."""
    def detach(self):
        out = fake_type.detach(self)
        out.__class__ = type(self)
        out.__dict__.update(self.__dict__)
        return out

    return type(f"Fake{cls.__name__}", (cls, fake_type), {"__module__": cls.__module__, "detach": detach})


@contextlib.contextmanager
def _swappable_fakes():
    """`torch.utils.swap_tensors` does not count the weak references of a fake mode's memo
    (`weakref.KeyedRef`s to fake tensors; some outlive their memo entry) as references that forbid a swap,
    and the two tensors' known values (capture/routing.py's shadows, which hold weak references too) are
    dropped before it."""
    import torch.utils

    from tracer.capture.routing import forget_values
    swap = torch.utils.swap_tensors
    namespace = swap.__globals__
    real = namespace["weakref"]

    def swap_tensors(t1, t2):
        forget_values(t1, t2)
        return swap(t1, t2)

    class MemoBlind:
        def __getattr__(self, name):
            return getattr(real, name)

        @staticmethod
        def getweakrefs(t):
            return [r for r in real.getweakrefs(t) if not (isinstance(r, real.KeyedRef) and _is_fake(r()))]

    namespace["weakref"], torch.utils.swap_tensors = MemoBlind(), swap_tensors
    try:
        yield
    finally:
        namespace["weakref"], torch.utils.swap_tensors = real, swap


class StepModule(nn.Module):
    """The module tracer traces: `forward(*batch)` returns the step's scalar loss, however the user's model
    hands it over (tracer/capture/model_input.py): with `loss_fn`, `loss_fn(model(*batch[:-1]), batch[-1])`;
    a dict batch is passed as keywords; an output that is a mapping (dict, transformers' ModelOutput) gives
    its "loss", a tuple the element at the model file's `loss_index`, else its only 0-dim floating tensor.
    The other outputs (logits) are dropped as the loss is taken, as in `loss = model(**batch).loss` (the
    Hugging Face Trainer's `compute_loss` returns only the loss); a loop that keeps them (nanoGPT's
    `logits, loss = model(X, Y)`) holds them longer than predicted, and the report says so."""

    def __init__(self, model: nn.Module, *, batch_keys: tuple[str, ...] | None = None, loss_fn=None,
                 loss_index: int | None = None, precision: str | None = None, keep=None):
        super().__init__()
        setattr(self, WRAPPED_ATTR, model)
        self._batch_keys, self._loss_fn, self._loss_index = batch_keys, loss_fn, loss_index
        self._keep = keep                        # outputs -> ((label, tensor), ...) the loop keeps (caller_held.py)
        self.kept: list = []                     # what `keep` picked in the last forward
        self._precision = precision              # set: the loss is scaled as GradScaler scales it (fp16)
        self.handed_over: str | None = None        # how the last forward handed the loss over, when not bare
        self.loss_position: int | None = None      # the loss's position when forward returned a tuple or list
        self.others_noted = False                  # what the loop keeps of the other outputs is noted elsewhere

    def forward(self, *batch):
        from tracer.capture.precision import scaled_loss
        return scaled_loss(self._loss(*batch), self._precision) if self._precision else self._loss(*batch)

    def _loss(self, *batch):
        from tracer.capture.lightning_loop import is_lightning_module, training_step_loss
        model = getattr(self, WRAPPED_ATTR)
        if is_lightning_module(model):
            # what Lightning's loop keeps of the rest is caller_held.py's note
            self.handed_over = "training_step(batch, batch_idx)'s loss, as Lightning's loop takes it"
            self.others_noted = True
            with _transformers_masks_as_in_eager():
                loss, out = training_step_loss(model, batch, self._batch_keys)
            self._keep_outputs(out)
            return loss
        if self._loss_fn is not None:
            out = model(*batch[:-1])
            self._keep_outputs(out)
            return self._loss_fn(out, batch[-1])
        with _transformers_masks_as_in_eager():
            out = model(**dict(zip(self._batch_keys, batch))) if self._batch_keys is not None else model(*batch)
        self._keep_outputs(out)
        return self._loss_of(out)

    def _keep_outputs(self, out) -> None:
        if self._keep is not None:
            self.kept = list(self._keep(out))

    def _loss_of(self, out):
        if isinstance(out, torch.Tensor):
            return out
        if isinstance(out, Mapping):
            loss = out.get("loss")
            if loss is None:
                raise ModelRunError(f"forward returned a {type(out).__name__} without a 'loss' (keys: "
                                    f"{', '.join(map(str, out.keys()))})",
                                    hint="pass the labels so the model computes its loss (e.g. labels=input_ids)")
            self.handed_over = f"a {type(out).__name__}'s 'loss'"
            return loss
        if isinstance(out, (tuple, list)):
            self.loss_position = sequence_loss_position(out, self._loss_index)
            how = "" if self._loss_index is not None else " (the only 0-dim floating tensor)"
            self.handed_over = f"element {self.loss_position}{how} of the returned {type(out).__name__}"
            return out[self.loss_position]
        return out

    def notes(self) -> tuple[str, ...]:
        if self.handed_over is None:
            return ()
        if self.loss_position is not None or self.others_noted:   # what the loop holds: caller_held.py's notes
            return (f"the loss is {self.handed_over}",)
        return (f"the loss is {self.handed_over}; the other outputs are dropped as the loss is taken "
                "(`loss = model(**batch).loss`, as the Hugging Face Trainer does); a loop that keeps them holds "
                "them until it drops them (keep_outputs in the model file)",)


def sequence_loss_position(out, loss_index: int | None) -> int:
    """Where the loss is in a tuple or list forward returns: the model file's `loss_index`, else its only
    0-dim floating tensor. Raises ModelRunError when that is not clear."""
    if loss_index is not None:
        return loss_index % len(out)
    scalars = [i for i, o in enumerate(out) if isinstance(o, torch.Tensor) and o.dim() == 0 and o.is_floating_point()]
    if len(scalars) != 1:
        raise ModelRunError(f"forward returned a {type(out).__name__} of {len(out)} with {len(scalars)} "
                            "0-dim floating tensors: which one is the loss is not clear",
                            hint="set loss_index = <position of the loss> in the model file")
    return scalars[0]


def _transformers_masks_as_in_eager():
    """A transformers model in a model file gets the attention masks eager builds, as `hf:` models do
    (tracer/models/hf.py); nothing to do when transformers' masking code was never imported."""
    import sys
    if "transformers.masking_utils" not in sys.modules:
        return contextlib.nullcontext()
    from tracer.models.hf import _masks_as_in_eager
    return _masks_as_in_eager()


def step_module(build: FakeBuild, source: ModelSource, precision: str | None = None) -> StepModule:
    """The StepModule of `build`; with `precision`, its loss is the one backward starts from (scaled by
    the GradScaler under fp16, capture/precision.py). Without, the caller scales it itself."""
    if build.batch_keys is not None and source.loss_fn is not None:
        raise ModelRunError(f"{source.name}: example_batch returned a dict and the file defines loss_fn",
                            hint="return a tuple (inputs..., target) to use loss_fn, or compute the loss in forward")
    return StepModule(build.model, batch_keys=build.batch_keys, loss_fn=source.loss_fn,
                      loss_index=source.loss_index, precision=precision)


def probe_build(source: ModelSource, precision: str, seq: int) -> None:
    """Build the model and a batch of one under fake tensors and drop them: what building records (the
    depth a cut source sees, tracer/depth_capture.py) without a capture."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    try:
        build_fake(source, 1, seq, precision, FakeTensorMode())
    finally:
        restore_module_caches()


_HELD_DEPTH = 3               # QuantState -> state2 -> absmax: how deep held objects are read


def model_held_tensors(model: nn.Module) -> list[tuple[torch.Tensor, str]]:
    """(tensor, name) for every tensor the model holds inside objects, each once, besides its parameters,
    buffers and plain tensor attributes: in a parameter's attributes (bitsandbytes' `Params4bit.quant_state`:
    absmax, its nested scales and code maps, "<param fqn>.quant_state.absmax") and in a module's attributes
    that are neither modules nor tensors (`Linear8bitLt.state`, a MatmulLtState holding the int8 weight's
    scales: "<module>.state.SCB"), read through objects, lists, tuples and dicts up to three levels deep.
    The one reader for the capture and the tests' measured steps."""
    own = {id(t) for t in (*model.parameters(), *model.buffers())}
    found: dict[int, tuple[torch.Tensor, str]] = {}
    seen: set[int] = set()
    for fqn, p in model.named_parameters():
        for attribute, value in vars(p).items():
            _walk_held(value, f"{fqn}.{attribute}", 1, own, found, seen)
    for path, module in model.named_modules():
        for attribute, value in vars(module).items():
            if attribute.startswith("_") or isinstance(value, torch.Tensor):
                continue          # torch's own registries; a plain tensor attribute is read on its own
            _walk_held(value, f"{path}.{attribute}" if path else attribute, 1, own, found, seen)
    return list(found.values())


def _walk_held(value, name: str, depth: int, own: set[int], found: dict, seen: set[int]) -> None:
    """`model_held_tensors`' walk, a module-level function (a nested one that calls itself is a reference
    cycle holding what it found until a garbage collection, past the moment a real step frees it)."""
    if depth > _HELD_DEPTH or id(value) in seen or isinstance(value, (nn.Module, type)):
        return
    seen.add(id(value))
    if isinstance(value, torch.Tensor):
        if id(value) not in own:
            found.setdefault(id(value), (value, name))
    elif isinstance(value, dict):
        for key, item in value.items():
            _walk_held(item, f"{name}.{key}", depth + 1, own, found, seen)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _walk_held(item, f"{name}[{i}]", depth + 1, own, found, seen)
    elif hasattr(value, "__dict__"):
        for attribute, item in vars(value).items():
            _walk_held(item, f"{name}.{attribute}", depth + 1, own, found, seen)
