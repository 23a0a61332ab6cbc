"""Record a stretch of eager execution on fake tensors as ops over storages, with exact frees.

`StepRecorder` is a TorchDispatchMode: every aten op becomes an `OpDraft`; every new storage gets a
`weakref.finalize` that records the op after which it was released (the last reference went away:
a Python variable, an autograd saved tensor, `.grad`), so liveness needs no last-use guess here. Every
storage in the table is so tracked (`add_existing` for what exists before), or a dead storage's address, which
a new storage may take, would still name it.
Phases and source lines come from callables, so the optimizer step and a whole-step fallback share it.
An op on a tensor subclass (a DTensor parameter, its gradient or optimizer state) is not recorded itself:
the subclass runs it on its inner tensors, and those ops, which come back through this mode, are recorded:
the wrapper holds no memory of its own.
A custom op (torch.library, outside aten/prims) whose kernel for `kernel_device` is written in Python is
run through that kernel (`kernel_device="cpu"` for a CPU target), so the tensors the kernel makes and frees
are recorded, as the allocator sees them on a real run; custom ops it calls in turn run their fake kernels
(their outputs only). A custom op with no Python kernel there, and every op for a CUDA target, runs its
fake kernel: a compiled kernel allocates its outputs only. A traced kernel that reads raw memory
(`data_ptr`) stops the step with a clear error.
Values the code reads from tensors (`.item()`, `if t:`) do not exist on fake tensors: with
`read_scalars_as_zero` they read as 0 / False and each such read is noted with its line, except that a
truth value an `assert` statement reads is the one that lets it pass (a step that runs passes its assertions:
False for `assert not x.isnan().any()`), noted apart.
"""
from __future__ import annotations

import contextlib
import os
import weakref
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from tracer.capture.convert import OpDraft, add_kernel_scratch, plain_value
from tracer.capture.kernel_scratch import eager_scratch_allocations
from tracer.capture.meta import target_name
from tracer.capture.pylocals import is_assertion, passing_truth
from tracer.capture.source import loc_from_python_stack
from tracer.capture.storages import StorageTable
from tracer.stepgraph import Phase, SourceLoc, StorageRole


def _optimizer_site() -> tuple[Phase, SourceLoc | None, str]:
    return Phase.OPTIMIZER, loc_from_python_stack(), ""


