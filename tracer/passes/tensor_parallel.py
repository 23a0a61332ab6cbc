"""Megatron tensor parallelism (and sequence parallelism): the step of one of `tp` tensor-parallel ranks.

    plan_tensor_parallel(graph, tp, sp) -> TensorParallelPlan     how Megatron splits each storage
    tensor_parallel_graph(graph, setup) -> StepGraph              the rank's step: split storages hold 1/tp

Megatron-LM (Shoeybi et al. 2019; Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
Transformer Models", section 4.2) splits a transformer's linears across `t` ranks: a column-parallel linear
holds 1/t of its output features (weight rows and bias), so its output is split; a row-parallel linear holds
1/t of its input features and all-reduces its output, which is replicated again; the word embedding is
vocab-parallel (1/t of its rows, output all-reduced). The roles are found from the captured graph's data
flow, never from module names: walking the ops in order, a storage is "split" when an op made it from a
split value, and a linear (`mm`/`addmm` whose operand is a parameter, or an autocast copy of one) whose
input is split is row-parallel, any other column-parallel. So the q/k/v (or fused qkv) and up/gate
projections and the output head come out column-parallel, the attention output projection and the MLP's
down projection row-parallel, and everything between them (per-head q, k, v, attention scores, softmax,
the dropout masks on the probabilities, the MLP activation) split. An embedding whose indices are the
step's input (token ids) is vocab-parallel; one indexed by computed positions stays replicated.

Backward follows the same rule, with Megatron's communication: the input gradient of a column-parallel
linear is all-reduced (replicated), that of a row-parallel linear is split. Parameters, their gradients
and their optimizer state are split when Megatron splits the parameter (column weights and biases, row
weights, vocab-parallel embeddings); layer norms and row biases are replicated.

Sequence parallelism (`sp`, Korthikanti et al. section 4.2.2): the regions tensor parallelism replicates
(layer norms, dropouts, residuals) are split along the sequence: the embedding's and each row-parallel
linear's output is reduce-scattered, each column-parallel linear's input gradient too, so those values
and everything made from them are split as well. A rank's activations per layer are then
sbh(10 + 24/t + 5as/(ht)) bytes without and sbh(34/t + 5as/(ht)) with sequence parallelism (their
Table 2), plus the layer norms' statistics, which the paper leaves out (tests/passes/test_tensor_parallel.py).

The rank's step is the captured step with each split storage's bytes divided by `tp` (and the split dim
of its shape, so --shard composes: FSDP/ZeRO then shard the rank's parameters); every pass and report
after this one describes that rank.

Not modelled: communication buffers (the all-gathered sequence-parallel input of each column-parallel
linear, all-reduce and reduce-scatter scratch), uneven splits of a vocabulary or an activation (rounded up
to whole elements, as Megatron pads the vocabulary, and the report's note names them; a --tp that does not
divide a split linear or the attention heads is refused, as Megatron refuses it), vocab-parallel cross-entropy's own
buffers, per-rank FLOPs (the FLOP counts stay the whole step's), pipeline parallelism, and modules
Megatron keeps replicated that are linears here (an MoE router becomes column-parallel); LoRA adapters get
roles by the same rule (lora_A of a column-parallel layer column-parallel, lora_B row-parallel), which
frameworks shard in different ways.
"""
from __future__ import annotations

import dataclasses
import math

from tracer.errors import UsageError
from tracer.stepgraph import OpNode, Phase, Storage, StepGraph, StorageRole, TensorValue

COLUMN, ROW, VOCAB = "column", "row", "vocab"
_LINEARS = frozenset({"aten.mm.default", "aten.addmm.default", "aten.linear.default"})
_WEIGHT_COPIES = frozenset({"aten._to_copy.default", "aten.clone.default", "aten.to.dtype"})
_EMBEDDING = "aten.embedding.default"
_EMBEDDING_BACKWARD = "aten.embedding_dense_backward.default"


@dataclasses.dataclass(frozen=True)
class TensorParallelSetup:
    tp: int                       # tensor-parallel ranks (Megatron's t)
    sp: bool = False              # Megatron sequence parallelism


