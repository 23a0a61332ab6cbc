"""The CUDA target: trace on CPU fake tensors, but record the ops and dtypes a CUDA run would use.

Fake CUDA tensors cannot be made on a CPU-only build of torch (building under `FakeTensorMode` with device
cuda, or `.to("cuda")` there, raises "PyTorch is not linked with support for cuda devices"), so the step is still traced
on CPU fakes; `cuda_capture(target, precision)` wraps the joint-graph capture and changes three things:

* fused attention: `aten.scaled_dot_product_attention` gets a kernel (CompositeImplicitAutograd, so it
  runs after autocast has cast q, k, v, as on CUDA) that calls the CUDA aten op PyTorch's rules pick
  (`choose_sdpa_backend`, from upstream `sdp_utils.cpp`/`attention.cpp`): flash (saves logsumexp and a
  philox RNG state), efficient (logsumexp padded to a multiple of 32, philox seed/offset; a boolean mask
  becomes an additive mask in q's dtype), cudnn (logsumexp (b, h, s, 1), seed/offset) or math (the
  composite: matmul, softmax, native_dropout with a bool mask). The meta kernels of these ops give the
  shapes; nothing runs. Models that call SDPA through another op (FlexAttention, xformers) are not changed.
* autocast: under `--precision bf16` the CPU autocast policy is replaced by CUDA's op lists
  (`CUDA_AUTOCAST_POLICY`, upstream `autocast_mode.h`): e.g. exp, log, pow, rsqrt, sum, softmax run in
  fp32 on CUDA but in the input dtype on CPU, and einsum casts its inputs itself. Python kernels are
  registered on the AutocastCPU dispatch key for the capture only; ops on CPU's lists but not CUDA's are
  passed through uncast. The autocast weight-cast cache is the same on both devices: it is applied to the
  converted step (capture/autocast_cache.py).
* nothing else in the graph: dropout masks are already bool (`native_dropout`), as in CUDA eager.

Memory that is not a tensor of the step is a `DeviceAllocation` (`device_allocations(target)`): the
cuBLAS workspaces. Sizes: PyTorch's `parseChosenWorkspaceSize()` (aten/src/ATen/cuda/CublasHandlePool.cpp)
uses CUBLAS_WORKSPACE_CONFIG `:SIZE_KiB:COUNT` pairs, default `:4096:2:16:8` = 8,519,680 B, or
`:4096:8` = 32 MiB on sm90 and newer (Hopper, Blackwell). Two per stream: the cuBLAS handle's and the
cuBLASLt handle's workspace, both taken from the caching allocator on the first matmul; both shared
snapshots hold exactly two 8,519,680 B blocks allocated before the step.

`choose_sdpa_backend` and the table functions are pure; only `cuda_capture` touches torch's dispatcher.
A step run op by op (dispatch.py) takes the same SDPA and autocast choices, CUDA eager's dropout
(`cuda_eager_kernels`) and CUDA's optimizer defaults. Not handled: the cuDNN-first SDPA order of
builds with cuDNN > 9.15 on sm90/sm100 (pass `priority`); fp16 autocast; CUDA-only fused optimizer kernels.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import re
import warnings

# the GPU table and the target names live in tracer.choices (no torch there: the CLI's --help reads them)
from tracer.choices import DEFAULT_GPU, DEFAULT_TARGET, GPUS, TARGET_DEVICES, GpuSpec  # noqa: F401
from tracer.errors import UsageError

KIB, MIB, GIB = 2**10, 2**20, 2**30


# ---------------------------------------------------------------------------------------------- GPUs


@dataclasses.dataclass(frozen=True)
class Target:
    device: str                       # "cpu" | "cuda"
    gpu: GpuSpec | None = None        # set for cuda

    @property
    def label(self) -> str:
        return f"cuda:{self.gpu.name}" if self.device == "cuda" else "cpu"

    @property
    def is_cuda(self) -> bool:
        return self.device == "cuda"


def parse_target(text: str, gpu: str | None = None) -> Target:
    """"cpu", "cuda" or "cuda:<gpu>" (or `gpu=`) -> Target. Raises UsageError naming the valid values."""
    device, _, name = (text or "cpu").partition(":")
    name = name or gpu
    if device not in TARGET_DEVICES:
        raise UsageError(f"unknown target {text!r}", hint=f"valid: {', '.join(TARGET_DEVICES)}")
    if device == "cpu":
        if name:
            raise UsageError(f"--gpu {name} needs --target cuda")
        return Target("cpu")
    name = (name or DEFAULT_GPU).lower()
    if name not in GPUS:
        raise UsageError(f"unknown GPU {name!r}", hint=f"valid: {', '.join(GPUS)}")
    return Target("cuda", GPUS[name])


# ---------------------------------------------------------------------------------------------- memory outside

@dataclasses.dataclass(frozen=True)
class DeviceAllocation:
    """Device memory the step needs that is no tensor of the step graph, allocated before the step."""
    name: str
    nbytes: int                       # requested bytes of one allocation
    count: int
    source: str                       # where the number comes from

    @property
    def total_bytes(self) -> int:
        return self.nbytes * self.count


CUBLAS_DEFAULT_CONFIG = ":4096:2:16:8"       # 4096 KiB x 2 + 16 KiB x 8 = 8,519,680 B
CUBLAS_SM90_CONFIG = ":4096:8"               # 32 MiB, sm90 and newer
CUBLAS_WORKSPACES_PER_STREAM = 2             # cuBLAS + cuBLASLt handle workspaces (both shared snapshots)


def cublas_workspace_bytes(gpu: GpuSpec, config: str | None = None) -> int:
    """Bytes of one cuBLAS workspace: CUBLAS_WORKSPACE_CONFIG `config` (":SIZE_KiB:COUNT" pairs, summed),
    else PyTorch's default for the GPU's architecture. Raises UsageError on an unreadable config."""
    if config is None:
        config = CUBLAS_SM90_CONFIG if gpu.sm[0] >= 9 else CUBLAS_DEFAULT_CONFIG
    pairs = re.findall(r":(\d+):(\d+)", config)
    if not pairs:
        raise UsageError(f"CUBLAS_WORKSPACE_CONFIG {config!r} has no :SIZE:COUNT pair", hint="e.g. :4096:8")
    return sum(int(size) * KIB * int(count) for size, count in pairs)


def device_allocations(target: Target, *, cublas_config: str | None = None) -> tuple[DeviceAllocation, ...]:
    """Memory outside the step graph that a `target` run holds before the step (empty for cpu)."""
    if not target.is_cuda:
        return ()
    nbytes = cublas_workspace_bytes(target.gpu, cublas_config)
    config = cublas_config or (CUBLAS_SM90_CONFIG if target.gpu.sm[0] >= 9 else CUBLAS_DEFAULT_CONFIG)
    return (DeviceAllocation(
        "cuBLAS/cuBLASLt workspaces", nbytes, CUBLAS_WORKSPACES_PER_STREAM,
        f"CUBLAS_WORKSPACE_CONFIG {config} (PyTorch's default: CublasHandlePool.cpp), one per handle on the "
        "default stream"),)


# ---------------------------------------------------------------------------------------------- SDPA backend rules

SDPA_BACKENDS = ("flash", "efficient", "cudnn", "math")
DEFAULT_SDPA_PRIORITY = ("flash", "efficient", "math", "cudnn")    # at::globalContext().sDPPriorityOrder()


@dataclasses.dataclass(frozen=True)
class SdpaCall:
    """What the backend choice reads from one scaled_dot_product_attention call (plain numbers)."""
    dtype: str                        # of q (after autocast): "float32" | "bfloat16" | "float16" | ...
    batch: int
    q_heads: int
    kv_heads: int
    seq_q: int
    seq_k: int
    head_dim_qk: int
    head_dim_v: int
    has_mask: bool = False
    dropout_p: float = 0.0
    is_causal: bool = False
    requires_grad: bool = True
    enable_gqa: bool = False
    last_dim_contiguous: bool = True


@dataclasses.dataclass(frozen=True)
class SdpaChoice:
    backend: str
    rejected: tuple[tuple[str, str], ...]     # (backend, first failed rule) for each backend tried before


def sdpa_backend_problems(call: SdpaCall, backend: str, gpu: GpuSpec) -> tuple[str, ...]:
    """The rules of upstream `can_use_<backend>_attention` that `call` breaks on `gpu` (empty: usable)."""
    major, minor = gpu.sm
    low = call.dtype in ("float16", "bfloat16")
    problems: list[str] = []
    if backend == "math":
        return ()
    if call.seq_q == 0 or call.seq_k == 0:
        problems.append("zero-length sequence")
    if not call.last_dim_contiguous:
        problems.append("last dimension is not contiguous")
    if call.q_heads != call.kv_heads and not (call.enable_gqa and call.q_heads % call.kv_heads == 0):
        problems.append("different head counts for q and k/v without enable_gqa")
    if backend == "flash":
        if not (8, 0) <= gpu.sm <= (12, 1):
            problems.append(f"flash needs sm80..sm121, {gpu.name} is sm{major}{minor}")
        if call.has_mask:
            problems.append("flash takes no attn_mask")
        if not (call.head_dim_qk == call.head_dim_v and call.head_dim_qk <= 256):
            problems.append("flash needs equal q/k/v head dims <= 256")
        if call.dtype not in (("float16", "bfloat16") if major >= 8 else ("float16",)):
            problems.append(f"flash needs fp16/bf16, got {call.dtype}")
        if call.is_causal and call.seq_q != call.seq_k:
            problems.append("flash is_causal needs seq_q == seq_k")
        if call.requires_grad and ((8, 6) <= gpu.sm <= (8, 9) or (12, 0) <= gpu.sm <= (12, 1)):
            hd = call.head_dim_qk
            if not (hd <= 192 or (call.dropout_p == 0.0 and hd > 224)):
                problems.append("flash backward on sm86/89/120 does not support this head dim")
    elif backend == "efficient":
        if not (5, 0) <= gpu.sm <= (12, 1):
            problems.append(f"efficient needs sm50..sm121, {gpu.name} is sm{major}{minor}")
        alignment = _gemm_alignment(gpu, low)
        if call.head_dim_qk % alignment or call.head_dim_v % alignment:
            problems.append(f"efficient needs head dims divisible by {alignment}")
        allowed = ("float16", "float32", "bfloat16") if major >= 8 else ("float16", "float32")
        if call.dtype not in allowed:
            problems.append(f"efficient on sm{major}{minor} takes {', '.join(allowed)}, got {call.dtype}")
    elif backend == "cudnn":
        if not (8, 0) <= gpu.sm <= (12, 1):
            problems.append(f"cudnn needs sm80..sm121, {gpu.name} is sm{major}{minor}")
        if not low:
            problems.append(f"cudnn needs fp16/bf16, got {call.dtype}")
        if call.dropout_p * 16 != math.floor(call.dropout_p * 16):
            problems.append("cudnn dropout must be a multiple of 1/16")
        limit = 256 if major in (9, 10) else 128
        if call.head_dim_qk > limit or call.head_dim_v > limit or call.head_dim_qk % 8 or call.head_dim_v % 8:
            problems.append(f"cudnn needs head dims <= {limit} and divisible by 8")
        if call.seq_k == 1:
            problems.append("cudnn does not take key length 1")
    else:
        raise UsageError(f"unknown SDPA backend {backend!r}", hint=f"valid: {', '.join(SDPA_BACKENDS)}")
    return tuple(problems)


def _gemm_alignment(gpu: GpuSpec, half: bool) -> int:
    """upstream minimum_gemm_alignment: 4 on sm80+, raised to 128 bits / element with tensor cores."""
    alignment = 4 if gpu.sm[0] >= 8 else 1
    tensor_cores = gpu.sm[0] >= 8 or (gpu.sm[0] >= 7 and half)
    return max(alignment, 128 // (16 if half else 32)) if tensor_cores else alignment


def choose_sdpa_backend(call: SdpaCall, gpu: GpuSpec, priority: tuple[str, ...] = DEFAULT_SDPA_PRIORITY) -> SdpaChoice:
    """The backend `select_sdp_backend` picks: the first in `priority` whose rules `call` passes.

    Default priority is PyTorch's (flash, efficient, math, cudnn); recent builds move cudnn first on
    sm90/sm100 when the runtime cuDNN is newer than 9.15 (`check_prefer_cudnn_attention`): pass
    priority=("cudnn", "flash", "efficient", "math") for that."""
    rejected = []
    for backend in priority:
        problems = sdpa_backend_problems(call, backend, gpu)
        if not problems:
            return SdpaChoice(backend, tuple(rejected))
        rejected.append((backend, problems[0]))
    return SdpaChoice("math", tuple(rejected))


# ---------------------------------------------------------------------------------------------- CUDA autocast lists

# upstream aten/src/ATen/autocast_mode.h for CUDA, by cast policy. Overload names as the dispatcher spells them.
_LOWER = ("_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
          "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "cudnn_convolution",
          "cudnn_convolution_transpose", "prelu", "addmm", "addmv", "addr", "matmul", "einsum", "mm", "mv",
          "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul", "linalg_multi_dot",
          "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell", "rnn_tanh_cell",
          "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention")
_FP32 = ("acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
         "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
         "native_layer_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
         "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
         "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
         "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
         "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
         "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
         "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
         "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
         "rms_norm")
_FP32_SET_OPT_DTYPE = ("prod", "prod.dim_int", "softmax.int", "log_softmax.int", "cumprod", "cumsum",
                       "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum",
                       "sum.dim_IntList")
_FP32_APPEND_DTYPE = {"norm.Scalar": "norm.ScalarOpt_dtype", "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype"}
_PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
            "tensordot", "scatter_add")
_BANNED = ("binary_cross_entropy",)

CUDA_AUTOCAST_POLICY: dict[str, str] = {
    **dict.fromkeys(_LOWER, "lower_precision_fp"), **dict.fromkeys(_FP32, "fp32"),
    **dict.fromkeys(_FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
    **dict.fromkeys(_FP32_APPEND_DTYPE, "fp32_append_dtype"),
    **dict.fromkeys(_PROMOTE, "promote"), **dict.fromkeys(_BANNED, "banned"),
}


# ---------------------------------------------------------------------------------------------- capture context

@dataclasses.dataclass
class CaptureLog:
    """What a cuda capture did (filled while tracing): one entry per SDPA call. `cast_cache`: autocast's
    weight-cast cache as eager keeps it (id of the fp32 leaf -> (a weak reference to it, its cast)), when
    the capture keeps one (`cuda_capture(..., cast_cache=True)`); `clear_casts()` is autocast's exit."""
    sdpa: list[tuple[SdpaCall, SdpaChoice]] = dataclasses.field(default_factory=list)
    cast_cache: dict | None = None

    def clear_casts(self) -> None:
        if self.cast_cache is not None:
            self.cast_cache.clear()