class StepRecorder(TorchDispatchMode):
    def __init__(self, table: StorageTable, ops_offset: int,
                 site: Callable[[], tuple[Phase, SourceLoc | None, str]] = _optimizer_site,
                 read_scalars_as_zero: bool = False, kernel_device: str | None = None,
                 opaque_raw_kernels: bool = False, cpu_scratch: bool | None = None,
                 on_op: Callable[[OpDraft, object], None] | None = None):
        super().__init__()
        # `on_op(draft, out)`: called with each op recorded and what it returned (its outputs get autograd
        # nodes only after this mode returns them)
        self.on_op = on_op
        self.kernel_device = kernel_device
        # the workspaces CPU kernels allocate inside a call (LAPACK's): the step's own on a CPU target; a
        # custom op's Python kernel traced on the CPU for a CUDA target does not make them count
        self.cpu_scratch = kernel_device == "cpu" if cpu_scratch is None else cpu_scratch
        self._inside_kernel = False
        self.traced_kernels: dict[str, None] = {}         # custom ops traced through their kernel, in order
        # `opaque_raw_kernels`: a Python kernel that cannot run on fake tensors (it hands raw memory to C
        # code, which allocates nothing through torch) is recorded as one op, its outputs, instead of refused
        self.opaque_raw_kernels = opaque_raw_kernels
        self.opaque_kernels: dict[str, None] = {}         # custom ops recorded whole, their kernel not traced
        self.table, self.ops_offset, self.site = table, ops_offset, site
        self.read_scalars_as_zero = read_scalars_as_zero
        self.ops: list[OpDraft] = []
        self.created: list[int] = []
        self.scalar_reads: list[SourceLoc | None] = []
        self.asserted_reads: list[SourceLoc] = []         # truth values an assert statement read (passing)
        self.subclass_ops = False                         # an op ran on a tensor subclass
        self.model_constant_reads = 0                     # values of known tensors read outside the optimizer
        self._finalizers: list[weakref.finalize] = []

    def add_existing(self, t: torch.Tensor, role: StorageRole, **fields) -> int:
        """A storage that exists before the recorded stretch: persistent unless seen released during it. Its
        release is tracked like a new storage's: one the stretch frees (a buffer a forward rebinds, `self.x_max =
        ...`) leaves the table, so a new storage that takes its address is not taken for it."""
        sid = self.table.add(t, role, preexisting=True, persistent=True, **fields)
        self.track_release(t, sid)
        return sid

    def ensure_tracked(self, t: torch.Tensor) -> int:
        """The storage of `t`, added as a constant made outside the dispatcher when the table lacks it (it
        lives from its first use)."""
        if t in self.table:
            return self.table.lookup(t)
        sid = self.table.add(t, StorageRole.INTERMEDIATE, name="constant")
        self.created.append(sid)
        self.track_release(t, sid)
        return sid

    def track_release(self, t: torch.Tensor, sid: int) -> None:
        storage = t.untyped_storage()
        self._finalizers.append(weakref.finalize(storage, self._released, sid, storage._cdata))

    def stop_tracking(self) -> None:
        """The recorded stretch is over: what dies later (the optimizer, the model) was alive at its end."""
        for finalizer in self._finalizers:
            finalizer.detach()
        self._finalizers.clear()

    def _released(self, sid: int, key: int) -> None:
        self.table.update(sid, released_after_op=self.ops_offset + len(self.ops) - 1)
        self.table.forget_key(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.read_scalars_as_zero and func is torch.ops.aten._local_scalar_dense.default:
            from torch._subclasses.fake_tensor import DataDependentOutputException
            try:
                value = func(*args, **kwargs)       # a constant the fake mode knows (e.g. Adam's step count)
            except DataDependentOutputException:
                loc = loc_from_python_stack()
                if args[0].dtype == torch.bool and loc is not None and is_assertion(loc.file, loc.line):
                    self.asserted_reads.append(loc)
                    return passing_truth(loc.file, loc.line)
                self.scalar_reads.append(loc)
                return _zero_like_scalar(args[0].dtype)
            if self.site()[0] is not Phase.OPTIMIZER:
                self.model_constant_reads += 1
            return value
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        if any(is_traceable_wrapper_subclass(t) for t in leaves):
            self.subclass_ops = True
            # a tensor subclass (a DTensor) runs the op on its inner tensors: those ops, which come back
            # through this mode, are what allocates; the subclass itself holds no memory of its own
            return NotImplemented
        for t in leaves:
            self.ensure_tracked(t)      # made outside the dispatcher during the step (a lifted constant)
        if self._traces_kernel_of(func):
            if not self.opaque_raw_kernels or self._kernel_runs_on_fakes(func, args, kwargs):
                return self._through_kernel(func, args, kwargs)
            self.opaque_kernels[str(func)] = None
        plain_args = plain_value(args, self.table)
        plain_kwargs = tuple((k, plain_value(v, self.table)) for k, v in kwargs.items())
        out = func(*args, **kwargs)
        if func.namespace == "profiler":
            return out
        outputs, fresh = [], False
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor):
                continue
            if t not in self.table:
                sid = self.table.add(t, StorageRole.INTERMEDIATE)
                self.created.append(sid)
                self.track_release(t, sid)
                fresh = True
            outputs.append(self.table.value(t))
        phase, source, module, *recomputed = self.site()
        self.ops.append(OpDraft(name=f"{phase.value}_{len(self.ops)}", target=target_name(func), phase=phase,
                                args=plain_args, kwargs=plain_kwargs, outputs=tuple(outputs), source=source,
                                module=module, is_view=bool(outputs) and not fresh,
                                recomputed=bool(recomputed and recomputed[0])))
        if self.cpu_scratch:                 # the CPU kernel's own workspace, freed before it returns
            scratch = eager_scratch_allocations(target_name(func), args, kwargs)
            add_kernel_scratch(self.ops[-1], self.ops_offset + len(self.ops) - 1, scratch, self.table)
        if self.on_op is not None:
            self.on_op(self.ops[-1], out)
        return out


    def _traces_kernel_of(self, func) -> bool:
        return (self.kernel_device is not None and not self._inside_kernel
                and func.namespace not in _BUILTIN_NAMESPACES and str(func) not in self.opaque_kernels
                and python_kernel_for(func, self.kernel_device))

    def _kernel_runs_on_fakes(self, func, args, kwargs) -> bool:
        """A trial run of the kernel, nothing recorded: False where it stops (a raw memory read)."""
        try:
            self._run_kernel(func, args, kwargs)
        except Exception:                     # noqa: BLE001 - the op is recorded whole instead
            return False
        return True

    def _run_kernel(self, func, args, kwargs):
        """The custom op's Python kernel for the device on the fake tensors; RawMemoryRead where it reads
        raw memory."""
        with _real_fake_data_pointers():
            return func.redispatch(torch._C.DispatchKeySet(_DISPATCH_KEYS[self.kernel_device]), *args, **kwargs)

    def _through_kernel(self, func, args, kwargs):
        """The custom op's Python kernel for the device, run under this recorder on the fake tensors."""
        self._inside_kernel = True
        try:
            with self:
                out = self._run_kernel(func, args, kwargs)
        except Exception as exc:
            from tracer.errors import ModelRunError
            raise ModelRunError(f"the {self.kernel_device} kernel of {func} cannot run on fake tensors "
                                f"({type(exc).__name__}: {exc})",
                                hint="it reads raw memory; the step needs another target or optimizer") from exc
        finally:
            self._inside_kernel = False
        self.traced_kernels[str(func)] = None
        return out


