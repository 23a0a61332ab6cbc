"""Recompute policies, described as plain data (no torch): what to simulate on one captured step.

`PolicySpec` names a policy: `eager` (what autograd saves), `compiled` (torch.compile's min-cut
partitioner, parameters as static inputs, optional activation memory budget), `full` (each checkpointed
block keeps only its input and reruns its forward in backward) and `selective` (checkpointed blocks
keep the outputs of the ops a save predicate names, and recompute the rest).

Save predicates are small named functions of an aten op name (`"aten.mm.default"` -> save?) in a
registry filled by `@save_policy(name)`, which refuses duplicates; `save_predicate(name)` raises
`UsageError` listing the valid names. `--save-ops mm,_scaled_dot_product_flash_attention` builds an
ad-hoc predicate from op names (with or without the `aten.` prefix and overload).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tracer.errors import UsageError

POLICIES = ("eager", "compiled", "selective", "full")
SavePredicate = Callable[[str], bool]
SAVE_POLICIES: dict[str, SavePredicate] = {}


@dataclasses.dataclass(frozen=True, kw_only=True)
class PolicySpec:
    name: str                                  # one of POLICIES
    blocks: str | None = None                  # glob over block module paths ("layers.*"); None = detect
    checkpoint_every: int = 1                  # checkpoint every K-th block
    save: str = "matmul-attention"             # selective: a SAVE_POLICIES name
    save_ops: tuple[str, ...] = ()             # selective: explicit op names (override `save`)
    memory_budget: float | None = None         # compiled: torch._functorch activation_memory_budget

    @property
    def label(self) -> str:
        if self.name == "compiled" and self.memory_budget is not None:
            return f"compiled@{self.memory_budget:g}"
        return self.name


def save_policy(name: str) -> Callable[[SavePredicate], SavePredicate]:
    def register(fn: SavePredicate) -> SavePredicate:
        if name in SAVE_POLICIES:
            raise ValueError(f"save policy {name!r} is already registered")
        SAVE_POLICIES[name] = fn
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


def save_predicate(spec: PolicySpec) -> SavePredicate:
    if spec.save_ops:
        wanted = {op_packet(name.strip()) for name in spec.save_ops if name.strip()}
        return lambda target: op_packet(target) in wanted
    try:
        return SAVE_POLICIES[spec.save]
    except KeyError:
        raise UsageError(f"unknown save policy {spec.save!r}",
                         hint=f"valid: {', '.join(sorted(SAVE_POLICIES))}") from None
