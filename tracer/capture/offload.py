"""CPU offload (--offload optimizer | optimizer+params), as ZeRO-Offload and FSDP2's CPUOffloadPolicy do it:
the optimizer state lives in host memory and the optimizer step runs on the host CPU (--offload
activations, the saved tensors, is capture/activation_offload.py).

What is modelled, on the captured step (the device's memory and, apart, the host's: `Storage.host`):
  * host memory: the optimizer state, a copy of each trainable parameter in its own dtype (the copy the
    host optimizer updates), one gradient buffer per parameter (pinned, made once), and the optimizer
    step's temporaries (the recorded step, run over the host copies);
  * gradients: each is copied to its host buffer as soon as it is complete (a post-accumulate-grad hook:
    after the autograd node that produced it) and its device storage is freed then, so gradients do not
    pile up on the device through backward; no device copy buffer is made (the copy goes straight to the
    pinned host buffer);
  * `optimizer`: after the host step, each parameter is copied back into its device storage in place
    (`copy_`, no device allocation);
  * `optimizer+params`: the parameters live on the host only; each is copied to the device just before
    its first forward use and freed after its last one, and copied again for backward (before its first
    use there, freed after its last) - FSDP2's unsharded parameters, per parameter rather than per
    unit (the per-unit buffers of `--shard fsdp` are not applied here). Frozen parameters stay on the
    device.
Not modelled: overlap of the copies with compute (the copies are not ops of the timeline: they take no
device memory), pinned staging buffers beyond the gradient buffers, DeepSpeed's reduce buckets and
fp32 master weights of a bf16 model (the host copy has the parameter's dtype), host temporaries of the
copies. Refused: with --accumulate (gradients accumulate on the host), --zero-grad zeros and --shard.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

from tracer.capture.convert import OpDraft
from tracer.capture.splice import remap
from tracer.capture.storages import StorageTable
from tracer.errors import UsageError
from tracer.choices import OFFLOAD_MODES  # noqa: F401 - the names, without torch, for the CLI
from tracer.stepgraph import Phase, StorageRole, TensorValue


def check_offload(mode: str | None, *, accumulate: int, zero_grad_set_to_none: bool, shard: str | None = None,
                  policies: tuple[str, ...] = ("eager",)) -> None:
    """Raises UsageError for an unknown mode or a combination that is not modelled."""
    if mode is None:
        return
    if mode not in OFFLOAD_MODES:
        raise UsageError(f"--offload {mode!r} is not valid", hint=f"valid: {', '.join(OFFLOAD_MODES)}")
    if mode == "activations":      # capture/activation_offload.py
        others = [p for p in policies if p != "eager"]
        if others or shard is not None:
            raise UsageError(f"--offload activations is modelled on the eager step without sharding, not with "
                             f"{', '.join(others) or '--shard ' + str(shard)}",
                             hint="pass --policy eager, without --shard")
        return
    if shard is not None:
        raise UsageError("--offload with --shard is not modelled (the per-rank view keeps the state on the device)",
                         hint="drop one of them")
    if accumulate > 1:
        raise UsageError("--offload with --accumulate is not modelled (gradients accumulate on the host)",
                         hint="drop one of them")
    if not zero_grad_set_to_none:
        raise UsageError("--offload frees each device gradient once it is copied to the host: it needs "
                         "--zero-grad none")


def offload_step(ops: list[OpDraft], table: StorageTable, *, mode: str, param_sids: tuple[int, ...],
                 grad_sids: tuple[int, ...], compiled: bool, wrapper: str | None = None,
                 free_device_gradients: bool = True,
                 device_state_names: frozenset[str] = frozenset()) -> tuple[list[OpDraft], tuple[str, ...]]:
    """`ops` (forward, backward, then the recorded optimizer step) with the optimizer on the host for the
    parameters `param_sids` (gradients `grad_sids`); the table's storages are updated in place. Returns the
    ops and a note for the report. `wrapper`: the optimizer wrapper that asked for it (optimizer_wrappers.py),
    which may keep each device gradient until zero_grad (`free_device_gradients=False`) and the state named
    in `device_state_names` (its small parameters' optimizer) on the device."""
    opt_start = next((i for i, d in enumerate(ops) if d.phase is Phase.OPTIMIZER), len(ops))
    host_of: dict[int, int] = {}
    for sid in param_sids:
        host_of[sid] = _host_copy(table, sid, StorageRole.PARAMETER, "host copy")
    ready = _gradients_ready(ops, opt_start, compiled) if free_device_gradients else None
    for sid in grad_sids:
        host_of[sid] = _host_copy(table, sid, StorageRole.GRADIENT, "host buffer")
        if free_device_gradients:
            table.update(sid, persistent=False, released_after_op=ready(sid))
    on_device = {v.storage_id for d in ops[:opt_start] for v in d.outputs + _inputs(d)}
    for d in ops[opt_start:]:
        for v in d.outputs + _inputs(d):
            if v.storage_id not in on_device and v.storage_id not in host_of:
                table.update(v.storage_id, host=True)
    for sid in range(len(table)):
        entry = table.get(sid)
        if entry.role is StorageRole.OPTIMIZER_STATE:
            table.update(sid, host=entry.name not in device_state_names)
    sid_map = {sid: host_of.get(sid, sid) for sid in range(len(table))}
    host_step = [_remapped(d, sid_map) for d in ops[opt_start:]]
    if wrapper is not None:
        kept = len(device_state_names)
        return ops[:opt_start] + host_step + _copy_back(table, param_sids, host_of), (
            f"{wrapper}: modelled as --offload optimizer: {len(param_sids)} parameter(s) stepped on the host "
            "(their state, a host copy and a pinned gradient buffer each there)"
            + (f", {kept} state tensors of the smaller parameters' optimizer on the device" if kept else "")
            + ("; each device gradient freed once copied to the host (offload_gradients=True)" if free_device_gradients
               else "; device gradients kept until zero_grad (offload_gradients=False)"),)
    if mode == "optimizer":
        return ops[:opt_start] + host_step + _copy_back(table, param_sids, host_of), (
            "--offload optimizer: optimizer state and step on the host; gradients copied to host buffers as "
            "each completes (freed on the device then), parameters copied back in place after the step",)
    device_ops = _parameters_on_demand(ops[:opt_start], table, param_sids)
    return device_ops + host_step, (
        "--offload optimizer+params: parameters, optimizer state and step on the host; each parameter is "
        "copied to the device for its forward uses and again for its backward uses (per parameter, not "
        "FSDP's per-unit gather); gradients copied to host buffers as each completes",)


def _host_copy(table: StorageTable, sid: int, role: StorageRole, what: str) -> int:
    e = table.get(sid)
    return table.add(None, role, nbytes=e.nbytes, dtype=e.dtype, shape=e.shape, preexisting=True,
                     persistent=True, host=True, name=f"{e.name} ({what})")


def _gradients_ready(ops: list[OpDraft], opt_start: int, compiled: bool) -> Callable[[int], int]:
    """Gradient storage id -> the op after which it is complete: the end of the autograd node that last
    wrote it (eager), or the end of backward (a compiled backward returns its gradients together)."""
    if compiled:
        end = max(i for i, d in enumerate(ops[:opt_start]) if d.phase is Phase.BACKWARD)
        return lambda sid: end
    last_touch: dict[int, int] = {}
    for i, d in enumerate(ops[:opt_start]):
        for v in d.outputs + _inputs(d):
            last_touch[v.storage_id] = i

    def ready(sid: int) -> int:
        last = last_touch.get(sid, opt_start - 1)
        while last + 1 < opt_start and ops[last].seq_nr is not None and ops[last + 1].seq_nr == ops[last].seq_nr:
            last += 1
        return last
    return ready


def _parameters_on_demand(ops: list[OpDraft], table: StorageTable, param_sids: tuple[int, ...]) -> list[OpDraft]:
    """Parameters held on the host: the device storage of each is its forward copy (made at first use,
    freed after last use); backward reads a second copy of its own."""
    first_backward = next((i for i, d in enumerate(ops) if d.phase is Phase.BACKWARD), len(ops))
    sid_map = {sid: sid for sid in range(len(table))}
    for sid in param_sids:
        e = table.get(sid)
        table.update(sid, preexisting=False, persistent=False, name=f"{e.name} (device copy for forward)")
        sid_map[sid] = table.add(None, StorageRole.PARAMETER, nbytes=e.nbytes, dtype=e.dtype, shape=e.shape,
                                 name=f"{e.name} (device copy for backward)")
    return ops[:first_backward] + [_remapped(d, sid_map) for d in ops[first_backward:]]


def _copy_back(table: StorageTable, param_sids: tuple[int, ...], host_of: dict[int, int]) -> list[OpDraft]:
    out = []
    for sid in param_sids:
        e = table.get(sid)
        device, host = TensorValue(sid, e.shape, e.dtype), TensorValue(host_of[sid], e.shape, e.dtype)
        out.append(OpDraft(name=f"offload_copy_back_{sid}", target="aten.copy_.default", phase=Phase.OPTIMIZER,
                           args=(device, host), kwargs=(), outputs=(device,), source=None, module="", is_view=True))
    return out


def _remapped(d: OpDraft, sid_map: dict[int, int]) -> OpDraft:
    return dataclasses.replace(d, args=remap(d.args, sid_map), kwargs=remap(d.kwargs, sid_map),
                               outputs=remap(d.outputs, sid_map))


def _inputs(d: OpDraft) -> tuple[TensorValue, ...]:
    from tracer.stepgraph import _iter_values
    return tuple(_iter_values((d.args, tuple(v for _, v in d.kwargs))))