@contextlib.contextmanager
def distinct_fake_data_pointers():
    """`data_ptr()` of a fake tensor is 0 (with a warning): code that keys state by a tensor's data pointer
    (heavyball maps each parameter to its state so) would take every tensor for one. While active, each fake
    storage answers a distinct address that points at nothing (above 2**48, outside user space), stable
    for the storage; a custom op's kernel traced by the recorder is refused one (RawMemoryRead)."""
    from torch._subclasses.fake_tensor import FakeTensor

    addresses: dict[int, int] = {}

    def data_ptr(self) -> int:
        key = self.untyped_storage()._cdata
        if key not in addresses:
            addresses[key] = 2**48 + len(addresses) * 2**32
        return addresses[key] + self.storage_offset() * self.element_size()

    FakeTensor.data_ptr = data_ptr
    try:
        yield
    finally:
        del FakeTensor.data_ptr


class RawMemoryRead(RuntimeError):
    """A traced kernel asked a fake tensor for its data pointer (to hand raw memory to C code)."""


@contextlib.contextmanager
def _real_fake_data_pointers():
    """Inside a traced kernel: a fake tensor's data_ptr() raises RawMemoryRead (torch's own answers 0 with
    a warning it gives once per process, after which C code would be handed a null pointer)."""
    from torch._subclasses.fake_tensor import FakeTensor

    def data_ptr(self) -> int:
        raise RawMemoryRead("Accessing the data pointer of FakeTensor: the kernel reads raw memory")

    patched = FakeTensor.__dict__.get("data_ptr")
    FakeTensor.data_ptr = data_ptr
    try:
        yield
    finally:
        if patched is None:
            del FakeTensor.data_ptr
        else:
            FakeTensor.data_ptr = patched


_BUILTIN_NAMESPACES = frozenset({"aten", "prims", "profiler", "prim", "debugprims", "rngprims", "_c10d_functional",
                                 "c10d", "higher_order"})
_DISPATCH_KEYS = {"cpu": torch._C.DispatchKey.CPU}


def python_kernel_for(func, device: str) -> bool:
    """Whether the op's kernel for `device` is a Python function (registered through torch.library): the
    dispatcher's registration record names torch/library.py for such a kernel, registered for the device's
    key or, without one, for CompositeExplicitAutograd (a library's "default" kernel, which every backend
    runs: bitsandbytes' gemm_4bit on the CPU)."""
    key = {"cpu": "CPU"}.get(device)
    if key is None:
        return False
    registered = {}
    for line in torch._C._dispatch_dump(func.name()).splitlines():
        name, found, where = line.partition(": registered at ")
        if found:
            registered[name] = where.split(":", 1)[0]
    where = registered.get(key, registered.get("CompositeExplicitAutograd[alias]"))
    return where is not None and where.endswith(_LIBRARY_FILE)


_LIBRARY_FILE = os.path.join("torch", "library.py")


def _zero_like_scalar(dtype: torch.dtype):
    if dtype == torch.bool:
        return False
    return 0.0 if dtype.is_floating_point else 0
