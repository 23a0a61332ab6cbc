"""Recompute policies, described as plain data (no torch): what to simulate on one captured step.

`POLICY_REGISTRY` has one entry per policy (`Policy`: which blocks tracer checkpoints, whether the step is
compiled, its description and its "not modelled" text): `eager` (what autograd saves), `compiled`
(torch.compile's Inductor partition and plan, optional activation memory budget), `full` (each checkpointed
block keeps only its input and reruns its forward in backward), `selective` (checkpointed blocks keep the
outputs of the ops a save predicate names, and recompute the rest), and `compiled+selective` /
`compiled+full` (the same tags inside torch.compile, whose partitioner honours them), and `compiled-blocks`
(`block.compile()` on every repeated block: each block its own compiled region, the rest eager). A new
policy is one entry; `PolicySpec` names one with its settings.

Save predicates are small named functions of an op name (`"aten.mm.default"` -> save?) in a registry
filled by `@save_policy(name)`, which refuses duplicates; a policy that counts ops (torchtitan's "every
mm except every second one") registers a factory with `per_region=True`, and `save_predicate(spec)`
returns a fresh predicate for each checkpointed region, asked about the region's ops in forward order.
`save_predicate` raises `UsageError` listing the valid names. `--save-ops mm,_scaled_dot_product_flash_attention`
builds an ad-hoc predicate from op names (with or without the `aten.` prefix and overload).

A selective policy can also be a Python function with torch's signature, `save_fn(ctx, op, *args,
**kwargs) -> CheckpointPolicy | bool` (a model file's `save_policy`): `PolicySpec.save_fn` carries it, and
tracer.capture.policies asks it about each op as torch's selective-checkpointing dispatch mode would.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tracer.errors import UsageError



@dataclasses.dataclass(frozen=True)
class Policy:
    """One recompute policy: how its step is scheduled (tracer.capture.policies reads `checkpoint` and
    `compiled`), what it is, and what it does not model (the report prints it)."""
    name: str
    checkpoint: str | None            # the blocks tracer checkpoints itself: None, "full" or "selective"
    compiled: bool                    # partitioned, lowered and planned as torch.compile's Inductor does
    description: str
    not_modelled: str
    compiled_blocks: bool = False     # block.compile() on every repeated block, the rest eager

    @property
    def compiled_any(self) -> bool:
        """Inductor plans some of the step: the whole model's or every block's."""
        return self.compiled or self.compiled_blocks


_KERNEL_SCRATCH = "kernel scratch"
_EAGER_CHECKPOINT = "checkpointing is simulated as eager non-reentrant torch.utils.checkpoint"
_INDUCTOR = ("kernel scratch of extern kernels other than CPU fp32 flash attention (oneDNN, CUDA or bf16 "
             "attention); for a CUDA target Inductor's Triton plan is made without a GPU, so what Inductor "
             "decides by timing kernels is given, not measured (pad_mm: planned both ways, see the notes; "
             "max-autotune's templates); CUDA graphs")

POLICY_REGISTRY: dict[str, Policy] = {p.name: p for p in (
    Policy("eager", None, False, "what eager autograd saves and frees",
           "kernel-internal scratch buffers; Python references other than plain `name = ...` locals in forward."),
    Policy("compiled", None, True, "torch.compile (whole model): Inductor's partition, fusion and buffer plan",
           _INDUCTOR + "."),
    Policy("selective", "selective", False, "blocks checkpointed keeping what the save policy names",
           f"{_KERNEL_SCRATCH}; {_EAGER_CHECKPOINT}."),
    Policy("full", "full", False, "blocks checkpointed keeping only their inputs",
           f"{_KERNEL_SCRATCH}; {_EAGER_CHECKPOINT}."),
    Policy("compiled+selective", "selective", True,
           "selective checkpointing inside torch.compile: the partitioner honours the save policy's tags "
           "(must save / prefer recompute), as torchtitan trains", _INDUCTOR + "."),
    Policy("compiled+full", "full", True,
           "full checkpointing inside torch.compile: every block's ops are tagged prefer-recompute", _INDUCTOR + "."),
    Policy("compiled-blocks", None, False,
           "block.compile() on every repeated block (--blocks): each block partitioned and planned by Inductor "
           "on its own, the rest of the step eager",
           f"{_INDUCTOR}; graph breaks inside a block; Python locals that hold a block's output (freed at its "
           "last use); outside the blocks, as eager: Python references other than plain `name = ...` locals.",
           compiled_blocks=True),
    Policy("compiled-blocks+full", "full", False,
           "torchtitan's recipe: every block checkpointed, then compiled on its own (torch.compile of each "
           "checkpoint-wrapped block): the block's min-cut partition recomputes its forward inside its "
           "compiled backward, the rest of the step eager",
           f"{_INDUCTOR}; graph breaks inside a block.", compiled_blocks=True),
    Policy("compiled-blocks+selective", "selective", False,
           "torchtitan's recipe with op-level selective checkpointing: every block checkpointed with the "
           "save policy, then compiled on its own; the partition keeps what the policy saves",
           f"{_INDUCTOR}; graph breaks inside a block.", compiled_blocks=True),
)}
POLICIES = tuple(POLICY_REGISTRY)
ALL_POLICIES = ("eager", "compiled", "selective", "full")          # --policy all


def policy_label(name: str, memory_budget: float | None = None) -> str:
    """The key an analysis gives a policy: its name, or `name@budget` for a compiled policy under
    `--memory-budget` (`compiled@0.5`)."""
    return name if memory_budget is None else f"{name}@{memory_budget:g}"


def parse_policy_label(label: str) -> tuple[str, float | None]:
    """`compiled@0.5` -> ("compiled", 0.5); `eager` -> ("eager", None): policy_label's inverse."""
    name, _, budget = label.partition("@")
    return name, (float(budget) if budget else None)


