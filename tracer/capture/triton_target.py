"""Inductor's Triton (CUDA) plan of a compiled step, made on a CPU-only build of torch without a GPU.

For a CUDA target, torch.compile lowers through Inductor's Triton scheduling, not its C++ one: Triton fuses
by its own rules, splits large reductions into partial sums sized by the GPU's SM count, and reuses freed
buffers differently, so the buffers a compiled graph allocates differ from the C++ plan's (on a small MLP +
attention model the backward's own buffers peak 7% lower in fp32, 18% in bf16). Inductor's Triton path runs
on the CPU build once six things a CPU build lacks are supplied; nothing is compiled or run on a device:

  1. **a CUDA device guard**: the CPU build registers no `DeviceGuardImpl` for CUDA, so every C++ path that
     opens a device guard on a fake cuda tensor (indexing, `~mask`, which Inductor's decompositions call)
     raises "PyTorch is not linked with support for cuda devices". A 20-line C++ guard that does nothing
     (one device, one stream, events that are always ready) is compiled once with g++ against c10's
     headers (about 1 s) into tracer's cache directory and registered through c10's `registerDeviceGuard`.
  2. **constant folding on the CPU**: Inductor's uniform-value constant folder evaluates one-element
     constants for real (`UniformValueConstantFolder`); those real ops run on the CPU, only their value is
     kept, and the folded constant keeps its cuda device. Its factories (the zero it folds a product with 0
     to) are moved to the CPU before they would initialise CUDA.
  3. **device queries**: `torch.cuda`'s queries (available, one device, its properties and capability) and
     Inductor's CUDA device interface answer for the `--gpu` model (`device_properties`): SM count,
     compute capability, warp size, threads per SM. Fake tensors keep avoiding device initialisation.
  4. **Triton's driver**: an active driver that names the GPU target (`GPUTarget("cuda", sm, 32)`) and
     refuses to launch or time anything (the real one loads libcuda).
  5. **decisions Inductor times on the GPU**: `pad_mm` pads an unaligned, compute-bound matmul when timing
     both versions on the device says padding is faster. Inductor's own rules before the timing (forced
     padding, the bf16 large-K rule, "not compute bound: keep") are run as they are; where only the timing
     is left, the decision is given (`pad_decision`) and recorded, and the caller plans both answers.
  6. **cuDNN's convolution layouts**: without cuDNN, ATen gives a fake cuda convolution its slow kernel and a
     contiguous output; a channels_last input or weight keeps its layout on cuDNN, as on the CPU's oneDNN
     kernel the capture traced, so the kernel and layout are chosen as for CPU tensors of the same shape,
     strides and dtype (`_convolution_layouts_as_captured`).

A Triton kernel whose loop bodies only load, compute, reduce and store has its buffer bookkeeping replayed
instead of its code generated (tracer/capture/triton_buffer_effects.py): the plan reads no kernel code.

The patches change process-wide state, so a plan runs in a forked child of the capturing process
(`start_forked`, `in_forked_process`): the child inherits the captured joint, retargets it to fake cuda
tensors (`retarget_to_cuda`), plans and converts it, and sends the finished (plain, picklable) result back.
The capturing process starts that child before it builds the step's other policies, which it builds while
the child plans; and with more than one usable core the child lowers the partition's forward in a forked
child of its own while it plans the backward (inductor_plan.plan_forward_and_backward). A forked child
shares nothing afterwards and computes what the one process would: the steps are the same to the last field
(tests/capture/test_triton_target.py).

Not modelled here: decisions under `max_autotune` (Triton templates), `benchmark_fusion` and
`benchmark_epilogue_fusion` (off by default), CUDA graphs. `triton_unavailable()` says why a plan cannot be
made here (no triton, no C++ compiler, a CUDA build of torch, no fork); the caller then plans with the C++
backend and says so in the report.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import inspect
import os
import pickle
import select
import shutil
import signal
import subprocess
import sys
import tempfile

from tracer.capture import triton_buffer_effects
from tracer.choices import GpuSpec
from tracer.errors import package_installed

TRITON_REQUIREMENT = "triton==3.7.1"      # what torch 2.13.0's CUDA wheels install (their metadata pins it)

_GUARD_SOURCE = r"""
#include <c10/core/impl/DeviceGuardImplInterface.h>
namespace {
using namespace c10;
using namespace c10::impl;
// A device guard for CUDA that does nothing: one device, one stream, events that are always complete.
struct NoCudaGuard final : public DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device) const override { return Device(DeviceType::CUDA, 0); }
  Device getDevice() const override { return Device(DeviceType::CUDA, 0); }
  void setDevice(Device) const override {}
  void uncheckedSetDevice(Device) const noexcept override {}
  Stream getStream(Device) const noexcept override { return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, 0), 0); }
  Stream exchangeStream(Stream) const noexcept override { return Stream(Stream::UNSAFE, Device(DeviceType::CUDA, 0), 0); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
};
}
extern "C" int tracer_register_no_cuda_guard() {
  if (hasDeviceGuardImpl(DeviceType::CUDA)) return 0;
  static NoCudaGuard guard;
  registerDeviceGuard(DeviceType::CUDA, &guard);
  return 1;
}
"""


class TritonPlanError(RuntimeError):
    """The Triton plan could not be made in the child process (the message says why)."""


def triton_unavailable() -> str | None:
    """Why a Triton plan cannot be made in this process, or None when it can."""
    import torch
    if torch.version.cuda is not None:
        return "this torch is a CUDA build (the planning patches are for the CPU build)"
    if not hasattr(os, "fork"):
        return "this platform has no fork()"
    if not package_installed("triton"):
        return f"triton is not installed (pip install {TRITON_REQUIREMENT})"
    if _compiler() is None:
        return "no C++ compiler (g++ or $CXX) to build the planning device guard"
    return None


def _compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


# ---------------------------------------------------------------------------------------------- GPU model
@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """What `torch.cuda.get_device_properties` answers for a GPU, the fields Inductor reads."""
    name: str
    major: int
    minor: int
    multi_processor_count: int
    total_memory: int
    max_threads_per_multi_processor: int
    warp_size: int = 32
    max_threads_per_block: int = 1024
    regs_per_multiprocessor: int = 65536
    shared_memory_per_block: int = 48 * 1024
    shared_memory_per_block_optin: int = 48 * 1024
    shared_memory_per_multiprocessor: int = 64 * 1024
    is_integrated: int = 0
    is_multi_gpu_board: int = 0
    uuid: str = "00000000-0000-0000-0000-000000000000"
    pci_bus_id: int = 0
    pci_device_id: int = 0
    pci_domain_id: int = 0

    @property
    def gcnArchName(self) -> str:                       # noqa: N802 - torch's name; Inductor's cache key reads it
        return self.name


def device_properties(gpu: GpuSpec) -> DeviceProperties:
    """The `--gpu` model as CUDA describes it; threads per SM by compute capability (CUDA C++ Programming
    Guide, "Technical Specifications per Compute Capability": 1024 on 7.5, 1536 on 8.6 and 8.9, else 2048)."""
    threads = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536}.get(gpu.sm, 2048)
    # shared memory per SM and the most one block may opt in to, KiB (the same table)
    shared_kib, optin_kib = {(7, 0): (96, 96), (7, 5): (64, 64), (8, 0): (164, 163), (8, 6): (100, 99),
                             (8, 9): (100, 99), (9, 0): (228, 227), (10, 0): (228, 227)}.get(gpu.sm, (64, 48))
    return DeviceProperties(name=gpu.description, major=gpu.sm[0], minor=gpu.sm[1],
                            multi_processor_count=gpu.sm_count, total_memory=gpu.memory_bytes,
                            max_threads_per_multi_processor=threads,
                            shared_memory_per_block_optin=optin_kib * 1024,
                            shared_memory_per_multiprocessor=shared_kib * 1024)


# ---------------------------------------------------------------------------------------------- the patches
@dataclasses.dataclass
class PlanDecisions:
    """What the planning patches decided instead of a GPU: pad_mm's timed decisions, one text per matmul."""
    pad_decision: bool
    timed_pad_mm: list[str] = dataclasses.field(default_factory=list)


