"""Activation offloading: the saved tensors of the forward copied to host memory as autograd saves them,
as `torch.autograd.graph.save_on_cpu` does it (a model file's own region, or `--offload activations` for
the whole forward and loss).

save_on_cpu's hooks, per saved tensor (one SavedVariable: a tensor two autograd nodes save is packed
twice), on torch 2.13:
  * pack: a host copy of the tensor's own elements (a saved view copies only the view), pinned when
    `pin_memory=True`. On a CUDA target the device storage is then held by nothing autograd owns, so it
    is freed when the forward's Python code lets go of it. On a CPU target the copy is made only with
    `pin_memory=True` (`tensor.cpu()` of a CPU tensor is the tensor itself), in the same memory;
  * unpack, when the node that saved it runs in backward: on a CUDA target a new device copy, which the
    node holds while it runs; on a CPU target the host copy itself;
  * the host copy lives until autograd lets go of the saved variable: right after its node ran.
The capture's own pack hook sees every save of the traced forward (python_lifetimes.SavedPack: what was
saved, when, and when it was let go); `offload_saved_tensors` rewrites the step's ops with the copies.
Parameters and inputs that a node saves are copied too, as save_on_cpu copies them.

Not modelled: the time of the copies (they take no device memory beyond the copies themselves) and the
hooks of other libraries (torchtune's OffloadActivations: named in a note, their saves counted as without
hooks). Applied to the eager step as traced; a recompute policy or compiled step with it is refused by
the options, and a model file's save_on_cpu under such a policy is named in a note.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from tracer.capture.convert import OpDraft, input_values
from tracer.capture.splice import remap
from tracer.capture.storages import StorageTable
from tracer.stepgraph import Phase, StorageRole, TensorValue

PACK_COPY = "aten._to_copy.default"      # what save_on_cpu's pack and unpack run (a copy across devices)


@dataclasses.dataclass(frozen=True)
class OffloadedStep:
    ops: list[OpDraft]
    holds: dict[int, int]                 # a host copy's storage id -> the op after which autograd lets go of it
    offloaded: frozenset[int]             # storages whose saves all went to the host: autograd holds none of them
    copies: int                           # saves copied


def offload_saved_tensors(ops: list[OpDraft], table: StorageTable, packs: Sequence, *, everything: bool, cuda: bool,
                          sid_of: Callable[[tuple[str, int]], int | None], joint_order: Sequence[str]) -> OffloadedStep:
    """`ops` with each offloaded save's copies (`packs`: python_lifetimes.ResolvedPack, in pack order).
    `everything`: every save is offloaded, pinned (`--offload activations`); else only those made inside the
    model file's save_on_cpu. `sid_of(producer)`: the storage id of a pack's producer; `joint_order`: the
    traced joint graph's node names in order (a pack or release after a node that is no op is placed at the
    nearest op before it)."""
    from tracer.capture.python_lifetimes import _nearest_earlier
    index_of = {d.name: i for i, d in enumerate(ops)}
    op_at = _nearest_earlier(index_of, joint_order)
    copied = {id(p) for p in packs if (everything or p.offload is not None) and (cuda or everything or p.offload)}
    saves_of: dict[int, list] = {}        # storage id -> [(pack op index, release op index, pack, offloaded)]
    for pack in packs:
        sid = sid_of(pack.producer) if pack.producer is not None else None
        if sid is None:
            continue
        release = op_at.get(pack.release_node) if pack.release_node is not None else None
        saves_of.setdefault(sid, []).append((op_at.get(pack.pack_node, -1), release, pack, id(pack) in copied))
    after: dict[int, list[OpDraft]] = {}          # op index -> copies made right after it (-1: before the first)
    before: dict[int, list[OpDraft]] = {}         # op index -> device copies made right before it
    host_copy: dict[int, int] = {}                # id(pack) -> its copy's storage id
    release_name: dict[int, str | None] = {}      # copy's storage id -> the op name after which it is let go
    kept_by_autograd: dict[int, int | None] = {}  # storage id -> release op of a save in the region kept as it is
    for sid, saves in saves_of.items():
        for pack_at, release, pack, offloaded in saves:
            if not offloaded:
                if pack.offload is not None:      # save_on_cpu(pin_memory=False) on a CPU target: the tensor itself
                    kept_by_autograd[sid] = max(kept_by_autograd.get(sid) or -1, release if release is not None else -1)
                continue
            copy = table.add(None, StorageRole.INTERMEDIATE, nbytes=pack.nbytes, dtype=pack.dtype, shape=pack.shape,
                             host=cuda, name=f"{table.get(sid).name or 'saved tensor'} (saved on the host)".strip())
            host_copy[id(pack)] = copy
            release_name[copy] = ops[release].name if release is not None else None
            source = ops[pack_at] if pack_at >= 0 else None
            after.setdefault(pack_at, []).append(_copy_op(f"save_on_cpu_pack_{copy}", Phase.FORWARD, sid, copy, pack,
                                                          source))
    device_copy: dict[tuple[int, int | None], int] = {}     # (host copy, autograd node) -> its device copy
    rewritten = list(ops)
    for i, d in enumerate(ops):
        if d.phase is not Phase.BACKWARD:
            continue
        sid_map = {}
        for value in input_values(d):
            saves = saves_of.get(value.storage_id)
            if not saves or value.storage_id in sid_map:
                continue
            _, _, pack, offloaded = _save_read_at(saves, i)
            if not offloaded:
                continue
            copy = host_copy[id(pack)]
            if cuda:               # unpack: a device copy per node that reads it, held while the node runs
                key = (copy, d.seq_nr)
                if key not in device_copy:
                    device_copy[key] = table.add(None, StorageRole.INTERMEDIATE, nbytes=pack.nbytes, dtype=pack.dtype,
                                                 shape=pack.shape, name=f"{table.get(copy).name} (back on the device)")
                    before.setdefault(i, []).append(
                        dataclasses.replace(_copy_op(f"save_on_cpu_unpack_{device_copy[key]}", Phase.BACKWARD, copy,
                                                     device_copy[key], pack, d), seq_nr=d.seq_nr))
                copy = device_copy[key]
            sid_map[value.storage_id] = copy
        if sid_map:
            rewritten[i] = _remapped(d, sid_map)
    out = list(after.get(-1, []))
    for i, d in enumerate(rewritten):
        out += before.get(i, []) + [d] + after.get(i, [])
    final_index = {d.name: i for i, d in enumerate(out)}
    last = len(out) - 1 - next((k for k, d in enumerate(reversed(out)) if d.phase is Phase.BACKWARD), 0)
    holds = {copy: final_index[name] if name is not None else last for copy, name in release_name.items()}
    for sid, release in kept_by_autograd.items():
        holds[sid] = final_index[ops[release].name] if release is not None and release >= 0 else last
    offloaded = frozenset(sid for sid, saves in saves_of.items() if all(s[3] for s in saves))
    return OffloadedStep(ops=out, holds=holds, offloaded=offloaded, copies=len(release_name))


def _save_read_at(saves: list, op_index: int):
    """The save a backward op at `op_index` unpacks: the one let go first at or after it (autograd lets go
    of a node's saved variables right after the node ran); else the last one made."""
    released = [s for s in saves if s[1] is not None and s[1] >= op_index]
    return min(released, key=lambda s: s[1]) if released else saves[-1]


def _copy_op(name: str, phase: Phase, read: int, made: int, pack, like: OpDraft | None) -> OpDraft:
    return OpDraft(name=name, target=PACK_COPY, phase=phase, args=(TensorValue(read, pack.shape, pack.dtype),),
                   kwargs=(), outputs=(TensorValue(made, pack.shape, pack.dtype),),
                   source=like.source if like is not None else None, module=like.module if like is not None else "",
                   is_view=False, micro_batch=like.micro_batch if like is not None else None)


class _Others(dict):
    """A storage-id map that leaves the ids it does not name as they are."""
    def __missing__(self, sid: int) -> int:
        return sid


def _remapped(d: OpDraft, sid_map: dict[int, int]) -> OpDraft:
    """`d` reading (and, for a view, making: autograd's detach of what it unpacks) the copies in `sid_map`."""
    others = _Others(sid_map)
    return dataclasses.replace(d, args=remap(d.args, others), kwargs=remap(d.kwargs, others),
                               outputs=remap(d.outputs, others))


def offload_note(step: OffloadedStep, *, everything: bool, cuda: bool) -> str:
    if not step.copies and not cuda:
        return ("the model file's torch.autograd.graph.save_on_cpu(pin_memory=False): on a CPU target nothing is "
                "copied (tensor.cpu() of a CPU tensor is the tensor itself), so autograd holds the saved tensors")
    where = "--offload activations (save_on_cpu(pin_memory=True) around forward and loss)" if everything \
        else "the model file's torch.autograd.graph.save_on_cpu"
    view = ("each copied back to the device for the node that reads it in backward" if cuda
            else "on a CPU target the copies share the CPU's memory and backward reads them as they are")
    return (f"{where}: every saved tensor is copied to host memory as autograd saves it, once per save "
            f"(parameters and inputs a node saves included; their bytes: the host line); {view}")