@contextlib.contextmanager
def cuda_capture(target: Target, precision: str, *, cast_cache: bool = False):
    """Within: SDPA calls the CUDA op the rules pick, and bf16 autocast follows CUDA's lists. Yields a
    CaptureLog. Nothing is changed for a cpu target. Registrations are removed on exit. `cast_cache`: the
    autocast kernels cache the casts of fp32 leaves that require grad as eager's `cached_cast` does (a step
    run op by op; a traced graph gets the cache from capture/autocast_cache.py instead)."""
    log = CaptureLog(cast_cache={} if cast_cache else None)
    if not target.is_cuda:
        yield log
        return
    import torch

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            lib.impl("scaled_dot_product_attention", _sdpa_kernel(target.gpu, log), "CompositeImplicitAutograd")
            from tracer.capture.precision import autocast_dtype
            if autocast_dtype(precision) is not None:
                _register_cuda_autocast(lib, autocast_dtype(precision), log.cast_cache)
        yield log
    finally:
        lib._destroy()


@contextlib.contextmanager
def cuda_eager_kernels(target: Target):
    """Within, for a step run op by op (dispatch.py) on CPU fakes for a CUDA target: `aten.dropout` in
    training takes CUDA eager's fused kernel, `native_dropout` (a bool mask saved for backward), where the CPU
    kernel draws a noise tensor of the input's dtype: `at::dropout` picks by `input.is_cuda()`. (A traced
    graph already gets `native_dropout`: eager_kernels.dropout_as_in_eager.) Nothing changes for a cpu
    target; the registration is removed on exit."""
    if not target.is_cuda:
        yield
        return
    import torch

    def dropout(input, p, train):
        if not train or p == 0 or input.numel() == 0:
            return input
        if p == 1:                     # the fused kernel takes 0 < p < 1; at::dropout multiplies by a 0-dim zero
            return input * torch.zeros((), dtype=input.dtype, device=input.device)
        return torch.ops.aten.native_dropout.default(input, p, train)[0]

    lib = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*[Oo]verrid.*")
            lib.impl("dropout", dropout, "CompositeImplicitAutograd")
        yield
    finally:
        lib._destroy()


