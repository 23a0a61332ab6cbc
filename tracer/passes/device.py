"""Device memory of one predicted step: what `memory_allocated()`, `memory_reserved()` and a memory snapshot
of a CUDA run would show, from one policy's liveness plus the allocations the step graph does not hold.

Contract:
    step_requests(liveness, extra_nbytes=(), steps=1) -> tuple[(action, block_id, requested_bytes), ...]
        the caching allocator's request stream ("alloc" / "free"), for `simulate_allocator`.
    predict_device_memory(result, *, extra=(), config=AllocatorConfig(), warm_steps=2, capacity_bytes=None)
        -> DeviceMemory (frozen).
    DeviceSetup: what the device view needs besides the step (extras, allocator settings, capacity);
        `analyze_graphs(graphs, device=setup)` attaches a DeviceMemory to every policy.

Conventions:
  * requested bytes are storage bytes, as in a snapshot's trace and `requested_bytes`; `extra` are
    (label, requested bytes) allocations made before everything else and never freed (the cuBLAS
    workspaces of `tracer.capture.target.device_allocations`), so they add to before, every phase peak
    and the peak.
  * the request stream: extras, then the storages that exist before the step (storage-id order), then op
    by op the storages the op allocates (storage-id order) and then those freed after it, the order
    `tracer.reports.memviz` writes its trace in. So the requested peak of the stream is the liveness peak.
  * allocated bytes (512 B rounding, unsplit large blocks) and reserved bytes come from replaying the
    stream through `tracer.passes.allocator.simulate_allocator`. A steady step runs against a warm
    cache, so the step is replayed `warm_steps` times: each later copy frees, instead of a pre-step
    storage, the storage the previous copy made to replace it (pre-step storages freed in the step are
    paired, in free order, with same-size storages the step creates and keeps: Adam's new moments when
    the optimizer replaces them); other kept storages of a copy (the loss) are freed when the next begins.
    Reserved memory only grows (no `empty_cache`), so its peak is the end of the last copy; the
    allocated peak is the maximum over all copies (they differ only by where blocks land).
  * cuDNN convolution workspaces: every cuDNN convolution call (forward, and the data and weight gradients
    of `convolution_backward`) allocates its workspace from the caching allocator for the call and frees it
    after (PyTorch's `run_conv_plan`, aten/src/ATen/native/cudnn). Its size is what the execution plan
    cuDNN's heuristics (or, with `cudnn.benchmark`, its timing) pick at run time needs: not known
    statically. Without a cap the workspaces are left out and the view says so (its numbers are then
    lower bounds for a step with convolutions); with `conv_workspace_cap_bytes` (the run's
    CUDNN_CONV_WSCAP_DBG, which caps every conv workspace) each call allocates the cap, an upper bound.
Not modelled: the layout the real warm-up steps leave (parameters allocated at model build, optimizer
state created inside the first step), record_stream delays.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

from tracer.passes.allocator import AllocatorConfig, OomReport, simulate_allocator
from tracer.passes.liveness import BEFORE_STEP, Liveness, intervals_by_op

_EXTRA_BASE = -1                      # extras get block ids -1, -2, ... (storage ids are >= 0)
_TRANSIENT_BASE = -(1 << 40)          # per-op workspaces: block ids from here down, one per op and step copy


@dataclasses.dataclass(frozen=True)
class DeviceMemory:
    policy: str
    extra: tuple[tuple[str, int], ...]    # (label, requested bytes) allocated before the step, never freed
    peak_bytes: int                       # requested: the liveness peak + extras
    peak_phase: str
    peak_op_index: int
    phases: dict[str, int]                # phase -> requested peak + extras
    before_bytes: int                     # live before the step, extras included
    allocated_peak_bytes: int             # block sizes (memory_allocated), from the allocator model
    reserved_peak_bytes: int              # segment sizes (memory_reserved)
    segment_count: int
    warm_steps: int
    config: AllocatorConfig
    oom: OomReport | None                 # first request that does not fit capacity_bytes, if given
    capacity_bytes: int | None = None     # the device memory the step was checked against
    conv_calls: int = 0                   # cuDNN convolution calls of the step (each allocates a workspace)
    conv_workspace_cap_bytes: int | None = None   # counted per call when given (an upper bound); else left out
    context_bytes: int = 0                # the CUDA context, taken from the device's total to give capacity_bytes
    system_bytes: int = 0                 # unified memory: what the operating system holds, taken from it too
    nccl_bytes: int = 0                   # the NCCL communicators' buffers, taken from it too
    nccl_communicators: int = 0

    @property
    def extra_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.extra)


@dataclasses.dataclass(frozen=True)
class DeviceSetup:
    """The device a CUDA step runs on, as plain numbers: allocations outside the step graph (label, requested
    bytes), the caching allocator's settings, the device memory (None: unlimited) and its name."""
    device_label: str
    extra: tuple[tuple[str, int], ...] = ()
    config: AllocatorConfig = AllocatorConfig()
    capacity_bytes: int | None = None
    matmul_extra: tuple[tuple[str, int], ...] = ()   # allocated by the first cuBLAS call (its workspaces)
    conv_workspace_cap_bytes: int | None = None      # CUDNN_CONV_WSCAP_DBG of the run; None: not known
    context_bytes: int = 0                           # the CUDA context: capacity_bytes is the device's total less it
    system_bytes: int = 0                            # unified memory: the OS's share, also taken from the total
    nccl_bytes: int = 0                              # NCCL communicators' buffers, also taken from the total
    nccl_communicators: int = 0                      # how many communicators nccl_bytes is for

    def extra_for(self, graph) -> tuple[tuple[str, int], ...]:
        """The extras a step holds: `matmul_extra` only when the step runs a cuBLAS op (a warm step finds
        them allocated by the previous step's first matmul)."""
        return tuple(self.extra) + (tuple(self.matmul_extra) if runs_cublas(graph) else ())


