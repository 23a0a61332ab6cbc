"""Per-rank memory of one training step under data parallelism: DDP, ZeRO stages 1-3 and FSDP2.

    shard_memory(policy, strategy, world_size, *, reshard_after_forward=True, backend="nccl") -> ShardedMemory
    zero_model_state_bytes(parameter_count, strategy, world_size, ...) -> int   (the ZeRO paper's formula)

Every rank runs the analysed step on its own micro-batch (the analysed `batch` is per rank), so
activations and temporaries are those of the single-device analysis; what changes is the model state:

  strategy  optimizer state  gradients  parameters  FSDP2 buffers
  ddp       whole            whole      whole       -
  zero1     sharded          whole      whole       -
  zero2     sharded          sharded    whole       -
  zero3     sharded          sharded    sharded     -
  fsdp      sharded          sharded    sharded     all-gather output, reduce-scatter input

Sharding follows FSDP2's per-parameter rule: dim 0 is split in `world_size` chunks of ceil(d0 / N) rows
and padded to N chunks; the numbers are rank 0's (the largest shard). 0-dim tensors (Adam's `step`) and
buffers are not sharded. When the optimizer state is sharded the optimizer step runs on shards, so its
temporaries shrink the same way.

Units: the repeated blocks (`prefix.N` module paths; a module-less backward op, such as the autograd
engine summing a block's input gradients, belongs to the block before it) and the root (every other
parameter). A unit's forward (backward) runs from its first op to its last op that is not a view. For sharded gradients a unit's gradients are whole from their allocation until the unit's
backward ends (its post-backward reduce-scatter), then one shard each until they are freed. For sharded
parameters (zero3, fsdp) a unit's parameters are gathered whole (padded) before its first forward op
and, when `reshard_after_forward`, freed after its last one and gathered again before its first
backward op; they are freed after its backward. The root is gathered before the first op and kept until
the end of backward (FSDP2 never reshards the root after forward).

fsdp adds FSDP2's flat buffers with FSDP2's lifetimes (torch/distributed/fsdp/_fully_shard): the
all-gather output of a unit (its padded bytes) lives in forward until the next unit has copied its own
out (a local of `wait_for_unshard` holds it that long), and in backward from the prefetch issued at the
pre-backward of the unit that runs before it until its own copy-out; the reduce-scatter input (the
unit's padded gradient bytes) lives from its post-backward until the next unit's (the root's until the
end of backward). `foreach_reduce` frees a unit's whole gradients after copying them in, except the last
parameter's, which a loop variable holds until the reduce-scatter output exists. With backend="gloo",
the reduce-scatter also copies its input. tests/accuracy/test_fsdp.py matches a real 2-rank gloo
`fully_shard` step to the byte with these rules.

On CUDA each buffer is allocated on the stream FSDP2 allocates it on (the all-gather output on the
all-gather copy-in stream, the reduce-scatter output, which the sharded gradients are views of, on the
reduce-scatter stream, everything else on the default stream); the caching-allocator model keeps a pool
per stream (passes/allocator.py), so what one stream frees is not reused by another and reserved memory
grows accordingly. The lifetimes above already hold what FSDP2 holds instead of `record_stream`.

Not modelled: DDP's gradient bucket copies (gradient_as_bucket_view=False keeps a second copy of the
gradients), DeepSpeed's flat partitions and bucket sizes (zero1-3 use the per-parameter rule above and
FSDP2's unit schedule without its buffers), mixed-precision parameter copies, communication library
scratch memory, and the different shard sizes of the other ranks when a dim 0 does not divide.
"""
from __future__ import annotations

import collections
import dataclasses
import math

from tracer.errors import UsageError
from tracer.passes.attribution import MODEL_STATE_CATEGORIES
from tracer.passes.blocks import block_of, repeated_blocks
from tracer.passes.liveness import BEFORE_STEP
from tracer.stepgraph import Phase, StepGraph, StorageRole


@dataclasses.dataclass(frozen=True)
class ShardingRule:
    optimizer_state: bool
    gradients: bool
    parameters: bool
    communication_buffers: bool