@dataclasses.dataclass(frozen=True)
class TensorParallelPlan:
    tp: int
    sp: bool
    roles: dict[str, str]                    # parameter name -> COLUMN | ROW | VOCAB (its module's role)
    split_storage_ids: frozenset[int]        # storages of which a rank holds 1/tp
    split_dims: dict[int, int | None]        # storage id -> the dim of its shape that is split (None: no dim
                                             # divides by tp; its elements are split)
    uneven: tuple[str, ...]                  # split storages whose size does not divide by tp

    def linears(self, role: str) -> tuple[str, ...]:
        """The modules (a weight's owner) with `role`."""
        return tuple(name.rsplit(".", 1)[0] for name, r in self.roles.items()
                     if r == role and name.endswith(".weight"))


def tensor_parallel_graph(graph: StepGraph, setup: TensorParallelSetup) -> StepGraph:
    """`graph` as one tensor-parallel rank runs it: every split storage holds 1/tp of its bytes. Raises
    UsageError when `setup.tp` does not divide a split linear's weight or the attention heads."""
    plan = plan_tensor_parallel(graph, setup.tp, setup.sp)
    check_even_split(plan, graph)
    storages = tuple(_split_storage(s, plan) if s.storage_id in plan.split_storage_ids else s
                     for s in graph.storages)
    config = dataclasses.replace(graph.config, notes=graph.config.notes + (describe_plan(plan, graph),))
    return dataclasses.replace(graph, storages=storages, config=config)


_ATTENTION = ("aten._scaled_dot_product", "aten.scaled_dot_product")


def check_even_split(plan: TensorParallelPlan, graph: StepGraph) -> None:
    """Megatron asserts that the tensor-parallel size divides every split linear's output (column) or input
    (row) features and the attention heads (it pads only the vocabulary): a split that does not divide is
    refused with what does not divide, not rounded."""
    for storage in graph.storages:
        dim = plan.split_dims.get(storage.storage_id, 0)
        if (storage.storage_id in plan.split_storage_ids and storage.role is StorageRole.PARAMETER
                and plan.roles.get(storage.name) in (COLUMN, ROW) and (dim is None or storage.shape[dim] % plan.tp)):
            raise UsageError(f"--tp {plan.tp}: {storage.name} {tuple(storage.shape)} does not split into {plan.tp} "
                             f"equal parts", hint="Megatron needs the tensor-parallel size to divide every "
                                                  "split linear and the attention heads: pick a --tp that does")
    for op in graph.ops:
        if op.phase is Phase.FORWARD and op.target.startswith(_ATTENTION):
            query = op.input_values()[0]
            if len(query.shape) == 4 and query.shape[1] % plan.tp:
                raise UsageError(f"--tp {plan.tp}: the attention at {op.module or 'the root'} has {query.shape[1]} "
                                 f"heads, which do not split into {plan.tp} equal parts",
                                 hint="pick a --tp that divides the number of attention heads")


def describe_plan(plan: TensorParallelPlan, graph: StepGraph) -> str:
    """One note line: what the rank holds and how the roles were found."""
    column, row = plan.linears(COLUMN), plan.linears(ROW)
    vocab = [name.rsplit(".", 1)[0] for name, r in plan.roles.items() if r == VOCAB]
    params = sum(math.prod(s.shape) for s in graph.storages if s.role is StorageRole.PARAMETER)
    rank_params = sum(math.prod(_split_storage(s, plan).shape) if s.storage_id in plan.split_storage_ids
                      else math.prod(s.shape) for s in graph.storages if s.role is StorageRole.PARAMETER)
    text = (f"tensor parallel: the memory of one of {plan.tp} ranks{' with sequence parallelism' if plan.sp else ''}"
            f" ({rank_params:,} of {params:,} parameters); column-parallel: {_listed(column)}; row-parallel: "
            f"{_listed(row)}; vocab-parallel embeddings: {_listed(vocab)}; communication buffers and per-rank "
            f"FLOPs are not modelled (FLOPs are the whole step's)")
    if plan.uneven:
        text += f"; not divisible by {plan.tp}, rounded up: {_listed(plan.uneven)}"
    return text