def install_cuda_planning(gpu: GpuSpec, *, pad_decision: bool) -> PlanDecisions:
    """Apply the six planning patches for `gpu` to this process, and the kernel bookkeeping replay (for a
    forked child: they are not undone)."""
    import torch
    if torch.version.cuda is not None:
        raise TritonPlanError("a CUDA build of torch: the planning patches are for the CPU build only")
    _register_device_guard()
    _fold_constants_on_cpu()
    _convolution_layouts_as_captured()
    props = device_properties(gpu)
    _answer_device_queries(props)
    _set_triton_driver(props)
    _forget_device_answers()
    decisions = PlanDecisions(pad_decision)
    _give_pad_mm_decisions(decisions)
    triton_buffer_effects.install()
    return decisions


def _guard_library() -> str:
    """The compiled guard, built once per torch version and source into tracer's cache directory."""
    import torch
    include = os.path.join(os.path.dirname(torch.__file__), "include")
    lib_dir = os.path.join(os.path.dirname(torch.__file__), "lib")
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    key = hashlib.sha256(f"{torch.__version__}|{abi}|{_GUARD_SOURCE}".encode()).hexdigest()[:16]
    cache = os.path.join(os.environ.get("TRACER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tracer"), "cuda_guard")
    library = os.path.join(cache, f"no_cuda_guard-{key}.so")
    if os.path.exists(library):
        return library
    os.makedirs(cache, exist_ok=True)
    source = os.path.join(cache, f"no_cuda_guard-{key}.cpp")
    with open(source, "w") as f:
        f.write(_GUARD_SOURCE)
    partial = f"{library}.{os.getpid()}"
    command = [_compiler(), "-shared", "-fPIC", "-O1", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
               f"-I{include}", source, f"-L{lib_dir}", "-lc10", f"-Wl,-rpath,{lib_dir}", "-o", partial]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise TritonPlanError(f"building the planning device guard failed: {done.stderr.strip()[-400:]}")
    os.replace(partial, library)          # atomic: a concurrent build never leaves a half-written library
    return library