# aten ops that call cuBLAS/cuBLASLt on CUDA (and so make its handles allocate their workspaces)
CUBLAS_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "dot", "vdot", "ger", "addr",
                        "_scaled_mm", "_addmm_activation", "matmul", "linear", "_int_mm", "_grouped_mm",
                        "_scaled_grouped_mm"})


# aten ops that run cuDNN convolutions on CUDA (each call allocates a workspace for its duration)
CUDNN_CONV_OPS = frozenset({"convolution", "_convolution", "convolution_backward", "cudnn_convolution",
                            "cudnn_convolution_transpose", "cudnn_convolution_relu", "cudnn_convolution_add_relu"})


def conv_call_ops(graph) -> tuple[int, ...]:
    """Indices of the step's ops that run cuDNN convolutions."""
    return tuple(op.index for op in graph.ops if _aten_packet(op.target) in CUDNN_CONV_OPS)


def _aten_packet(target: str) -> str | None:
    """"aten.mm.default" -> "mm"; None for an op outside aten."""
    return target.split(".")[1] if target.startswith("aten.") and target.count(".") >= 1 else None


def runs_cublas(graph) -> bool:
    """Whether any op of the step is a cuBLAS matmul."""
    return any(_aten_packet(op.target) in CUBLAS_OPS for op in graph.ops)


def step_requests(liveness: Liveness, extra_nbytes: Sequence[int] = (), steps: int = 1,
                  transient_at: Mapping[int, int] | None = None) -> tuple[tuple[str, int, int], ...]:
    """The allocator request stream of `steps` consecutive copies of the step (see the module docstring).
    `transient_at`: op index -> bytes an op allocates after its outputs and frees before the frees after it
    (a cuDNN convolution's workspace)."""
    transient_at = transient_at or {}
    intervals = [iv for iv in liveness.intervals if iv.alloc_op is not None and iv.nbytes > 0]
    n_ops = len(liveness.live_during)
    stride = max((iv.storage_id for iv in liveness.intervals), default=0) + 1
    allocs_at, frees_at = intervals_by_op(intervals)
    pre = [iv for iv in intervals if iv.alloc_op == BEFORE_STEP]
    kept_pre = {iv.storage_id for iv in pre if iv.free_op is None}
    replacement = _replacements(pre, intervals)
    leftovers = [iv for iv in intervals if iv.alloc_op != BEFORE_STEP and iv.free_op is None
                 and iv.storage_id not in replacement.values()]

    events: list[tuple[str, int, int]] = [("alloc", _EXTRA_BASE - i, n) for i, n in enumerate(extra_nbytes)]
    events += [("alloc", iv.storage_id, iv.nbytes) for iv in pre]
    pre_ids = {iv.storage_id: iv.storage_id for iv in pre}           # pre-step storage -> its block now
    for copy in range(steps):
        def block(iv) -> int | None:
            if iv.alloc_op == BEFORE_STEP:
                return pre_ids.get(iv.storage_id)
            return iv.storage_id + copy * stride
        if copy:
            events += [("free", iv.storage_id + (copy - 1) * stride, 0) for iv in leftovers]
        for i in range(n_ops):
            events += [("alloc", block(iv), iv.nbytes) for iv in allocs_at.get(i, ())]
            if transient_at.get(i):
                workspace = _TRANSIENT_BASE - (copy * n_ops + i)
                events += [("alloc", workspace, transient_at[i]), ("free", workspace, 0)]
            events += [("free", block(iv), 0) for iv in frees_at.get(i, ()) if block(iv) is not None]
        pre_ids = {sid: replacement[sid] + copy * stride if sid in replacement else b
                   for sid, b in pre_ids.items() if sid in replacement or sid in kept_pre}
    return tuple(events)


def _replacements(pre, intervals) -> dict[int, int]:
    """pre-step storage freed in the step -> the same-size storage the step makes and keeps (in order)."""
    freed = sorted((iv for iv in pre if iv.free_op is not None), key=lambda iv: (iv.free_op, iv.storage_id))
    kept = sorted((iv for iv in intervals if iv.alloc_op != BEFORE_STEP and iv.free_op is None),
                  key=lambda iv: (iv.alloc_op, iv.storage_id))
    out: dict[int, int] = {}
    used: set[int] = set()
    for old in freed:
        new = next((iv for iv in kept if iv.nbytes == old.nbytes and iv.storage_id not in used), None)
        if new is not None:
            used.add(new.storage_id)
            out[old.storage_id] = new.storage_id
    return out