def _listed(names) -> str:
    names = list(names)
    return (", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")) if names else "none"


def plan_tensor_parallel(graph: StepGraph, tp: int, sp: bool = False) -> TensorParallelPlan:
    """Walk the step's ops in order and decide, for every storage, whether a rank holds all of it or 1/tp.
    Raises UsageError for tp < 1."""
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise UsageError(f"--tp {tp!r} is not valid", hint="a positive number of tensor-parallel ranks")
    walk = _Walk(graph, sp=False)              # roles come from the tensor-parallel split alone: under sequence
    for op in graph.ops:                       # parallelism every linear's input is split (along the sequence)
        walk.visit(op)
    if sp:
        walk = _Walk(graph, sp=True, roles=walk.roles)
        for op in graph.ops:
            walk.visit(op)
    split, dims, uneven = set(), {}, []
    for storage in graph.storages:
        if tp == 1 or not walk.holds_a_part(storage):
            continue
        dim = walk.split_dim(storage, tp)
        split.add(storage.storage_id)
        dims[storage.storage_id] = dim
        if dim is None or storage.shape[dim] % tp:
            uneven.append(storage.name or f"storage {storage.storage_id}")
    return TensorParallelPlan(tp=tp, sp=sp, roles=dict(walk.roles), split_storage_ids=frozenset(split),
                              split_dims=dims, uneven=tuple(uneven))