def _register_device_guard() -> None:
    import ctypes
    ctypes.CDLL(_guard_library()).tracer_register_no_cuda_guard()


def _fold_constants_on_cpu() -> None:
    """Inductor's uniform-value constant folder runs its one-element constants for real, with the fake mode
    off (torch/_inductor/fx_passes/joint_graph.py, `_deduce_value`, `_add_peephole_patterns`): they run on
    the CPU and only their value is read."""
    import torch
    from torch._inductor.fx_passes import joint_graph
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class CudaConstantsOnCpu(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
                kwargs["device"] = torch.device("cpu")
            if func is torch.ops.prims.device_put.default:
                args = (args[0], torch.device("cpu")) + tuple(args[2:])
            return func(*args, **kwargs)

    class CudaFactoriesOnCpu(TorchFunctionMode):
        """A factory called with device="cuda" (the peephole's `torch.full([1], 0, device=...)` for a product
        with 0) initialises CUDA before any dispatch mode sees it: the device is moved to the CPU first."""
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = dict(kwargs or {})
            if kwargs.get("device") is not None and torch.device(kwargs["device"]).type == "cuda":
                kwargs["device"] = torch.device("cpu")
            return func(*args, **kwargs)

    folder = joint_graph.UniformValueConstantFolder
    for name in ("_deduce_value", "_add_peephole_patterns"):
        original = getattr(folder, name)

        def on_cpu(self, *args, _original=original):
            with CudaFactoriesOnCpu(), CudaConstantsOnCpu():
                return _original(self, *args)

        setattr(folder, name, functools.wraps(original)(on_cpu))


def _convolution_layouts_as_captured() -> None:
    """A convolution's output layout on a fake cuda tensor follows the kernel ATen would pick: this CPU build
    has no cuDNN, so it picks its slow kernel, whose output is contiguous, where CUDA's cuDNN (and the
    capture, which traced the CPU's oneDNN kernel) keep a channels_last input's or weight's layout; a joint
    that views such an output then fails to retrace. The kernel and its layout are chosen for CPU fake tensors
    of the same shape, strides and dtype (`_select_conv_backend`, `_conv_determine_backend_memory_format`,
    which the fake convolution calls): the rule the capture applied, and cuDNN's for 2-d and 3-d convolutions
    in fp32, fp16 and bf16 (channels_last when the input or the weight is)."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

    def on_cpu(value):
        if not (isinstance(value, FakeTensor) and value.device.type == "cuda"):
            return value
        with unset_fake_temporarily():
            meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
        return FakeTensor(value.fake_mode, meta, torch.device("cpu"))

    select, determine = torch._C._select_conv_backend, torch._C._conv_determine_backend_memory_format

    def select_conv_backend(*args, **kwargs):
        return select(*map(on_cpu, args), **{k: on_cpu(v) for k, v in kwargs.items()})

    def conv_determine_backend_memory_format(input, weight, backend):
        return determine(on_cpu(input), on_cpu(weight), backend)

    torch._C._select_conv_backend = select_conv_backend
    torch._C._conv_determine_backend_memory_format = conv_determine_backend_memory_format


def _answer_device_queries(props: DeviceProperties) -> None:
    """torch.cuda's queries, and the copies Inductor's CUDA device interface took of them at import."""
    import torch
    import torch._dynamo.device_interface as device_interface
    from torch._subclasses.fake_tensor import FakeTensorMode

    class HostGeneratorForCuda(torch.Generator):
        """A host generator that says it is cuda:0's: what a replayed random op reads its state from."""
        @property
        def device(self):
            return torch.device("cuda", 0)

        def clone_state(self):
            return HostGeneratorForCuda()

    capability = (props.major, props.minor)
    answers = dict(
        is_available=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        get_device_properties=lambda device=None: props, get_device_capability=lambda device=None: capability,
        get_device_name=lambda device=None: props.name, is_bf16_supported=lambda including_emulation=True: props.major >= 8,
        set_device=lambda device: None, _exchange_device=lambda device: 0, _maybe_exchange_device=lambda device: 0,
        # a recomputed random op's saved state: CUDA's generator state is 16 bytes (seed, offset) on the host
        get_rng_state=lambda device="cuda": torch.zeros(16, dtype=torch.uint8),
        set_rng_state=lambda state, device="cuda": None,
        # a checkpointed random op is replayed from the generator's cloned state (graph-safe RNG
        # functionalization), a graph input with no device memory: a host generator stands in
        _get_generator=lambda device=None: HostGeneratorForCuda(),
    )
    interface = device_interface.CudaInterface
    for name, answer in answers.items():
        _HOST_ANSWERS.setdefault((torch.cuda, name), getattr(torch.cuda, name))
        setattr(torch.cuda, name, answer)
        if hasattr(interface, name):
            _HOST_ANSWERS.setdefault((interface, name), inspect.getattr_static(interface, name))
            setattr(interface, name, staticmethod(answer))
    torch.cuda.default_generators = (HostGeneratorForCuda(),)
    interface.get_compute_capability = staticmethod(lambda device=None: props.major * 10 + props.minor)
    device_interface.caching_worker_device_properties["cuda"] = [props]
    device_interface.caching_worker_current_devices["cuda"] = 0
    # fake tensors read is_available() to decide whether constants may be made on the device: there is none
    FakeTensorMode.avoid_device_init = property(lambda self: True)


_HOST_ANSWERS: dict = {}      # (torch.cuda or CudaInterface, name) -> the query as this CPU build answers it


@contextlib.contextmanager
def host_device_answers():
    """Within: torch.cuda's queries answer as this CPU build does (no device), as they did in the capturing
    process: code that runs for the step rather than for Inductor (the optimizer's step, recorded in a
    planning child) takes the paths it took there, not a GPU path this build cannot run. Outside a planning
    child, nothing changes."""
    planned = {key: inspect.getattr_static(*key) for key in _HOST_ANSWERS}
    for (owner, name), value in _HOST_ANSWERS.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), value in planned.items():
            setattr(owner, name, value)