@contextlib.contextmanager
def cuda_optimizer_defaults(target: Target):
    """Within: an optimizer built without `foreach=`/`fused=` picks what it picks on CUDA (foreach: every
    parameter on a foreach-capable device), although the fake parameters live on CPU, where it would pick
    the for-loop. `torch.optim.optimizer._default_to_fused_or_foreach` reads the device list and the
    tensor types at call time; both are widened for the capture only. Nothing changes for a cpu target."""
    if not target.is_cuda:
        yield
        return
    import torch.optim.optimizer as optimizer_module
    from torch._subclasses.fake_tensor import FakeTensor

    devices = optimizer_module._get_foreach_kernels_supported_devices
    types = optimizer_module._foreach_supported_types
    optimizer_module._get_foreach_kernels_supported_devices = lambda: [*devices(), "cpu"]
    added = FakeTensor not in types
    if added:
        types.append(FakeTensor)
    try:
        yield
    finally:
        optimizer_module._get_foreach_kernels_supported_devices = devices
        if added:
            types.remove(FakeTensor)


def _register_cuda_autocast(lib, lower_dtype, cast_cache: dict | None = None) -> None:
    import torch

    covered = set()
    for name, policy in CUDA_AUTOCAST_POLICY.items():
        op = _overload(name)
        if op is None:
            continue
        lib.impl(name, _autocast_kernel(op, policy, lower_dtype, cast_cache), "AutocastCPU")
        covered.add(op._schema.name + ("." + op._schema.overload_name if op._schema.overload_name else ""))
    # Ops on CPU's lists only are not cast on CUDA: they fall through to their kernel, and a composite
    # one (cross_entropy_loss) decomposes with autocast still active, so the ops it calls (log_softmax,
    # on CUDA's fp32 list) are cast as CUDA casts them.
    for qualified in torch._C._dispatch_get_all_op_names():
        if qualified.startswith("aten::") and qualified not in covered and \
                torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "AutocastCPU"):
            if _overload(qualified.removeprefix("aten::")) is not None:
                lib.impl(qualified.removeprefix("aten::"), torch.library.fallthrough_kernel, "AutocastCPU")