def policy_named(name: str) -> Policy:
    """The registry entry; raises UsageError listing the valid names."""
    if name not in POLICY_REGISTRY:
        raise UsageError(f"unknown policy {name!r}", hint=f"valid: {', '.join(POLICIES)}")
    return POLICY_REGISTRY[name]


SavePredicate = Callable[[str], bool]
SAVE_POLICIES: dict[str, Callable[[], SavePredicate]] = {}     # name -> a fresh predicate per region


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySpec:
    name: str                                  # a POLICY_REGISTRY name
    blocks: str | None = None                  # glob over block module paths ("layers.*"); None = detect
    checkpoint_every: int = 1                  # checkpoint every K-th block
    save: str = "matmul-attention"             # selective: a SAVE_POLICIES name
    save_fn: Callable | None = None            # selective: torch's policy_fn(ctx, op, *args, **kwargs); wins over save
    model_save_fn_unused: bool = False         # selective: the model file defines save_policy, and save/save_ops won
    save_ops: tuple[str, ...] = ()             # selective: explicit op names (override `save`)
    memory_budget: float | None = None         # compiled: torch._functorch activation_memory_budget

    @property
    def label(self) -> str:
        return policy_label(self.name, self.memory_budget)

    @property
    def policy(self) -> Policy:
        return policy_named(self.name)


def save_policy(name: str, *, per_region: bool = False) -> Callable:
    """Register a save predicate under `name`; with `per_region`, a factory of predicates (one per region:
    state such as an op count starts afresh in each checkpointed region)."""
    def register(fn):
        if name in SAVE_POLICIES:
            raise ValueError(f"save policy {name!r} is already registered")
        SAVE_POLICIES[name] = fn if per_region else (lambda: fn)
        return fn
    return register


def op_packet(target: str) -> str:
    """'aten.mm.default' -> 'mm'; 'mm' -> 'mm'."""
    parts = target.split(".")
    if parts[0] == "aten":
        parts = parts[1:]
    return parts[0]


_MATMULS = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "_scaled_mm"}
_ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
              "scaled_dot_product_attention"}


@save_policy("matmul-attention")
def _save_matmul_attention(target: str) -> bool:
    """The usual selective policy: keep matmul and attention outputs, recompute cheap pointwise ops."""
    return op_packet(target) in _MATMULS | _ATTENTION


@save_policy("matmul")
def _save_matmul(target: str) -> bool:
    return op_packet(target) in _MATMULS


@save_policy("nothing")
def _save_nothing(target: str) -> bool:
    return False


# torchtitan's op-level selective checkpointing (torchtitan/distributed/activation_checkpoint.py, `_save_list`
# and `_custom_policy`): these ops' outputs are saved, except every second aten.mm of a region.
_TORCHTITAN_SAVED = {"aten.mm.default", "aten._scaled_dot_product_efficient_attention.default",
                     "aten._scaled_dot_product_flash_attention.default",
                     "aten._scaled_dot_product_cudnn_attention.default",
                     "_c10d_functional.reduce_scatter_tensor.default",
                     "aten.abs.default", "aten.max.default"}        # max(abs(x)) of float8 scaling


@save_policy("torchtitan", per_region=True)
def _torchtitan_policy() -> SavePredicate:
    """torchtitan's default op-level SAC: keep mm outputs except every second one (counted per region, the
    1st, 3rd, ... are kept), SDPA outputs (the CUDA kernels; the CPU flash kernel is not on its list) and
    reduce-scatter results; recompute the rest."""
    mm_count = 0

    def keep(target: str) -> bool:
        nonlocal mm_count
        if target == "aten.mm.default":
            mm_count += 1
            return mm_count % 2 == 1
        return target in _TORCHTITAN_SAVED
    return keep


def save_policy_label(spec: PolicySpec) -> str:
    """Which selective policy `spec` simulates, for the report."""
    if spec.save_fn is not None:
        return f"the policy function {getattr(spec.save_fn, '__qualname__', type(spec.save_fn).__name__)}"
    named = "--save-ops " + ",".join(spec.save_ops) if spec.save_ops else f"--save-policy {spec.save}"
    if spec.model_save_fn_unused:
        return named + " (given explicitly: the model file's save_policy() is not used)"
    return named


def save_predicate(spec: PolicySpec) -> SavePredicate:
    """A fresh predicate (a per-region policy's count starts at zero). Raises UsageError for an unknown name."""
    if spec.save_ops:
        wanted = {op_packet(name.strip()) for name in spec.save_ops if name.strip()}
        return lambda target: op_packet(target) in wanted
    try:
        factory = SAVE_POLICIES[spec.save]
    except KeyError:
        raise UsageError(f"unknown save policy {spec.save!r}",
                         hint=f"valid: {', '.join(sorted(SAVE_POLICIES))}") from None
    return factory()