def _set_triton_driver(props: DeviceProperties) -> None:
    """Triton's active driver: names the target, never launches or times a kernel."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import GPUDriver
    from triton.backends.nvidia.driver import ty_to_cpp
    from triton.runtime.driver import driver

    capability = props.major * 10 + props.minor

    class PlanningDriver(GPUDriver):
        @classmethod
        def is_active(cls):
            return True

        def __init__(self):
            self.get_device_capability = lambda device=None: (props.major, props.minor)
            self.get_current_stream = lambda device=None: 0
            self.get_current_device = lambda: 0
            self.set_current_device = lambda device: None

        def get_current_target(self):
            return GPUTarget("cuda", capability, props.warp_size)

        def get_active_torch_device(self):
            return torch.device("cuda", 0)

        def get_device_interface(self):
            return torch.cuda

        def map_python_to_cpp_type(self, ty):
            return ty_to_cpp(ty)

        def get_benchmarker(self):
            raise TritonPlanError("a kernel timing was requested while planning without a GPU")

        def get_empty_cache_for_benchmark(self):
            raise TritonPlanError("a kernel timing was requested while planning without a GPU")

    driver.set_active(PlanningDriver())


def _forget_device_answers() -> None:
    """Answers the process cached before the patches (this process, or the one it was forked from, may have
    asked "is there triton? a GPU? which?" and cached "no"): every functools cache of the modules that ask."""
    import importlib
    for name in ("torch.utils._triton", "torch._inductor.utils", "torch._inductor.runtime.hints",
                 "torch._dynamo.device_interface", "torch._inductor.codegen.common"):
        module = importlib.import_module(name)
        for value in list(vars(module).values()):
            for cached in (value, *vars(value).values()) if isinstance(value, type) else (value,):
                cached = getattr(cached, "__func__", cached)
                if callable(getattr(cached, "cache_clear", None)):
                    cached.cache_clear()


def _give_pad_mm_decisions(decisions: PlanDecisions) -> None:
    """pad_mm's `_should_pad` runs Inductor's rules as they are, up to its timing cache lookup, which is
    where the GPU would be asked: the lookup answers `decisions.pad_decision` and records the matmul. The
    on-disk memoizer around `_should_pad` is bypassed (a given answer must not be stored as a measured one)."""
    import inspect

    from torch._inductor.fx_passes import pad_mm

    rules = inspect.unwrap(pad_mm._should_pad)

    def timed_decision(key: str) -> bool:
        decisions.timed_pad_mm.append(key)
        return decisions.pad_decision

    pad_mm.get_cached_should_pad = timed_decision
    pad_mm._should_pad = rules


# ---------------------------------------------------------------------------------------------- the graph
def retarget_to_cuda(gm, fake_mode) -> None:
    """Every fake tensor value of `gm` moved to fake `cuda:0` (same size, stride and dtype; nothing runs) and
    every `torch.device('cpu')` argument rewritten; the capture traced on CPU fakes with CUDA's ops."""
    import torch
    import torch.fx as fx
    from torch.utils._pytree import tree_map

    from torch.utils._python_dispatch import _disable_current_modes

    cuda = torch.device("cuda", 0)

    def moved(value):
        # the fake tensor is made from a meta tensor directly: an empty_strided dispatched through the fake
        # mode (and every hook on it) for each of the graph's values made this most of the retarget's time
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            with _disable_current_modes():
                meta = torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")
            return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, meta, cuda)
        return value

    def device_arg(arg):
        return cuda if isinstance(arg, torch.device) and arg.type == "cpu" else arg

    with fake_mode:
        for node in gm.graph.nodes:
            if "val" in node.meta:
                node.meta["val"] = tree_map(moved, node.meta["val"])
            if node.op == "call_function":
                node.args = fx.node.map_aggregate(node.args, device_arg)
                node.kwargs = fx.node.map_aggregate(node.kwargs, device_arg)
    gm.recompile()


