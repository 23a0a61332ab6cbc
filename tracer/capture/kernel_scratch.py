"""Kernel-internal scratch of extern CPU kernels that compiled code calls: bytes a kernel allocates through
the allocator and frees before it returns, invisible to the dispatcher (so to every graph) but live while
the kernel runs, and at a compiled step's backward peak when that peak is an attention backward.

`scratch_allocations(node, threads)` -> the sizes in bytes of the scratch tensors one call of the fx node's
kernel allocates (a wrapper of checkpointing's RNG replay, `run_and_save_rng_state` /
`run_with_rng_state`, is the kernel it wraps), () for kernels with no known scratch. Registered: ATen's
CPU flash attention (FlashAttentionKernel.cpp), which splits queries into blocks of 32, 64 or 256 rows
(query length < 192, < 768, longer) and keys into blocks of at most 512, and allocates per thread of the
intra-op pool (`threads`, torch.get_num_threads() of the run):
  * forward: one fp32 buffer of threads x (q_block x kv_block + 2 x q_block + q_block x head_dim);
  * backward: one fp32 buffer of threads x 2 x q_block x kv_block, a contiguous copy of the output's
    gradient when its (batch, seq, heads, dim) view is not contiguous, and a fp32 row sum of q_block
    values in each thread (the profiler records only the calling thread's: its events of a
    2-thread run are one row sum short of this).
Measured on real CPU kernels (tests/capture/test_kernel_scratch.py). fp32 and fp64 only: bf16/fp16 runs
add reduced-precision copies and per-block temporaries (and fp16 oneDNN packing on AMX CPUs) that are not
modelled (no scratch is returned for them), nor is the scratch of other extern kernels (oneDNN matmul,
CUDA attention).

`eager_scratch_allocations(target, args, kwargs)` -> the same for an op run eagerly on the CPU (the optimizer
step's recorded ops and the op-by-op rung's, for `--target cpu` only: a CUDA step runs cuSOLVER instead). Registered: LAPACK's symmetric eigensolver behind
`torch.linalg.eigh` (`_linalg_eigh` with eigenvectors; BatchLinearAlgebra.cpp `apply_lapack_eigh`), which
asks LAPACK for its workspace once per call and allocates it through the allocator: `syevd` with eigenvectors
takes 2n^2 + 6n + 1 elements of the matrix's dtype and 5n + 3 ints (LAPACK's documented minimum; torch's
CPU build answers one element more, measured at n = 2 to 1,024 in fp32 and fp64, batched or not:
tests/capture/test_kernel_scratch.py). Eigenvalues alone (`eigvalsh`), complex matrices, n < 2 and CUDA's
cuSOLVER workspaces are not modelled. Also registered, for eager calls and compiled code's extern kernels
alike: `torch.linalg.qr` (modes "reduced" and "complete", fp32 and fp64): tau, then geqrf's and orgqr's work
arrays in turn, sized by asking the LAPACK inside torch's CPU library (`lapack_workspace_elements`, a
workspace query through ctypes: the block sizes are that build's own, so no formula is guessed).

`unmodelled_scratch_notes(ops, cpu=...)` -> a `note:` naming the kernels of a CPU step whose scratch is known
to exist and is not counted: LAPACK's other decompositions (QR in mode "r" or complex, SVD, eigenvalues
alone), oneDNN's scratchpad for reduced-precision matmuls (260,736 B for a bf16 1000 x 1024 @ 1024 x 1000
on 2 threads; its size comes from oneDNN's primitive descriptor, which torch's CPU library does not export,
so no query can ask it), and torch._scaled_mm, which a CPU without a float8 oneDNN kernel emulates: a
contiguous copy of the second operand, float copies of both operands scaled, and a float product, inside
the kernel (measured at 512 x 64 @ 64 x 256: 1,261,568 B at the kernel's peak for a 524,288 B output).
"""
from __future__ import annotations

import functools

import torch
import torch.fx as fx

from tracer.capture.meta import rng_wrapped_call

_FLASH_FORWARD = "aten._scaled_dot_product_flash_attention_for_cpu.default"
_FLASH_BACKWARD = "aten._scaled_dot_product_flash_attention_for_cpu_backward.default"
_KV_BLOCK_ROWS = 512
_MODELLED_DTYPES = (torch.float32, torch.float64)