def predict_device_memory(result, *, extra: Sequence[tuple[str, int]] = (), config: AllocatorConfig = AllocatorConfig(),
                          warm_steps: int = 2, capacity_bytes: int | None = None,
                          conv_workspace_cap_bytes: int | None = None) -> DeviceMemory:
    """Device memory of policy `result` (a PolicyAnalysis) with `extra` allocations; see the module docstring.
    The peaks come from a replay with unlimited memory, so they are whole even when the step does not
    fit; `capacity_bytes` only decides `oom` (a second replay, run when the reserved peak exceeds it).
    `conv_workspace_cap_bytes`: every cuDNN convolution call allocates this much for its duration (an upper
    bound); None leaves the workspaces out (`DeviceMemory.conv_calls` says how many there are)."""
    if warm_steps < 1:
        raise ValueError("warm_steps must be at least 1")
    extra = tuple((str(label), int(nbytes)) for label, nbytes in extra)
    extra_bytes = sum(n for _, n in extra)
    convs = conv_call_ops(result.graph)
    workspace_at = {i: conv_workspace_cap_bytes for i in convs} if conv_workspace_cap_bytes else {}
    requests = step_requests(result.liveness, [n for _, n in extra], warm_steps, transient_at=workspace_at)
    replay = simulate_allocator(requests, config)
    oom = None
    if capacity_bytes is not None and replay.reserved_peak_bytes > capacity_bytes:
        oom = simulate_allocator(requests, config, capacity_bytes=capacity_bytes).oom
    peak, phase, op_index, phases = _requested_peaks(result, workspace_at)
    return DeviceMemory(
        policy=result.policy, extra=extra, peak_bytes=peak + extra_bytes, peak_phase=phase,
        peak_op_index=op_index, phases={name: nbytes + extra_bytes for name, nbytes in phases.items()},
        before_bytes=result.start_bytes + extra_bytes, allocated_peak_bytes=replay.allocated_peak_bytes,
        reserved_peak_bytes=replay.reserved_peak_bytes, segment_count=replay.segment_count, warm_steps=warm_steps,
        config=config, oom=oom, capacity_bytes=capacity_bytes, conv_calls=len(convs),
        conv_workspace_cap_bytes=conv_workspace_cap_bytes if convs else None)


def _requested_peaks(result, workspace_at: Mapping[int, int]) -> tuple[int, str, int, dict[str, int]]:
    """The requested peak, its phase and op, and each phase's peak, with an op's workspace counted while
    it runs."""
    peak, phase, op_index = result.peak_bytes, result.peak_phase, result.peak_op.index
    phases = {name: p.peak_bytes for name, p in result.phases.items()}
    for i, nbytes in sorted(workspace_at.items()):
        op = result.graph.ops[i]
        during = result.liveness.live_during[i] + nbytes
        phases[op.phase_name] = max(phases.get(op.phase_name, 0), during)
        if during > peak:
            peak, phase, op_index = during, op.phase_name, i
    return peak, phase, op_index, phases


def sharded_device_memory(sharded, setup: DeviceSetup, *, policy: str, graph) -> DeviceMemory:
    """Rank 0's device memory under sharding (`sharded`: a passes.sharding.ShardedMemory): its request
    stream after `setup`'s extras, replayed once through the allocator model (the pre-step model state
    first, as a warm run holds it; the step's blocks land on a cache warmed by nothing else)."""
    extra = setup.extra_for(graph)
    extra_bytes = sum(n for _, n in extra)
    requests = tuple(("alloc", _EXTRA_BASE - i, n) for i, (_, n) in enumerate(extra)) + tuple(sharded.requests)
    replay = simulate_allocator(requests, setup.config)
    oom = None
    if setup.capacity_bytes is not None and replay.reserved_peak_bytes > setup.capacity_bytes:
        oom = simulate_allocator(requests, setup.config, capacity_bytes=setup.capacity_bytes).oom
    return DeviceMemory(
        policy=f"{policy}, {sharded.strategy} rank 0 of {sharded.world_size}", extra=extra,
        peak_bytes=sharded.peak_bytes + extra_bytes, peak_phase=sharded.peak_phase,
        peak_op_index=sharded.peak_op_index,
        phases={name: nbytes + extra_bytes for name, nbytes in sharded.phases.items()},
        before_bytes=sharded.start_bytes + extra_bytes,
        allocated_peak_bytes=replay.allocated_peak_bytes, reserved_peak_bytes=replay.reserved_peak_bytes,
        segment_count=replay.segment_count, warm_steps=1, config=setup.config, oom=oom,
        capacity_bytes=setup.capacity_bytes, conv_calls=len(conv_call_ops(graph)),   # workspaces noted, not counted
        context_bytes=setup.context_bytes, system_bytes=setup.system_bytes, nccl_bytes=setup.nccl_bytes,
        nccl_communicators=setup.nccl_communicators)