STRATEGIES: dict[str, ShardingRule] = {
    "ddp": ShardingRule(optimizer_state=False, gradients=False, parameters=False, communication_buffers=False),
    "zero1": ShardingRule(optimizer_state=True, gradients=False, parameters=False, communication_buffers=False),
    "zero2": ShardingRule(optimizer_state=True, gradients=True, parameters=False, communication_buffers=False),
    "zero3": ShardingRule(optimizer_state=True, gradients=True, parameters=True, communication_buffers=False),
    "fsdp": ShardingRule(optimizer_state=True, gradients=True, parameters=True, communication_buffers=True),
}
BACKENDS = ("nccl", "gloo")
SHARDED_CATEGORIES = ("parameter", "unsharded_parameter", "gradient", "optimizer_state", "activation",
                      "temporary", "input", "caller_held", "communication")


@dataclasses.dataclass(frozen=True)
class Unit:
    """A group of parameters gathered and reduced together: one repeated block, or the root."""
    name: str                                   # "blocks.3"; "" for the root
    parameter_ids: tuple[int, ...]              # storage ids
    gradient_ids: tuple[int, ...]
    forward_ops: tuple[int, int] | None         # first and last forward op of the unit's modules
    backward_ops: tuple[int, int] | None        # first and last backward op (recomputation included)
    padded_bytes: int                           # the unit's parameters gathered, each padded to N chunks
    padded_gradient_bytes: int


@dataclasses.dataclass(frozen=True)
class ShardedMemory:
    strategy: str
    world_size: int
    peak_bytes: int                             # rank 0
    peak_phase: str
    peak_op_index: int                          # the op at or next to the peak (hooks run between ops)
    by_category_at_peak: dict[str, int]         # SHARDED_CATEGORIES
    phases: dict[str, int]                      # peak bytes per phase
    model_state_bytes: dict[str, int]           # per rank: parameter, gradient, optimizer_state (all of them)
    live_during: tuple[int, ...]                # per op: the most bytes live at it (its hooks included)
    units: tuple[Unit, ...]
    requests: tuple[tuple[str, int, int], ...] = ()   # rank 0's allocator request stream (passes/device.py)
    start_bytes: int = 0                        # live before the step


