"""The captured training step as plain frozen data: the only thing passes and reports ever see.

A `StepGraph` is a straight-line list of ops in execution order (forward, then backward, then the
optimizer step and zero_grad) over `Storage`s, the unit of memory. Tensors (`TensorValue`) are views of
storages; several values may share one storage (views, aliases). Storages that exist before the step
(parameters, inputs, optimizer state in steady state, gradients kept by zero_grad(set_to_none=False))
have `preexisting=True`. Storages that outlive the step (the loss, gradients, new optimizer state) have
`persistent=True`. A storage that a Python local keeps after its last use carries `held_until_op`.
A storage whose release the capture observed directly (Python code such as the
optimizer, run under a storage tracker) carries `released_after_op`; otherwise the liveness pass frees it
after its last use. Nothing here imports torch.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Any


class Phase(str, enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"


PHASE_NAMES = tuple(p.value for p in Phase)      # ("forward", "backward", "optimizer"), in step order


class StorageRole(str, enum.Enum):
    """What a storage is, as known at capture time (activation vs temporary is decided by the passes)."""
    PARAMETER = "parameter"
    BUFFER = "buffer"
    INPUT = "input"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    INTERMEDIATE = "intermediate"


@dataclasses.dataclass(frozen=True)
class SourceLoc:
    file: str
    line: int
    function: str
    code: str

    def short(self) -> str:
        return f"{self.file.rsplit('/', 1)[-1]}:{self.line}"


@dataclasses.dataclass(frozen=True)
class Storage:
    storage_id: int
    nbytes: int
    role: StorageRole
    dtype: str
    shape: tuple[int, ...]            # shape of the first tensor seen on this storage
    preexisting: bool = False
    persistent: bool = False
    released_after_op: int | None = None
    held_until_op: int | None = None
    fused: bool = False               # computed inside its consumers' kernels (compiled): never allocated  # a Python reference (a local in forward) holds it at least this long
    name: str = ""                    # parameter FQN, input index, optimizer state key, ...
    host: bool = False                # held in host memory (--offload): not on the device
    frozen: bool = False              # a parameter with requires_grad=False: no gradient, no optimizer state
    caller_held: bool = False         # held by the training loop (capture/caller_held.py), not by the model
    weights: int | None = None        # a packed quantized parameter: the weights it holds (else its elements)


@dataclasses.dataclass(frozen=True)
class TensorValue:
    storage_id: int
    shape: tuple[int, ...]
    dtype: str


@dataclasses.dataclass(frozen=True)
class OpNode:
    index: int
    name: str                         # node name in the captured graph (unique)
    target: str                       # aten overload, e.g. "aten.mm.default"
    phase: Phase
    args: tuple[Any, ...]             # TensorValue, tuples, and plain scalars/strings
    kwargs: tuple[tuple[str, Any], ...]
    outputs: tuple[TensorValue, ...]
    source: SourceLoc | None          # user line (for backward ops: the forward line that caused them)
    module: str                       # module path ("" for the root; for backward ops, the forward module)
    is_view: bool = False             # outputs alias an input storage (no allocation)
    autograd_node: int | None = None  # backward ops of one autograd Node share this id (eager frees at its end)
    recomputed: bool = False          # a forward op re-run during backward (checkpointing, compiled remat)
    micro_batch: int | None = None    # gradient accumulation: the micro-batch of a forward/backward op (1-based)

    @property
    def phase_name(self) -> str:
        """The phase as reports name it: "forward", or "forward (micro-batch 2)" under accumulation."""
        return self.phase.value if self.micro_batch is None else f"{self.phase.value} (micro-batch {self.micro_batch})"

    def input_values(self) -> tuple[TensorValue, ...]:
        return tuple(_iter_values((self.args, tuple(v for _, v in self.kwargs))))


def _iter_values(obj):
    if isinstance(obj, TensorValue):
        yield obj
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _iter_values(item)


@dataclasses.dataclass(frozen=True)
class StepConfig:
    model: str
    batch: int
    seq: int
    precision: str
    optimizer: str
    step: str                         # "first" | "steady"
    zero_grad_set_to_none: bool
    capture_path: str
    policy: str = "eager"
    target: str = "cpu"               # cpu | cuda | cuda:<gpu>: which device's kernels and autocast lists
    accumulate: int = 1               # micro-batches of forward + backward per optimizer step
    offload: str | None = None        # optimizer | optimizer+params: what is held in host memory
    notes: tuple[str, ...] = ()       # what the capture saw and how it is simulated, for the report
    input_shapes: str | None = None   # the batch's shapes when --seq does not change them (images), else None

    @property
    def size_words(self) -> str:
        """How reports name the step's size besides the batch: `seq 1024`, or the input's shapes when the
        sequence length does not change the batch (`input 2x3x224x224`)."""
        return f"seq {self.seq}" if self.input_shapes is None else f"input {self.input_shapes}"


@dataclasses.dataclass(frozen=True)
class StepGraph:
    config: StepConfig
    ops: tuple[OpNode, ...]
    storages: tuple[Storage, ...]     # indexed by storage_id
    parameter_count: int
    loss_storage_id: int | None = None
    frozen_parameter_count: int = 0   # of parameter_count, the parameters with requires_grad=False

    def storage(self, storage_id: int) -> Storage:
        return self.storages[storage_id]