# ---------------------------------------------------------------------------------------------- the child
def in_forked_process(work):
    """`work()` run in a forked child of this process; its return value (picklable) comes back, and so does
    an exception it raises. The child shares nothing with this process afterwards, so patches it applies
    stay there. Raises TritonPlanError when the child dies without an answer."""
    return start_forked(work).result()


class ForkedWork:
    """A forked child running `work()` (`start_forked`); `result()` waits for it and returns its value or
    raises its exception (TritonPlanError when the child died without an answer)."""

    def __init__(self, pid: int, read_end: int):
        self._pid, self._read_end = pid, read_end
        self._answer = None

    def result(self):
        if self._answer is None:
            with os.fdopen(self._read_end, "rb") as pipe:
                payload = pipe.read()
            _, status = os.waitpid(self._pid, 0)
            self._answer = pickle.loads(payload) if payload else (
                "error", TritonPlanError(f"the forked process ended without an answer (wait status {status})"))
        kind, value = self._answer
        if kind == "error":
            raise value
        return value

    def abandon(self) -> None:
        """Stops a child whose answer was not read (the caller failed meanwhile): it is killed and reaped."""
        if self._answer is None:
            self._answer = ("error", TritonPlanError("abandoned"))
            os.close(self._read_end)
            try:
                os.kill(self._pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            os.waitpid(self._pid, 0)

    cancel = abandon          # a Future's name for it: a forked capture stands where a pool's Future does


class HandOver:
    """A value this process makes after forking a child that needs it later (`send` here, `received` in the
    child): a compiled policy's planning child plans for seconds and needs the optimizer step's recording only
    at its end, while this process records the same step for its other policies meanwhile. A child forked
    after `send` inherits the value; one forked before waits for it at `received`: the value travels in a
    file whose name the pipe carries (a line shorter than the pipe's buffer, so `send` never waits for a
    child that reads late or never). `received` gives None where None was sent, the value could not travel,
    or this process ended without sending (the child then makes the value itself)."""

    def __init__(self):
        self._sender = os.getpid()
        self._sent, self._value, self._path = False, None, None
        self._read_end, self._write_end = os.pipe()

    def send(self, value) -> None:
        if self._sent:
            return
        self._sent, self._value = True, value
        line = b"-"
        if value is not None:
            fd, path = tempfile.mkstemp(prefix="tracer-handover-", suffix=".pickle")
            try:
                with os.fdopen(fd, "wb") as file:
                    pickle.dump(value, file, protocol=pickle.HIGHEST_PROTOCOL)
                self._path, line = path, path.encode()
            except Exception:                              # noqa: BLE001 - not picklable: the child makes it
                os.unlink(path)
        os.write(self._write_end, line + b"\n")
        os.close(self._write_end)

    def received(self):
        if self._sent:                                     # forked after `send`: inherited
            return self._value
        os.close(self._write_end)
        line = b""
        while not line.endswith(b"\n"):
            ready, _, _ = select.select([self._read_end], [], [], 1.0)
            if not ready:
                if os.getppid() != self._sender:           # the sender is gone
                    return None
                continue
            chunk = os.read(self._read_end, 4096)
            if not chunk:
                return None
            line += chunk
        path = line.strip().decode()
        if path == "-":
            return None
        try:
            with open(path, "rb") as file:
                return pickle.load(file)
        except Exception:                                  # noqa: BLE001 - the child makes it itself
            return None

    def close(self) -> None:
        """In the sending process, once no child reads any more: the file and the pipe are released."""
        if self._read_end is None:
            return
        if not self._sent:
            os.close(self._write_end)
            self._sent = True
        os.close(self._read_end)
        self._read_end = None
        if self._path is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._path)


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