def zero_model_state_bytes(parameter_count: int, strategy: str, world_size: int, *, param_bytes: int = 2,
                           grad_bytes: int = 2, optimizer_bytes: int = 12) -> int:
    """Bytes of model state per rank as in the ZeRO paper (Rajbhandari et al. 2020, Figure 1): Psi
    parameters, 2 + 2 + K bytes each with mixed-precision Adam (K = 12: fp32 master weights, momentum and
    variance), the sharded parts divided by Nd and rounded up."""
    rule = _rule(strategy)
    total = 0
    for sharded, nbytes in ((rule.parameters, param_bytes), (rule.gradients, grad_bytes),
                            (rule.optimizer_state, optimizer_bytes)):
        total += -(-parameter_count * nbytes // world_size) if sharded else parameter_count * nbytes
    return total


def shard_bytes(shape: tuple[int, ...], nbytes: int, world_size: int) -> int:
    """Rank 0's shard of a tensor split on dim 0 in `world_size` chunks (FSDP2's Shard(0))."""
    numel = math.prod(shape)
    if not shape or numel == 0 or nbytes % numel:
        return nbytes
    rows = -(-shape[0] // world_size)
    return rows * (numel // shape[0]) * (nbytes // numel)


def _sharding_shapes(graph: StepGraph) -> list[tuple[int, ...]]:
    """The shape each storage is sharded by: a gradient's or an optimizer state's is its parameter's (the
    first tensor seen on a gradient storage may be a broadcast view, e.g. (1, 1, d) for a norm weight)."""
    param_shape = {s.name: s.shape for s in graph.storages if s.role is StorageRole.PARAMETER}
    shapes = []
    for s in graph.storages:
        owner = s.name.rsplit(".", 1)[0]
        if s.role in (StorageRole.GRADIENT, StorageRole.OPTIMIZER_STATE) and owner in param_shape \
                and math.prod(s.shape) == math.prod(param_shape[owner]):
            shapes.append(param_shape[owner])
        else:
            shapes.append(s.shape)
    return shapes


def find_units(graph: StepGraph, world_size: int, *, fp32_master: bool = False) -> tuple[Unit, ...]:
    """The root unit first, then the repeated blocks in forward order. `fp32_master`: gradients are
    reduce-scattered in fp32 (FSDP2 MixedPrecisionPolicy(reduce_dtype=float32))."""
    blocks = repeated_blocks(graph)
    unit_of_param: dict[str, str] = {}
    params_by_unit: dict[str, list[int]] = collections.defaultdict(list)
    grads_by_unit: dict[str, list[int]] = collections.defaultdict(list)
    for storage in graph.storages:
        if storage.role is StorageRole.PARAMETER:
            unit = block_of(storage.name, blocks)
            unit_of_param[storage.name] = unit
            params_by_unit[unit].append(storage.storage_id)
    for storage in graph.storages:
        if storage.role is StorageRole.GRADIENT:
            fqn = storage.name.removesuffix(".grad")
            grads_by_unit[unit_of_param.get(fqn, block_of(fqn, blocks))].append(storage.storage_id)
    forward: dict[str, list[int]] = {}
    backward: dict[str, list[int]] = {}
    previous = None                       # the block whose backward ops came last
    for op in graph.ops:
        if op.phase is Phase.OPTIMIZER:
            continue
        unit = block_of(op.module, blocks) if op.module else ""
        is_forward = op.phase is Phase.FORWARD and not op.recomputed
        if not is_forward and not op.module and previous is not None:
            unit = previous               # the engine summing the gradients of the block's input
        span = forward if is_forward else backward
        first_last = span.setdefault(unit, [op.index, op.index])
        if not op.is_view:
            # a view allocates and frees nothing; compiled graphs end their forward with detaches of saved
            # activations attributed to the blocks that made them, which must not keep every block gathered
            first_last[1] = op.index
        previous = unit if not is_forward and unit else None
    units = []
    shapes = _sharding_shapes(graph)
    for name in [""] + blocks:
        padded = sum(shard_bytes(shapes[s], graph.storage(s).nbytes, world_size) * world_size
                     for s in params_by_unit[name])
        padded_grads = sum(_master_bytes(shard_bytes(shapes[s], graph.storage(s).nbytes, world_size) * world_size,
                                         graph.storage(s).dtype, fp32_master)
                           for s in grads_by_unit[name])
        units.append(Unit(name=name, parameter_ids=tuple(params_by_unit[name]),
                          gradient_ids=tuple(grads_by_unit[name]),
                          forward_ops=tuple(forward[name]) if name in forward else None,
                          backward_ops=tuple(backward[name]) if name in backward else None,
                          padded_bytes=padded, padded_gradient_bytes=padded_grads))
    return tuple(units)


def _master_bytes(nbytes: int, dtype: str, fp32_master: bool) -> int:
    """Bytes of a bf16 tensor's fp32 master copy under FSDP2 mixed precision, else `nbytes`."""
    return nbytes * 2 if fp32_master and dtype == "bfloat16" else nbytes


def shard_memory(policy, strategy: str, world_size: int, *, reshard_after_forward: bool = True,
                 backend: str = "nccl", fp32_master: bool = False) -> ShardedMemory:
    """Per-rank memory of `policy` (a `PolicyAnalysis`) under `strategy` on `world_size` ranks.

    `backend` "gloo" adds the copy of the reduce-scatter input that gloo's `_reduce_scatter_base` makes
    (it all-reduces a copy, then keeps its chunk); "nccl" reduce-scatters in place.
    `fp32_master` (fsdp only): FSDP2 MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) on a
    step captured with bf16 parameters (bf16-pure): the computation, the gathered parameters and the
    unsharded gradients are the captured bf16 ones; the sharded parameters, the sharded gradients, the
    optimizer state and the optimizer's temporaries are fp32 (twice the captured bf16 bytes), and each
    unit's reduce-scatter input is fp32.
    Raises UsageError for an unknown strategy or backend, or a world size below 1."""
    if world_size < 1:
        raise UsageError(f"the world size must be a positive integer, not {world_size}")
    if backend not in BACKENDS:
        raise UsageError(f"unknown process-group backend {backend!r}", hint=f"valid: {', '.join(BACKENDS)}")
    rule = _rule(strategy)
    if fp32_master and strategy != "fsdp":
        raise UsageError(f"fp32 master weights with bf16 compute are FSDP2's mixed precision: --shard fsdp, not {strategy}")
    graph, liveness = policy.graph, policy.liveness
    units = find_units(graph, world_size, fp32_master=fp32_master)
    events = _Events()
    grad_unit_end = _gradient_reduce_points(units, graph, rule)
    opt_start = next((op.index for op in graph.ops if op.phase is Phase.OPTIMIZER), len(graph.ops))
    model_state = dict.fromkeys(MODEL_STATE_CATEGORIES, 0)
    shapes = _sharding_shapes(graph)
    for sid, iv in enumerate(liveness.intervals):
        if iv.alloc_op is None:
            continue
        storage = graph.storage(sid)
        category = policy.categories[sid]
        whole = iv.nbytes
        shard = _master_bytes(shard_bytes(shapes[sid], whole, world_size), storage.dtype, fp32_master)
        start = _BEFORE if iv.alloc_op == BEFORE_STEP else (iv.alloc_op, _ALLOC, 0)
        end = None if iv.free_op is None else (iv.free_op, _FREE, 0)
        nbytes, stream = whole, _DEFAULT_STREAM
        if storage.role is StorageRole.PARAMETER and rule.parameters:
            nbytes = shard
        elif storage.role is StorageRole.OPTIMIZER_STATE and rule.optimizer_state:
            nbytes = shard
        elif storage.role is StorageRole.INTERMEDIATE and rule.optimizer_state and iv.alloc_op >= opt_start:
            nbytes = shard
        elif storage.role is StorageRole.GRADIENT and sid in grad_unit_end:
            reduced = grad_unit_end[sid]
            if start == _BEFORE or reduced is None or reduced[0] < start:
                nbytes = shard         # kept from the previous step (zero_grad(set_to_none=False)): a shard
                stream = _REDUCE_SCATTER_STREAM if rule.communication_buffers and reduced is not None else stream
            else:
                events.interval(start, reduced[0], whole, category)
                start, nbytes = reduced[1], shard
                # FSDP2's reduce-scatter output (the sharded gradient) is allocated on its stream
                stream = _REDUCE_SCATTER_STREAM if rule.communication_buffers else _DEFAULT_STREAM
        if category in model_state:
            model_state[category] += nbytes
        events.interval(start, end, nbytes, category, stream)
    if rule.parameters:
        _gathered_parameters(events, units, graph, rule, reshard_after_forward, copy_rs_input=backend == "gloo")
    peak, at_peak, phases, live_during = events.sweep(graph)
    peak_bytes, peak_key = peak
    op_index = min(max(peak_key[0], 0), len(graph.ops) - 1) if graph.ops else 0
    phase = graph.ops[op_index].phase.value if graph.ops else "forward"
    return ShardedMemory(strategy=strategy, world_size=world_size, peak_bytes=peak_bytes, peak_phase=phase,
                         peak_op_index=op_index, by_category_at_peak=at_peak, phases=phases,
                         model_state_bytes=model_state, live_during=live_during, units=units,
                         requests=events.request_stream(),
                         start_bytes=sum(delta for key, delta, _, _ in events.items if key == _BEFORE))


# The CUDA streams FSDP2 allocates on (torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py): the
# all-gather output on the all-gather copy-in stream (forward and pre-backward, implicit prefetching), the
# reduce-scatter output (the sharded gradient) on the reduce-scatter stream; the reduce-scatter input and
# the unsharded parameters (copy-out) on the default stream.
_DEFAULT_STREAM, _ALL_GATHER_STREAM, _REDUCE_SCATTER_STREAM = 0, 1, 2

# Event keys: (op index, slot, order). Hooks run before an op's outputs are allocated (_PRE) or after its
# frees (_POST); pre-existing storages are allocated at _BEFORE.
_PRE, _ALLOC, _FREE, _POST = 0, 1, 2, 3
_BEFORE = (BEFORE_STEP, _PRE, 0)
# order of the steps of a post-backward (FSDPParamGroup.post_backward, foreach_reduce)
_RESHARD, _POP_RS_INPUT, _RS_INPUT, _CLEAR_GRADS, _SHARDED_GRADS, _RS_COPY, _RS_COPY_FREED, _HELD_GRAD_FREED = range(8)
_ROOT_FINAL = 10                                # the root's post-backward runs in autograd's final callback
_BACKWARD_END = _ROOT_FINAL + 9                 # the final callback then drops the last reduce-scatter input


class _Events:
    def __init__(self) -> None:
        self.items: list[tuple[tuple, int, str, int]] = []     # (key, bytes, category, stream)

    def add(self, key: tuple, delta: int, category: str, stream: int = 0) -> None:
        if delta:
            self.items.append((key, delta, category, stream))

    def interval(self, start: tuple, end: tuple | None, nbytes: int, category: str, stream: int = 0) -> None:
        self.add(start, nbytes, category, stream)
        if end is not None:
            self.add(end, -nbytes, category, stream)

    def request_stream(self) -> tuple[tuple, ...]:
        """The events as caching-allocator requests, in the sweep's order: each allocation is a block (on
        its stream, when not the default one), and a release frees the oldest live block of its category,
        size and stream (blocks of one size are interchangeable for the bytes; only where they land may
        differ)."""
        live: dict[tuple[str, int, int], collections.deque] = collections.defaultdict(collections.deque)
        out: list[tuple] = []
        for block, (key, delta, category, stream) in enumerate(sorted(self.items, key=lambda e: (e[0], e[1] < 0))):
            if delta > 0:
                live[(category, delta, stream)].append(block)
                out.append(("alloc", block, delta, stream) if stream else ("alloc", block, delta))
            elif live[(category, -delta, stream)]:
                out.append(("free", live[(category, -delta, stream)].popleft(), 0))
        return tuple(out)

    def sweep(self, graph: StepGraph):
        """Running sum in key order (allocations before frees at the same key): the peak, its key, the
        bytes by category at the peak, the peak of each phase and the most bytes live at each op."""
        live = dict.fromkeys(SHARDED_CATEGORIES, 0)
        total = 0
        best = (-1, _BEFORE)
        at_peak = dict(live)
        during = [0] * len(graph.ops)
        filled = -1                             # ops up to here have their `during` set
        for key, delta, category, _ in sorted(self.items, key=lambda e: (e[0], e[1] < 0)):
            index = min(max(key[0], 0), len(graph.ops) - 1)
            while filled < index - 1:           # ops without events hold what was live before them
                filled += 1
                during[filled] = total
            total += delta
            live[category] = live.get(category, 0) + delta
            if index >= 0 and key[0] >= 0:
                during[index] = max(during[index], total) if filled == index else total
                filled = index
            if total > best[0]:
                best = (total, key)
                at_peak = dict(live)
        while filled < len(graph.ops) - 1:
            filled += 1
            during[filled] = total
        phases: dict[str, int] = {}
        for op in graph.ops:
            phases[op.phase.value] = max(phases.get(op.phase.value, 0), during[op.index])
        if best[0] < 0:
            best = (0, _BEFORE)
        return best, at_peak, {p.value: phases[p.value] for p in Phase if p.value in phases}, tuple(during)


def _gradient_reduce_points(units, graph: StepGraph, rule: ShardingRule) -> dict[int, tuple[tuple, tuple] | None]:
    """Gradient storage id -> (when the whole gradient is freed, when its shard appears) at its unit's
    post-backward; None: never reduced. FSDP2's `foreach_reduce` frees the gradients after copying them
    into the reduce-scatter input, except the unit's last parameter's, which a loop variable holds until
    the reduce-scatter output exists."""
    if not rule.gradients:
        return {}
    out: dict[int, tuple[tuple, tuple] | None] = {}
    last_backward = max((op.index for op in graph.ops if op.phase is Phase.BACKWARD), default=None)
    grad_of = {s.name.removesuffix(".grad"): s.storage_id for s in graph.storages if s.role is StorageRole.GRADIENT}
    for unit in units:
        key = _post_backward_key(unit, last_backward)
        held = None
        if rule.communication_buffers and unit.parameter_ids:
            held = grad_of.get(graph.storage(max(unit.parameter_ids)).name)
        for sid in unit.gradient_ids:
            if key is None:
                out[sid] = None
                continue
            op, slot, order = key
            freed = _HELD_GRAD_FREED if sid == held else _CLEAR_GRADS
            out[sid] = ((op, slot, order + freed), (op, slot, order + _SHARDED_GRADS))
    return out


def _post_backward_key(unit: Unit, last_backward: int | None) -> tuple | None:
    if unit.name == "":
        return None if last_backward is None else (last_backward, _POST, _ROOT_FINAL)
    return None if unit.backward_ops is None else (unit.backward_ops[1], _POST, 0)


def _gathered_parameters(events: _Events, units, graph: StepGraph, rule: ShardingRule,
                         reshard_after_forward: bool, copy_rs_input: bool) -> None:
    """The unsharded parameters of each unit (and FSDP2's flat buffers) around its forward and backward."""
    comm = rule.communication_buffers
    root, blocks = units[0], [u for u in units[1:] if u.forward_ops is not None]
    last_backward = max((op.index for op in graph.ops if op.phase is Phase.BACKWARD), default=None)
    last_forward = max((op.index for op in graph.ops if op.phase is Phase.FORWARD), default=0)
    first_op = 0
    # forward: root first, then each block; the previous all-gather output is freed after the next copy-out
    order = ([root] if root.padded_bytes else []) + blocks
    previous = None
    for unit in order:
        first = first_op if unit is root else unit.forward_ops[0]
        if comm:
            events.add((first, _PRE, 0), unit.padded_bytes, "communication", _ALL_GATHER_STREAM)
            if previous is not None:       # wait_for_unshard's local still holds it through the copy-out
                events.add((first, _PRE, 2), -previous.padded_bytes, "communication", _ALL_GATHER_STREAM)
        events.add((first, _PRE, 1), unit.padded_bytes, "unsharded_parameter")
        if unit is not root and reshard_after_forward:
            events.add((unit.forward_ops[1], _POST, 0), -unit.padded_bytes, "unsharded_parameter")
        previous = unit
    if comm and previous is not None:
        events.add((last_forward, _POST, 1), -previous.padded_bytes, "communication", _ALL_GATHER_STREAM)
    if last_backward is None:
        return
    # backward: blocks in reverse; each pre-backward copies its own parameters out and prefetches the next
    first_backward = min(op.index for op in graph.ops if op.phase is Phase.BACKWARD)
    backward_blocks = [u for u in reversed(blocks) if u.backward_ops is not None]
    if comm and reshard_after_forward and backward_blocks:
        events.add((first_backward, _PRE, 3), backward_blocks[0].padded_bytes, "communication", _ALL_GATHER_STREAM)
    rs_previous = None
    for i, unit in enumerate(backward_blocks):
        start = unit.backward_ops[0]
        if reshard_after_forward:
            events.add((start, _PRE, 1), unit.padded_bytes, "unsharded_parameter")
            if comm:
                events.add((start, _PRE, 2), -unit.padded_bytes, "communication", _ALL_GATHER_STREAM)
                if i + 1 < len(backward_blocks):
                    events.add((start, _PRE, 3), backward_blocks[i + 1].padded_bytes, "communication",
                               _ALL_GATHER_STREAM)
        end = (unit.backward_ops[1], _POST, 0)
        events.add(end, -unit.padded_bytes, "unsharded_parameter")
        if comm:
            rs_previous = _reduce_scatter(events, end, unit, rs_previous, copy_rs_input)
    end = (last_backward, _POST, _ROOT_FINAL)
    if root.padded_bytes:
        events.add(end, -root.padded_bytes, "unsharded_parameter")
    if comm:
        if _reduce_scatter(events, end, root, rs_previous, copy_rs_input) is not None:
            events.add((last_backward, _POST, _BACKWARD_END), -root.padded_gradient_bytes, "communication")


def _reduce_scatter(events: _Events, key: tuple, unit: Unit, previous: Unit | None, copy_input: bool) -> Unit | None:
    """The reduce-scatter input of `unit` replaces the previous unit's (one kept in flight); returns the
    unit whose input is now in flight."""
    op, slot, order = key
    if previous is not None:
        events.add((op, slot, order + _POP_RS_INPUT), -previous.padded_gradient_bytes, "communication")
    if not unit.padded_gradient_bytes:
        return None
    events.add((op, slot, order + _RS_INPUT), unit.padded_gradient_bytes, "communication")
    if copy_input:
        events.add((op, slot, order + _RS_COPY), unit.padded_gradient_bytes, "communication")
        events.add((op, slot, order + _RS_COPY_FREED), -unit.padded_gradient_bytes, "communication")
    return unit


def _rule(strategy: str) -> ShardingRule:
    try:
        return STRATEGIES[strategy]
    except KeyError:
        raise UsageError(f"unknown sharding strategy {strategy!r}", hint=f"valid: {', '.join(STRATEGIES)}") from None