def _overload(name: str):
    import torch
    packet, _, overload = name.partition(".")
    packet_op = getattr(torch.ops.aten, packet, None)
    return None if packet_op is None else getattr(packet_op, overload or "default", None)


def _autocast_kernel(op, policy: str, lower_dtype, cast_cache: dict | None = None):
    import weakref

    import torch

    key_set = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
    dtype_position = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)

    def eligible(t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64

    def cached(t, dtype) -> bool:        # ATen's `cached_cast` condition
        return (cast_cache is not None and dtype == lower_dtype and t.dtype == torch.float32 and t.requires_grad
                and t.is_leaf and not t._is_view() and torch.is_autocast_cache_enabled())

    def cast(obj, dtype):
        if eligible(obj) and obj.dtype != dtype and cached(obj, dtype):
            entry = cast_cache.get(id(obj))
            if entry is None or entry[0]() is not obj:
                entry = cast_cache[id(obj)] = (weakref.ref(obj), obj.to(dtype))
            return entry[1]
        if eligible(obj):
            return obj.to(dtype) if obj.dtype != dtype else obj
        if isinstance(obj, (list, tuple)):
            return type(obj)(cast(o, dtype) for o in obj)
        return obj

    def kernel(*args, **kwargs):
        if policy == "banned":
            raise RuntimeError(f"{op} is unsafe to autocast on CUDA (use the *_with_logits variant)")
        if policy == "lower_precision_fp":
            args, kwargs = cast(args, lower_dtype), {k: cast(v, lower_dtype) for k, v in kwargs.items()}
        elif policy == "fp32":
            args, kwargs = cast(args, torch.float32), {k: cast(v, torch.float32) for k, v in kwargs.items()}
        elif policy == "fp32_set_opt_dtype":        # an explicit dtype (by keyword or position) is kept
            if args and eligible(args[0]):
                if dtype_position is not None and len(args) > dtype_position:
                    if args[dtype_position] is None:
                        args = args[:dtype_position] + (torch.float32,) + args[dtype_position + 1:]
                elif kwargs.get("dtype") is None:
                    kwargs = {**kwargs, "dtype": torch.float32}
        elif policy == "promote":
            floats = [t.dtype for t in _tensors((args, kwargs)) if eligible(t)]
            if floats:
                widest = lower_dtype
                for dtype in floats:
                    widest = torch.promote_types(widest, dtype)
                args, kwargs = cast(args, widest), {k: cast(v, widest) for k, v in kwargs.items()}
        target_op = op
        if policy == "fp32_append_dtype" and args and eligible(args[0]):
            target_op = _overload(_FP32_APPEND_DTYPE[f"{op._schema.name.removeprefix('aten::')}.{op._overloadname}"])
            kwargs = {**kwargs, "dtype": torch.float32}
        with torch._C._ExcludeDispatchKeyGuard(key_set):
            return target_op(*args, **kwargs)

    return kernel


def _tensors(obj):
    import torch
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for o in obj:
            yield from _tensors(o)
    elif isinstance(obj, dict):
        for o in obj.values():
            yield from _tensors(o)


def _sdpa_kernel(gpu: GpuSpec, log: CaptureLog):
    """aten.scaled_dot_product_attention as attention.cpp runs it on CUDA, for the backend the rules pick."""
    import torch

    aten = torch.ops.aten

    def kernel(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        call = SdpaCall(
            dtype=str(query.dtype).removeprefix("torch."), batch=int(query.shape[0]), q_heads=int(query.shape[-3]),
            kv_heads=int(key.shape[-3]), seq_q=int(query.shape[-2]), seq_k=int(key.shape[-2]),
            head_dim_qk=int(query.shape[-1]), head_dim_v=int(value.shape[-1]), has_mask=attn_mask is not None,
            dropout_p=float(dropout_p), is_causal=bool(is_causal),
            requires_grad=torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)),
            enable_gqa=bool(enable_gqa), last_dim_contiguous=all(t.stride(-1) == 1 for t in (query, key, value)))
        choice = choose_sdpa_backend(call, gpu)
        log.sdpa.append((call, choice))
        if choice.backend == "math" or query.dim() != 4:
            return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal,
                                                           None, scale=scale, enable_gqa=enable_gqa)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            neg_inf = torch.scalar_tensor(float("-inf"), dtype=query.dtype)
            attn_mask = torch.where(attn_mask, 0.0, neg_inf)           # convert_boolean_attn_mask
        if choice.backend == "flash":
            head_dim = query.shape[-1]
            if head_dim % 8:                                            # pad_last_dim<8>, then slice
                pad = 8 - head_dim % 8
                query, key, value = (torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value))
            scale = scale if scale is not None else 1.0 / math.sqrt(head_dim)
            out = aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False,
                                                           scale=scale)[0]
            return out[..., :head_dim] if out.shape[-1] != head_dim else out
        if call.q_heads != call.kv_heads:                               # the efficient/cudnn metas need equal heads
            key = key.repeat_interleave(call.q_heads // call.kv_heads, dim=-3)
            value = value.repeat_interleave(call.q_heads // call.kv_heads, dim=-3)
        if choice.backend == "efficient":
            if attn_mask is not None:                                   # preprocess_mask: pad unaligned, expand
                if any(s % 8 for s in attn_mask.stride()[:-1]) or attn_mask.stride(-1) != 1:
                    last = attn_mask.shape[-1]
                    attn_mask = torch.nn.functional.pad(attn_mask, (0, 8 - last % 8))[..., :last]
                attn_mask = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
            return aten._scaled_dot_product_efficient_attention(query, key, value, attn_mask, call.requires_grad,
                                                                dropout_p, is_causal, scale=scale)[0]
        return aten._scaled_dot_product_cudnn_attention(query, key, value, attn_mask, call.requires_grad, dropout_p,
                                                        is_causal, False, scale=scale)[0]

    return kernel
