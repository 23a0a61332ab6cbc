"""Context parallelism: the sequence split over N ranks, attention run as torch's ring attention runs it.

    ring_attention(ranks, seq)     while active (inside `process_group.rank_zero_of(ranks)`),
                                   `F.scaled_dot_product_attention` is torch's context-parallel attention
                                   over the N fake ranks, as `torch.distributed.tensor.experimental.
                                   context_parallel` installs it
    cpu_ring_kernels()             DTensor runs CPU's flash attention as the same ring (torch's handlers
                                   cover CUDA's kernels only)
    local_seq(seq, ranks)          the positions one rank holds
    no_ring_error(ranks, model)    the refusal for a model whose attention the split never reached

torch's `context_parallel(mesh, buffers=[tokens, labels, ...], buffer_seq_dims=[...])` shards the batch along
the sequence (each rank keeps `seq / N` positions; with causal attention and `seq` a multiple of 2N, head-tail
load balancing gives each rank two chunks, one from each end) and, while active, replaces
`F.scaled_dot_product_attention`: its query, key and value become DTensors sharded on the sequence, and the
attention kernels' DTensor handlers run a ring (`_templated_ring_attention`). The forward all-gathers every
rank's key and value once and runs the local kernel on each rank's block, merging the partial outputs through
their logsumexp in fp32; the backward gathers them again and passes the key and value gradients around the
ring with all-to-all. So a rank holds its share of every activation, the gathered key/value buffer, the
merge's fp32 temporaries, and what the kernels save (its local query, key, value, output and logsumexp).

`--cp N` captures that: the step is built and run as rank 0 of N fake ranks (process_group.py), its example
batch at `seq / N` positions (what `context_parallel` leaves each rank), and torch's own dispatcher is entered
with a device mesh over the fake group. Under fake tensors the ring's collectives, copies and merges are ops
like any other, so the capture records what rank 0 allocates and frees. On the CUDA target the attention
kernel the ring calls is the one PyTorch's rules pick (capture/target.py), as torch's handlers take it.

torch's handlers cover the CUDA kernels only (flash, efficient, cuDNN). A CPU step picks
`_scaled_dot_product_flash_attention_for_cpu`, which they do not know, so `ring_attention` adds a handler for
it and its backward that runs the same ring (`_templated_ring_attention` and its backward, torch's code) with
the CPU kernel. That is what makes the CPU target a ring too, and what the tests measure on two real gloo
processes: tracer's capture of the ring against a real step of it, byte for byte.

Assumed and not modelled: every rank holds what rank 0 holds (with load balancing, rank 0 runs the second
half of its queries against the other ranks' keys, the last rank all its queries against half of them: the
same bytes); attention through anything but `F.scaled_dot_product_attention` as a module attribute (a model
that imported the function itself, computes attention from matmuls, or uses FlexAttention is not split by
torch either, and is refused here when no attention was split); an attention mask (torch's ring takes
`is_causal` only); the model's own buffers that depend on the length (torch shards only the buffers the
training loop passes it: a rotary table sliced to the batch's length is the local length here, a full-length
table stays whole on both).
"""
from __future__ import annotations

import contextlib

from tracer.errors import UsageError

SEQ_DIM = 2           # torch's ring shards (batch, heads, seq, head_dim) on dim 2
CPU_FORWARD = "_scaled_dot_product_flash_attention_for_cpu"
CPU_BACKWARD = "_scaled_dot_product_flash_attention_for_cpu_backward"


def local_seq(seq: int, ranks: int) -> int:
    """The positions one of `ranks` context-parallel ranks holds. Raises UsageError when they do not divide."""
    if seq % ranks:
        raise UsageError(f"--cp {ranks}: --seq {seq} does not split evenly over {ranks} ranks",
                         hint=f"torch's context_parallel shards the sequence evenly; use a --seq that is a "
                              f"multiple of {2 * ranks} (the multiple that also load-balances causal attention)")
    return seq // ranks


def load_balanced(seq: int, ranks: int) -> bool:
    """torch's `context_parallel` balances causal attention (head-tail chunks) when the global length is a
    multiple of 2 x ranks (`_create_default_load_balancer`)."""
    return seq % (2 * ranks) == 0


@contextlib.contextmanager
def ring_attention(ranks: int, seq: int):
    """torch's context-parallel attention over the default group's `ranks` ranks while active, as
    `context_parallel` enters it (plus `cpu_ring_kernels`); nothing for one rank. `seq` is the global
    length (it decides load balancing)."""
    if ranks <= 1:
        yield
        return
    import torch
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    mesh = DeviceMesh("cpu", torch.arange(ranks))
    mode, balance = cp._dispatch_mode, cp._cp_options.enable_load_balance
    cp._dispatch_mode = cp._DispatchMode.MONKEY_PATCH
    cp._cp_options.enable_load_balance = load_balanced(seq, ranks)
    cp._enable_context_parallel_dispatcher_impl(seq_dim=SEQ_DIM, mesh=mesh)
    functional = torch.nn.functional
    ringed = functional.scaled_dot_product_attention          # torch's replacement
    functional.scaled_dot_product_attention = _without_mask(ringed)
    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    try:
        with cpu_ring_kernels():
            # the ring is Python code: inside the attention's autograd node in backward, one op's handler in
            # forward (capture/joint.py)
            dispatcher._custom_op_handlers = {op: _as_python_code(handler) if _is_ring_op(op) else handler
                                              for op, handler in dispatcher._custom_op_handlers.items()}
            yield
    finally:
        dispatcher._custom_op_handlers = handlers
        functional.scaled_dot_product_attention = ringed     # torch restores the original from its own
        cp._disable_context_parallel_dispatcher_impl()
        cp._dispatch_mode, cp._cp_options.enable_load_balance = mode, balance