def scratch_allocations(node: fx.Node, threads: int) -> tuple[int, ...]:
    target, args = _kernel_call(node)
    values = [a.meta.get("val") if isinstance(a, fx.Node) else a for a in args]
    if target == _FLASH_FORWARD:
        return _flash_forward_scratch(values[0], values[1], threads)
    if target == _FLASH_BACKWARD:
        return _flash_backward_scratch(values[0], values[1], values[2], threads)
    if target == _QR:
        return _lapack_qr_scratch(values[0], _qr_mode(values, dict(node.kwargs)))
    return ()


def eager_scratch_allocations(target: str, args: tuple, kwargs: dict) -> tuple[int, ...]:
    """Scratch of one eager CPU kernel call, from its (fake) arguments; () where none is known."""
    if target == _EIGH:
        return _lapack_eigh_scratch(args[0], _eigh_computes_vectors(args, kwargs))
    if target == _QR:
        return _lapack_qr_scratch(args[0], _qr_mode(args, kwargs))
    return ()


_QR = "aten.linalg_qr.default"
_SCALED_MM = "aten._scaled_mm.default"
_LAPACK_PREFIX = {torch.float32: "S", torch.float64: "D"}


def _qr_mode(args, kwargs: dict) -> str:
    return str(kwargs.get("mode", args[1] if len(args) > 1 else "reduced"))


def _lapack_qr_scratch(matrix, mode: str) -> tuple[int, ...]:
    """`linalg_qr` on the CPU (BatchLinearAlgebra.cpp): tau (min(m, n) values per matrix) lives through the
    call; geqrf's workspace, then orgqr's (which forms Q's m x min(m, n), or m x m for "complete", columns),
    are allocated and freed in turn, each one element longer than LAPACK's answer to a workspace query (one
    query per call, batched or not). Mode "r" (no Q) is not modelled."""
    if (not isinstance(matrix, torch.Tensor) or matrix.dtype not in _LAPACK_PREFIX or mode not in ("reduced", "complete")
            or matrix.dim() < 2):
        return ()
    m, n = int(matrix.shape[-2]), int(matrix.shape[-1])
    k = min(m, n)
    prefix = _LAPACK_PREFIX[matrix.dtype]
    geqrf = lapack_workspace_elements(f"{prefix}GEQRF", m, n) if k else 0
    orgqr = lapack_workspace_elements(f"{prefix}ORGQR", m, m if mode == "complete" else k, k) if k else 0
    if geqrf is None or orgqr is None or not k:
        return ()
    batch = matrix.numel() // (m * n) if m * n else 0
    return (batch * k * matrix.element_size(), (max(geqrf, orgqr) + 1) * matrix.element_size())


@functools.lru_cache(maxsize=None)
def lapack_workspace_elements(routine: str, m: int, n: int, k: int | None = None) -> int | None:
    """LAPACK's optimal workspace for `routine` (Fortran name: SGEQRF, DORGQR, ...) at these sizes, asked
    of the LAPACK inside torch's CPU library by a workspace query (lwork = -1: nothing is computed, no
    matrix is read); None where that library does not export the routine (then the scratch is not counted
    and the report says so)."""
    import ctypes
    import os

    library = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        function = getattr(ctypes.CDLL(library), routine)
    except (OSError, AttributeError):
        return None
    ctype = ctypes.c_float if routine[0] == "S" else ctypes.c_double
    work, dummy = (ctype * 2)(), (ctype * 1)()
    ints = [ctypes.c_int(v) for v in (m, n) + (() if k is None else (k,)) + (max(1, m), -1, 0)]
    *sizes, lda, lwork, info = ints
    function(*(ctypes.byref(v) for v in sizes), dummy, ctypes.byref(lda), dummy, work, ctypes.byref(lwork),
             ctypes.byref(info))
    return int(work[0]) if info.value == 0 else None


_EIGH = "aten._linalg_eigh.default"
_INT32_BYTES = 4


def _lapack_eigh_scratch(matrix, compute_v: bool) -> tuple[int, ...]:
    if not isinstance(matrix, torch.Tensor) or matrix.is_complex() or not compute_v or matrix.shape[-1] < 2:
        return ()
    n = int(matrix.shape[-1])
    return ((2 * n * n + 6 * n + 2) * matrix.element_size(), (5 * n + 3) * _INT32_BYTES)


_LAPACK_UNMODELLED = {
    "aten.linalg_qr.default": "torch.linalg.qr (LAPACK's geqrf workspace, mode \"r\" or complex)",
    "aten._linalg_svd.default": "torch.linalg.svd (LAPACK's gesdd workspace)",
    "aten._linalg_eigh.default": "torch.linalg.eigvalsh (LAPACK's syevd workspace without eigenvectors)",
}
_ONEDNN_MATMULS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.bmm.default", "aten.baddbmm.default"})
_REDUCED = frozenset({"bfloat16", "float16"})


