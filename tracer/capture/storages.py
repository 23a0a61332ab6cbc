"""A mutable table of storages used while capturing; frozen into `Storage` records at the end.

Keys are torch StorageImpl addresses (`untyped_storage()._cdata`), valid only while the tensors that
own them are alive: the capture keeps them alive, or forgets a key when it sees its storage released
(`StepRecorder`), so one key never names two storages. A wrapper tensor subclass with one inner tensor (a
DTensor: its local shard) is that inner tensor's storage; the wrapper's own storage is a placeholder of the
global size that holds nothing.
"""
from __future__ import annotations

import dataclasses

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from tracer.stepgraph import Storage, StorageRole, TensorValue


def storage_key(t: torch.Tensor) -> int:
    return _holder(t).untyped_storage()._cdata


def _holder(t: torch.Tensor) -> torch.Tensor:
    """The tensor whose storage holds `t`'s memory: `t`, or the one inner tensor of a wrapper subclass that
    has one (a DTensor's local shard: the wrapper's own storage is a placeholder of the global size)."""
    if not is_traceable_wrapper_subclass(t):
        return t
    parts = memory_parts(t)
    return parts[0] if len(parts) == 1 else t


def memory_parts(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold `t`'s memory: `t` itself, or a wrapper subclass's inner tensors
    (`__tensor_flatten__`: a DTensor's local shard, not its device mesh), recursively."""
    if not is_traceable_wrapper_subclass(t):
        return [t]
    attributes, _ = t.__tensor_flatten__()
    inner = (getattr(t, attribute) for attribute in attributes)
    return [part for value in inner if isinstance(value, torch.Tensor) for part in memory_parts(value)]


def flat_tensors(val) -> list[torch.Tensor]:
    """The tensors of an op's value (a tensor, or nested tuples/lists of them), in order: an op's outputs."""
    if isinstance(val, torch.Tensor):
        return [val]
    if isinstance(val, (tuple, list)):
        return [t for item in val for t in flat_tensors(item)]
    return []


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclasses.dataclass
class _Entry:
    nbytes: int
    role: StorageRole
    dtype: str
    shape: tuple[int, ...]
    preexisting: bool = False
    persistent: bool = False
    released_after_op: int | None = None
    held_until_op: int | None = None
    fused: bool = False
    name: str = ""
    host: bool = False
    frozen: bool = False
    caller_held: bool = False
    weights: int | None = None

    def fields(self) -> dict:
        """Its fields by name: a shallow copy (every field holds an immutable value), which
        `dataclasses.asdict`'s recursive copy costs several times over on a large table."""
        return dict(vars(self))


class StorageTable:
    def __init__(self) -> None:
        self._entries: list[_Entry] = []
        self._by_key: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, t: torch.Tensor) -> bool:
        return storage_key(t) in self._by_key

    def lookup(self, t: torch.Tensor) -> int | None:
        return self._by_key.get(storage_key(t))

    def add(self, t: torch.Tensor | None, role: StorageRole, *, nbytes: int | None = None, **fields) -> int:
        """A new storage for tensor `t` (or a synthetic one when `t` is None, with explicit nbytes/shape)."""
        sid = len(self._entries)
        if t is not None:
            t = _holder(t)
            entry = _Entry(nbytes=t.untyped_storage().nbytes(), role=role, dtype=dtype_name(t.dtype),
                           shape=tuple(int(d) for d in t.shape), **fields)
            self._by_key[storage_key(t)] = sid
        else:
            entry = _Entry(nbytes=nbytes, role=role, **fields)
        self._entries.append(entry)
        return sid

    def alias(self, t: torch.Tensor, sid: int) -> None:
        self._by_key[storage_key(t)] = sid

    def forget_key(self, key: int) -> None:
        """The storage behind `key` was released; its address may now be reused by a new storage."""
        self._by_key.pop(key, None)

    def update(self, sid: int, **fields) -> None:
        for k, v in fields.items():
            setattr(self._entries[sid], k, v)

    def hold_until(self, sid: int, op_index: int) -> None:
        """Something holds storage `sid` at least through op `op_index`: its hold only ever extends."""
        held = self._entries[sid].held_until_op
        self._entries[sid].held_until_op = op_index if held is None else max(held, op_index)

    def get(self, sid: int) -> _Entry:
        return self._entries[sid]

    def value(self, t: torch.Tensor, sid: int | None = None) -> TensorValue:
        sid = self._by_key[storage_key(t)] if sid is None else sid
        return TensorValue(sid, tuple(int(d) for d in t.shape), dtype_name(t.dtype))

    def freeze(self) -> tuple[Storage, ...]:
        return tuple(Storage(storage_id=i, **e.fields()) for i, e in enumerate(self._entries))