MASK_REFUSAL = ("torch's context parallelism rings causal attention without a mask: this call passes attn_mask "
                "(a padding or causal mask the ring cannot split); call F.scaled_dot_product_attention(q, k, v, "
                "is_causal=True) without attn_mask, or drop --cp")


DROPOUT_REFUSAL = ("--cp: attention dropout inside the ring is not captured (CPU's attention kernels, which the "
                   "capture also runs, have no ring with dropout); set the attention dropout to 0 (hf: models: "
                   "--hf-config attn_pdrop=0 or attention_dropout=0), or drop --cp")


def _without_mask(ringed):
    """torch's ring attention, refusing in one line a call it cannot ring: one with an attention mask (torch's
    handlers refuse the efficient and cuDNN kernels' bias; the CPU and math paths fail on mixed DTensor and
    tensor arguments deep inside the kernel) or with dropout (CPU's flash kernel takes none, and the math
    path it falls back to fails the same way)."""
    import functools

    @functools.wraps(ringed)
    def attention(query, key, value, attn_mask=None, dropout_p=0.0, *args, **kwargs):
        if attn_mask is not None:
            raise NotImplementedError(MASK_REFUSAL)
        if dropout_p:
            raise NotImplementedError(DROPOUT_REFUSAL)
        return ringed(query, key, value, None, dropout_p, *args, **kwargs)
    return attention


@contextlib.contextmanager
def cpu_ring_kernels():
    """While active, DTensor runs CPU's flash attention and its backward, sharded on the sequence, as torch's
    ring (the handlers torch's context parallelism registers cover the CUDA kernels only). Enter it inside
    torch's `context_parallel(...)`, which replaces the handler table when it starts."""
    import torch
    from torch.distributed.tensor import DTensor

    dispatcher = DTensor._op_dispatcher
    handlers = dispatcher._custom_op_handlers
    aten = torch.ops.aten
    dispatcher._custom_op_handlers = {**handlers, getattr(aten, CPU_FORWARD).default: _cpu_ring_handler,
                                      getattr(aten, CPU_BACKWARD).default: _cpu_ring_handler}
    try:
        yield
    finally:
        dispatcher._custom_op_handlers = handlers


_RING_OPS = frozenset(f"aten::{name}" for name in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", CPU_FORWARD))


def _is_ring_op(op) -> bool:
    return op._schema.name.removesuffix("_backward") in _RING_OPS


def _as_python_code(handler):
    """The handler, as the joint trace sees Python code: in backward inside the attention's autograd node
    (`python_backward_code`), in forward as one op's handler (`subclass_op_handler`)."""
    def handle(op_call, args, kwargs):
        from tracer.capture.joint import python_backward_code, subclass_op_handler
        with python_backward_code(), subclass_op_handler(op_call) as outputs:
            result = handler(op_call, args, kwargs)
            outputs(result)
            return result
    return handle


def _cpu_ring_handler(op_call, args, kwargs):
    """The DTensor handler of CPU's flash attention and its backward: torch's ring with the CPU kernel."""
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp

    op_info = DTensor._op_dispatcher.unwrap_to_op_info(op_call, args, kwargs)
    mesh = op_info.compute_mesh
    bound = _bind(op_call, op_info.local_args, op_info.local_kwargs)
    if bound.get("attn_mask") is not None:
        raise NotImplementedError(MASK_REFUSAL)
    common = {"is_causal": bound["is_causal"], "dropout_p": bound["dropout_p"], "scale": bound["scale"]}
    if op_call._schema.name.endswith(CPU_BACKWARD):
        local = cp._templated_ring_attention_backward(
            mesh.get_group(), SEQ_DIM, op_call, grad_out=bound["grad_out"], grad_out_name="grad_out",
            query=bound["query"], key=bound["key"], value=bound["value"], out=bound["out"],
            logsumexp=bound["logsumexp"], **common)
    else:
        local = cp._templated_ring_attention(mesh.get_group(), SEQ_DIM, op_call, bound["query"], bound["key"],
                                             bound["value"], **common)
    return DTensor._op_dispatcher.wrap(tuple(local), tuple(_sequence_sharded(t, mesh) for t in local))


def _bind(op_call, args, kwargs) -> dict:
    """The op's arguments by name, defaults filled in."""
    bound = {}
    for i, argument in enumerate(op_call._schema.arguments):
        if i < len(args) and not argument.kwarg_only:
            bound[argument.name] = args[i]
        elif argument.name in kwargs:
            bound[argument.name] = kwargs[argument.name]
        else:
            bound[argument.name] = argument.default_value
    return bound


def _sequence_sharded(local, mesh):
    """The DTensor spec of a rank's block of a tensor sharded on the sequence dimension."""
    import torch
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    placements = (Shard(SEQ_DIM),)
    shape, stride = compute_global_tensor_info(local, mesh, placements)
    return DTensorSpec(mesh, placements, tensor_meta=TensorMeta(torch.Size(shape), tuple(stride), local.dtype))


def no_ring_error(ranks: int, model: str) -> UsageError:
    return UsageError(f"--cp {ranks}: {model} ran no attention that torch's context parallelism splits (no "
                      f"collective in the step), so each rank's attention would see only its own positions",
                      hint="call torch.nn.functional.scaled_dot_product_attention (as F.scaled_dot_product_"
                           "attention, with is_causal and no mask), which context_parallel replaces; or drop --cp")