def unmodelled_scratch_notes(ops, *, cpu: bool) -> tuple[str, ...]:
    """One note naming the CPU kernels in `ops` (OpNodes) whose own workspace is not counted, or ()."""
    if not cpu:
        return ()
    named: dict[str, int] = {}
    for op in ops:
        values = op.input_values()
        if op.target == _QR and _qr_counted(op):
            continue
        if op.target in _LAPACK_UNMODELLED and (op.target != _EIGH or not _eigh_computes_vectors(op.args, dict(op.kwargs))):
            named[_LAPACK_UNMODELLED[op.target]] = named.get(_LAPACK_UNMODELLED[op.target], 0) + 1
        elif op.target in _ONEDNN_MATMULS and values and values[0].dtype in _REDUCED:
            label = "reduced-precision matmuls (oneDNN's scratchpad)"
            named[label] = named.get(label, 0) + 1
        elif op.target == _SCALED_MM:
            label = "torch._scaled_mm (emulated on this CPU: float copies of both operands and a float product)"
            named[label] = named.get(label, 0) + 1
    if not named:
        return ()
    listed = ", ".join(f"{label} x{count}" for label, count in named.items())
    return (f"kernel scratch not counted: {listed} allocate a workspace inside the kernel that the CPU allocator "
            "sees and this step does not (each call's peak is low by that workspace: hundreds of KB at a "
            "1000 x 1000 matrix)",)


def _qr_counted(op) -> bool:
    """Whether a recorded QR's scratch is in the step: `_lapack_qr_scratch` models its dtype and mode here."""
    values = op.input_values()
    if not values or not values[0].dtype.startswith("float"):
        return False
    matrix = torch.empty(values[0].shape, dtype=getattr(torch, values[0].dtype), device="meta")
    return bool(_lapack_qr_scratch(matrix, _qr_mode(op.args, dict(op.kwargs))))


def _eigh_computes_vectors(args, kwargs: dict) -> bool:
    """`_linalg_eigh(A, UPLO="L", compute_v=True)`: whether the call asks for eigenvectors."""
    return bool(kwargs.get("compute_v", args[2] if len(args) > 2 else True))


def _kernel_call(node: fx.Node) -> tuple[str, tuple]:
    """(aten overload name, its arguments) of the kernel the node runs, through checkpointing's RNG wrappers."""
    call = rng_wrapped_call(node)
    return (str(node.target), node.args) if call is None else (str(call[0]), call[1])


def _query_block_rows(query_len: int) -> int:
    block = 256 if query_len >= 768 else 64 if query_len >= 192 else 32
    return min(block, query_len)


def _blocks(query, key) -> tuple[int, int, int] | None:
    """(query rows per block, key rows per block, fp32 accumulator bytes); None where not modelled.
    Shapes are (batch, heads, seq, head_dim)."""
    if not all(isinstance(t, torch.Tensor) for t in (query, key)) or query.dtype not in _MODELLED_DTYPES:
        return None
    accumulator_bytes = query.element_size()           # the accumulator of fp32 and fp64 is their own dtype
    return _query_block_rows(query.shape[2]), min(_KV_BLOCK_ROWS, key.shape[2]), accumulator_bytes


def _flash_forward_scratch(query, key, threads: int) -> tuple[int, ...]:
    blocks = _blocks(query, key)
    if blocks is None:
        return ()
    q_rows, kv_rows, accumulator_bytes = blocks
    head_dim = query.shape[3]
    per_thread = q_rows * kv_rows + 2 * q_rows + q_rows * head_dim     # scores, row max, row sum, output block
    return (threads * per_thread * accumulator_bytes,)


def _flash_backward_scratch(grad_out, query, key, threads: int) -> tuple[int, ...]:
    blocks = _blocks(query, key)
    if blocks is None or not isinstance(grad_out, torch.Tensor):
        return ()
    q_rows, kv_rows, accumulator_bytes = blocks
    scratch = [threads * 2 * q_rows * kv_rows * accumulator_bytes]     # attention and its gradient, per block
    if not grad_out.transpose(1, 2).is_contiguous():
        scratch.insert(0, grad_out.numel() * grad_out.element_size())    # the kernel's grad_out.contiguous()
    scratch += [q_rows * accumulator_bytes] * threads                    # each thread's row sums
    return tuple(scratch)