_CAPTURE_PROCESSES = [1]      # capture processes of this command running at once, this one included


@contextlib.contextmanager
def cores_shared_by(processes: int):
    """While it is entered, this process is one of `processes` capture processes sharing the cores
    (tracer.pipeline.capture_processes): `planning_cores` divides them."""
    _CAPTURE_PROCESSES.append(processes)
    try:
        yield
    finally:
        _CAPTURE_PROCESSES.pop()


def share_cores(processes: int) -> None:
    """This process is, for its life, one of `processes` capture processes sharing the cores."""
    _CAPTURE_PROCESSES[0] = processes


def planning_cores() -> int:
    """The cores this process's own planning may keep busy: its usable cores, shared by the command's
    capture processes (a process forked to plan beside another only slows both when none is left)."""
    return max(1, usable_cores() // _CAPTURE_PROCESSES[-1])


def forking_available() -> bool:
    """Whether work can run in a forked child of this process (`start_forked`)."""
    return hasattr(os, "fork")


def start_forked(work) -> ForkedWork:
    """`work()` started in a forked child of this process, which goes on at once (the caller's own work
    runs beside the child's); see `in_forked_process`."""
    sys.stdout.flush()
    sys.stderr.flush()
    threads = intra_op_threads()
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:                                         # the child
        os.close(read_end)
        code = 0
        try:
            try:
                one_intra_op_thread(threads)
                payload = pickle.dumps(("ok", work()), protocol=pickle.HIGHEST_PROTOCOL)
            except BaseException as exc:                 # noqa: BLE001 - everything goes back to the parent
                payload = _pickled_error(exc)
            with os.fdopen(write_end, "wb") as pipe:
                pipe.write(payload)
        except BaseException:                            # noqa: BLE001
            code = 1
        finally:
            os._exit(code)
    os.close(write_end)
    return ForkedWork(pid, read_end)


_PARENT_THREADS: dict[str, int] = {}      # in a forked child: "threads" -> its parent's intra-op thread count


def intra_op_threads() -> int:
    """The intra-op thread count a step of this run uses (what sizes per-thread kernel scratch): this
    process's `torch.get_num_threads()`, or in a forked child its parent's (the child itself runs on one)."""
    import torch
    return _PARENT_THREADS.get("threads") or torch.get_num_threads()


def one_intra_op_thread(run_threads: int) -> None:
    """The parent's OpenMP worker threads do not exist in a forked child, and a real CPU op that opens a
    parallel region there waits for them forever (libgomp): the child runs its few real ops (constant
    folding, example values) on one thread, and models the parent's `run_threads` (`intra_op_threads`)."""
    import torch
    _PARENT_THREADS["threads"] = run_threads
    torch.set_num_threads(1)


def _pickled_error(exc: BaseException) -> bytes:
    """The exception itself when it survives pickling (tracer's errors do), else a TritonPlanError with its
    text and the innermost lines of its traceback."""
    import traceback
    from tracer.errors import TracerError
    if not isinstance(exc, TracerError):          # a bug's traceback from the child, for --verbose
        exc.add_note("in the planning process:\n" + "".join(traceback.format_tb(exc.__traceback__)))
    try:
        payload = pickle.dumps(("error", exc), protocol=pickle.HIGHEST_PROTOCOL)
        pickle.loads(payload)
        return payload
    except Exception:                                    # noqa: BLE001 - an exception that does not pickle
        where = "".join(traceback.format_tb(exc.__traceback__)[-3:])
        return pickle.dumps(("error", TritonPlanError(f"{type(exc).__name__}: {exc}\n{where}")))
