"""Copy ops recorded over one storage table into another: the optimizer step into each policy's step
graph (optimizer.py) and later micro-batches into an accumulated step (accumulation.py)."""
from __future__ import annotations

import dataclasses

from tracer.capture.convert import OpDraft
from tracer.capture.storages import StorageTable
from tracer.stepgraph import TensorValue


def copy_storages(source: StorageTable, table: StorageTable, sid_map: dict[int, int], *, ops_offset: int) -> None:
    """Add every storage of `source` that `sid_map` does not map yet to `table`, its op indices moved by
    `ops_offset`; `sid_map` gains the new ids."""
    for sid in range(len(source)):
        if sid in sid_map:
            continue
        fields = source.get(sid).fields()
        for key in ("released_after_op", "held_until_op"):
            if fields[key] is not None:
                fields[key] += ops_offset
        sid_map[sid] = table.add(None, **fields)


def relocated_ops(ops: list[OpDraft], sid_map: dict[int, int], *, ops_offset: int, suffix: str = "",
                  **fields) -> list[OpDraft]:
    """`ops` over the storages `sid_map` names, renamed for their place after `ops_offset` ops."""
    return [dataclasses.replace(d, name=f"{d.name}{suffix}" if suffix else f"{d.phase.value}_{ops_offset + i}",
                                args=remap(d.args, sid_map), kwargs=remap(d.kwargs, sid_map),
                                outputs=remap(d.outputs, sid_map), **fields)
            for i, d in enumerate(ops)]


def remap(value, sid_map: dict[int, int]):
    if isinstance(value, TensorValue):
        return dataclasses.replace(value, storage_id=sid_map[value.storage_id])
    if isinstance(value, tuple):
        return tuple(remap(v, sid_map) for v in value)
    if isinstance(value, list):
        return [remap(v, sid_map) for v in value]
    return value
