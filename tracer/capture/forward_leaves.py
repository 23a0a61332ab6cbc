"""Leaves made in forward: a tensor the model makes in its forward and then flags `requires_grad = True`
(T5Attention's position bias under gradient checkpointing: `torch.zeros(...)`, then
`position_bias.requires_grad = True`).

In eager that tensor is a leaf with an AccumulateGrad node: ops reading it see an input that requires grad
(SDPA takes its math kernel for a mask that needs a gradient), backward accumulates its .grad (a sum over
every use), and the leaf and its .grad live as long as the autograd graph (the AccumulateGrad node holds
the leaf, `loss` holds the graph). Export drops the flag, and AOT's joint graph only differentiates its
inputs. So, while export traces the forward, `ForwardLeafRecorder` records every tensor the model's code
(not torch's) flags; `lift_forward_leaves` then replaces the node that made each one by a parameter of the
exported module (a fake tensor that requires grad), so the joint graph differentiates it as eager does;
`JointCapture.forward_leaves` names them, and the conversion gives each its own lifetime (allocated by
its first reader, held with its .grad until the step ends; in a use_reentrant=True region, whose rerun makes
it afresh in a graph of its own, both die with that graph) and keeps it out of the optimizer.

A leaf made inside a checkpointed region is made again by the region's recompute (a fresh leaf, a local
of the rerun frame: tracer/capture/eager_checkpoint.py). Not handled: a flagged tensor that shares its
storage with an earlier value (`h.detach().requires_grad_()`: left as export traced it, without a
gradient); a lifted leaf is allocated by the first op that reads it, not by the op that made it (a
factory, whose output nothing else holds meanwhile).
"""
from __future__ import annotations

import dataclasses
import os
import sys

import torch
from torch import nn

from tracer.capture.source import is_user_file, loc_from_stack_trace
from tracer.capture.storages import flat_tensors
from tracer.stepgraph import SourceLoc

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep


@dataclasses.dataclass(frozen=True)
class ForwardLeaf:
    """A lifted leaf: the exported module's parameter that stands for it, the line that made it, and the
    torch.utils.checkpoint call (region) whose code made it, if any: that region's recompute makes it again."""
    fqn: str
    tensor: torch.Tensor
    source: SourceLoc | None
    region: int | None = None


class ForwardLeafRecorder(torch.overrides.TorchFunctionMode):
    """While the forward is traced: the tensors the model's code turns into leaves that require grad
    (`t.requires_grad = True`, `t.requires_grad_()`), kept alive so their storages stay unique."""

    def __init__(self):
        super().__init__()
        self.tensors: list[torch.Tensor] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _flags_requires_grad(func, args, kwargs or {}) and _called_from_model_code():
            t = args[0]
            if isinstance(t, torch.Tensor) and not t.requires_grad and t.grad_fn is None:
                self.tensors.append(t)
        return func(*args, **(kwargs or {}))


def _flags_requires_grad(func, args, kwargs) -> bool:
    name = getattr(func, "__name__", "")
    if name == "__set__":        # the `requires_grad` attribute's setter
        return getattr(getattr(func, "__self__", None), "__name__", "") == "requires_grad" and bool(args[1])
    if name == "requires_grad_":
        return bool(args[1] if len(args) > 1 else kwargs.get("requires_grad", True))
    return False


def _called_from_model_code() -> bool:
    """The innermost frame outside torch and outside other torch function modes (which may sit between the
    setter and this mode) is the model's, not tracer's (export flags the fake copies of parameters it makes)."""
    frame = sys._getframe(2)
    while frame is not None and (frame.f_code.co_filename.startswith(_TORCH_DIR)
                                 or frame.f_code.co_name == "__torch_function__"):
        frame = frame.f_back
    return frame is not None and is_user_file(frame.f_code.co_filename)


def lift_forward_leaves(gm: torch.fx.GraphModule, tensors: list[torch.Tensor], fake_mode) -> tuple[ForwardLeaf, ...]:
    """Each recorded tensor that owns its storage (the first node whose value lives in that storage made
    it, with the same layout) becomes a parameter of `gm` in place of that node. Returns the lifted leaves."""
    from tracer.capture.meta import CHECKPOINT_KEY
    first_node: dict[int, torch.fx.Node] = {}
    for node in gm.graph.nodes:
        for value in flat_tensors(node.meta.get("val")):
            first_node.setdefault(value.untyped_storage()._cdata, node)
    leaves = []
    for t in tensors:
        node = first_node.get(t.untyped_storage()._cdata)
        if node is None or node.op != "call_function" or not _same_layout(node.meta.get("val"), t):
            continue
        fqn = f"tracer_forward_leaf_{len(leaves)}"
        with fake_mode:
            leaf = nn.Parameter(torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device))
        gm.register_parameter(fqn, leaf)
        with gm.graph.inserting_before(node):
            attr = gm.graph.get_attr(fqn)
        attr.meta = dict(node.meta, val=leaf)
        node.replace_all_uses_with(attr)
        gm.graph.erase_node(node)
        leaves.append(ForwardLeaf(fqn=fqn, tensor=leaf, source=loc_from_stack_trace(node.meta.get("stack_trace")),
                                  region=(node.meta.get("custom") or {}).get(CHECKPOINT_KEY)))
    if leaves:
        gm.recompile()
    return tuple(leaves)


def leaf_note(leaf: ForwardLeaf) -> str:
    """The report's note for one lifted leaf."""
    where = leaf.source.short() if leaf.source else "the forward"
    return (f"a tensor made at {where} {tuple(leaf.tensor.shape)} is flagged requires_grad in forward: a leaf "
            "with a gradient of its own, both alive until the step ends, as the autograd graph holds them")


def _same_layout(value, t: torch.Tensor) -> bool:
    return (isinstance(value, torch.Tensor) and value.shape == t.shape and value.stride() == t.stride()
            and value.storage_offset() == t.storage_offset())