class _Walk:
    """The data-flow walk: which values are split, which parameter each weight copy comes from, and the
    role of each parameter, decided at its first forward use."""

    def __init__(self, graph: StepGraph, *, sp: bool, roles: dict[str, str] | None = None):
        self.graph, self.sp = graph, sp
        self.roles: dict[str, str] = dict(roles or {})
        self.split: set[int] = set()                     # value storages made from split values
        self.owner: dict[int, str] = {}                  # storage -> the parameter it is (a copy or state of)
        params = {s.name: s for s in graph.storages if s.role is StorageRole.PARAMETER}
        self.params = {name: s.storage_id for name, s in params.items()}
        for s in graph.storages:
            name = _owner_name(s, params)
            if name is not None:
                self.owner[s.storage_id] = name

    # -- split decisions ------------------------------------------------------------------------------
    def _is_split(self, sid: int) -> bool:
        if sid in self.split:
            return True
        name = self.owner.get(sid)
        return name is not None and self._param_dim(name) is not None

    def _param_dim(self, name: str) -> int | None:
        """The dim Megatron splits parameter `name` along, or None (replicated)."""
        role = self.roles.get(name)
        if role in (COLUMN, VOCAB):
            return 0
        if role == ROW and name.endswith("weight"):
            return 1
        return None

    def holds_a_part(self, storage: Storage) -> bool:
        """After the walk: does a rank hold only 1/tp of `storage`?"""
        if math.prod(storage.shape) <= 1:
            return False                                 # scalars (the loss, Adam's step) are never split
        name = self.owner.get(storage.storage_id)
        if name is not None:
            return self._param_dim(name) is not None
        return storage.storage_id in self.split and storage.role is StorageRole.INTERMEDIATE

    def split_dim(self, storage: Storage, tp: int) -> int | None:
        """The dim a split storage is split along: its parameter's (Megatron's) for model state, else the
        first dim that divides by tp (None: none does)."""
        name = self.owner.get(storage.storage_id)
        if name is not None and tuple(storage.shape) == tuple(self.graph.storage(self.params[name]).shape):
            return self._param_dim(name)
        return next((d for d, n in enumerate(storage.shape) if n % tp == 0), None)

    # -- the walk -------------------------------------------------------------------------------------
    def visit(self, op: OpNode) -> None:
        if op.target.startswith("aten._foreach"):
            self._visit_foreach(op)
            return
        inputs = op.input_values()
        if op.target in _WEIGHT_COPIES and len(inputs) == 1 and inputs[0].storage_id in self.owner:
            for value in op.outputs:                      # an autocast copy of a weight is that weight
                self.owner.setdefault(value.storage_id, self.owner[inputs[0].storage_id])
            return
        made_split = self._made_split(op, inputs)
        if made_split:
            self.split.update(v.storage_id for v in op.outputs)

    def _made_split(self, op: OpNode, inputs: tuple[TensorValue, ...]) -> bool:
        forward = op.phase is Phase.FORWARD or op.recomputed
        if op.target in _LINEARS:
            linear = self._linear(inputs)
            if linear is not None:
                x, weight, bias = linear
                if forward:
                    role = self.roles.setdefault(weight, ROW if x is not None and self._is_split(x.storage_id)
                                                 else COLUMN)
                    if bias is not None:
                        self.roles.setdefault(bias, role)
                    return self.sp if role == ROW else True     # a row-parallel output is all-reduced
                if self.roles.get(weight) == COLUMN:
                    return self.sp                              # input gradient of a column-parallel linear
                return True
        if op.target == _EMBEDDING and forward:
            weight, indices = inputs[0], inputs[1]
            name = self.owner.get(weight.storage_id)
            if name is not None and self.graph.storage(indices.storage_id).role is StorageRole.INPUT:
                self.roles.setdefault(name, VOCAB)
                return self.sp                                  # the vocab-parallel output is all-reduced
        if op.target == _EMBEDDING_BACKWARD:
            return any(r == VOCAB for r in self.roles.values())  # the embedding weight's gradient
        return any(self._is_split(v.storage_id) for v in inputs)

    def _linear(self, inputs: tuple[TensorValue, ...]):
        """(input value, weight name, bias name) when the op is a linear of a 2-D parameter, else None."""
        weights = [v for v in inputs if v.storage_id in self.owner and len(v.shape) == 2]
        if len(weights) != 1:
            return None
        others = [v for v in inputs if v.storage_id not in self.owner]
        biases = [v for v in inputs if v.storage_id in self.owner and len(v.shape) == 1]
        return (others[0] if others else None, self.owner[weights[0].storage_id],
                self.owner[biases[0].storage_id] if biases else None)

    def _visit_foreach(self, op: OpNode) -> None:
        """Multi-tensor ops: output i is made from element i of each list argument."""
        lists = [a for a in op.args if isinstance(a, tuple) and a and isinstance(a[0], TensorValue)]
        for i, value in enumerate(op.outputs):
            if any(i < len(items) and self._is_split(items[i].storage_id) for items in lists):
                self.split.add(value.storage_id)


def _owner_name(storage: Storage, params: dict[str, Storage]) -> str | None:
    """The parameter a parameter, gradient or optimizer-state storage belongs to (by its name, as the
    capture names them: `<param>`, `<param>.grad`, `<param>.<state key>`)."""
    if storage.role is StorageRole.PARAMETER:
        return storage.name
    if storage.role in (StorageRole.GRADIENT, StorageRole.OPTIMIZER_STATE):
        owner = storage.name.removesuffix(".grad") if storage.role is StorageRole.GRADIENT \
            else storage.name.rsplit(".", 1)[0]
        if owner in params and math.prod(storage.shape) == math.prod(params[owner].shape):
            return owner
    return None


def _split_storage(storage: Storage, plan: TensorParallelPlan) -> Storage:
    """The rank's part: 1/tp of the split dim, rounded up to a whole row when it does not divide; without a
    dim that divides, 1/tp of the elements, rounded up (the shape then lists them flat)."""
    numel = math.prod(storage.shape)
    dim = plan.split_dims[storage.storage_id]
    if dim is not None:
        shape = list(storage.shape)
        shape[dim] = -(-shape[dim] // plan.tp)
        shape = tuple(shape)
    else:
        shape = (-(-numel // plan.tp),)
    if storage.nbytes % numel:
        return dataclasses.replace(storage, nbytes=-(-storage.nbytes // plan.tp), shape=shape)
    return dataclasses.replace(storage, nbytes=storage.nbytes // numel * math.prod(shape), shape=shape)
