"""How long the forward's Python code keeps each tensor it gets from a torch call, observed while the joint
graph is traced from the module itself.

The direct trace (`aot-joint`) runs the user's forward as Python, on functional tensors over fake ones:
every name, attribute, list, dict, tuple and closure holds those objects exactly as it holds real tensors
in eager, and CPython frees an object when its last reference goes. `PythonLifetimes` puts a
`weakref.finalize` on every tensor a forward torch call returns (the calls `_SourceMetaMode` sees: the
user's own, not the ones inside torch's Python functions) and records, when the object dies, the last
node the trace had made: eager lets go of that tensor's storage after the op of that node (or later, for
another reference to the same storage). An object that outlives the forward is held by autograd (a saved
tensor) or by the trace itself (the loss), not by the forward's Python code, whose frames have all
returned: that is the graph's and autograd's business (liveness, saved tensors), not this module's.

`observed_holds(deaths, ...)` turns the records into storage id -> op index of the last forward op that
the storage is held through, and names the storages whose Python release it could not see (an object
autograd saved outlives the forward whatever Python does with it). Not observed: tensors made inside a C++
kernel or a torch Python function (capture/calls.py holds those), recomputation under checkpointing (a
rerun is traced inside backward), and the export rungs (the exported module's interpreter, not the user's
Python, runs there).
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import weakref
from collections.abc import Sequence

import torch
from torch.utils._pytree import tree_leaves

from tracer.capture.storages import dtype_name, flat_tensors, storage_key


@dataclasses.dataclass(frozen=True)
class PythonDeath:
    storage_keys: tuple[int, ...]     # the fake storages the object had (an in-place call gives it another)
    last_node: object                 # the fx node the trace had made last when the object died (or, for
                                      # an in-place call's tensor, let go of its storage); None: none yet
    saved: bool = False               # autograd's saved reference died (its node was freed), not a Python
                                      # object's: in the forward, a branch the loss does not reach; in
                                      # backward, right after its node ran (ctx.save_for_backward's unused ones)


@dataclasses.dataclass
class SavedPack:
    """One tensor autograd saved in the forward (one SavedVariable: a tensor two nodes save is packed twice),
    seen by the capture's pack hook. `offload`: the pack ran inside the user's `save_on_cpu` region (True or
    False: its pin_memory), else None. `pack_node` / `release_node`: the fx node the trace had made last
    when autograd packed it and when it let go of it (its node ran in backward, or died in the forward)."""
    storage_key: int
    nbytes: int                       # the packed tensor's own elements (a saved view copies only its own)
    shape: tuple[int, ...]
    dtype: str
    pack_node: object
    offload: bool | None = None
    release_node: object = None


@dataclasses.dataclass(frozen=True)
class ResolvedPack:
    """A `SavedPack` in the names of the joint graph (see `resolve_packs`)."""
    producer: tuple[str, int] | None  # (node name, output position) that made the saved storage (a
                                      # placeholder's name for a parameter, buffer or input)
    nbytes: int
    shape: tuple[int, ...]
    dtype: str
    pack_node: str | None             # the last node a graph keeps at or before the pack; None: before any
    release_node: str | None          # likewise for the release; None: not released while traced
    offload: bool | None = None


def resolve_packs(packs: Sequence[SavedPack], joint) -> tuple[ResolvedPack, ...]:
    """The packs in terms of the traced joint graph (`joint`: its GraphModule)."""
    kept = {node.name for node in joint.graph.nodes}
    producer_of: dict[int, tuple[str, int]] = {}
    for node in joint.graph.nodes:
        for position, t in enumerate(flat_tensors(node.meta.get("val"))):    # as OpDraft.outputs
            producer_of.setdefault(storage_key(t), (node.name, position))

    def kept_name(node) -> str | None:
        while node is not None and getattr(node, "op", None) != "root" and node.name not in kept:
            node = node.prev
        return node.name if node is not None and getattr(node, "op", None) != "root" else None

    return tuple(ResolvedPack(producer=producer_of.get(p.storage_key), nbytes=p.nbytes, shape=p.shape, dtype=p.dtype,
                              pack_node=kept_name(p.pack_node), release_node=kept_name(p.release_node),
                              offload=p.offload) for p in packs)


def save_on_cpu_pinning(hooks) -> bool | None:
    """The pin_memory of a `torch.autograd.graph.save_on_cpu` whose (pack, unpack) hooks are `hooks`, or
    None when they are another's. save_on_cpu's pack is a closure over `pin_memory`."""
    pack = hooks[0] if hooks else None
    if getattr(pack, "__qualname__", "") != "save_on_cpu.__init__.<locals>.pack_to_cpu":
        return None
    cells = dict(zip(pack.__code__.co_freevars, pack.__closure__ or ()))
    return bool(cells["pin_memory"].cell_contents) if "pin_memory" in cells else False


def foreign_hooks_name(hooks) -> str | None:
    """The qualified name of the user's saved-tensor pack hook when it is neither checkpointing's (modelled
    by the checkpoint capture) nor save_on_cpu's (modelled as activation offloading): what the capture
    does not run, for a note."""
    pack = hooks[0] if hooks else None
    module = getattr(pack, "__module__", "") or ""
    if pack is None or module.startswith("torch.utils.checkpoint") or save_on_cpu_pinning(hooks) is not None:
        return None
    return f"{module}.{getattr(pack, '__qualname__', type(pack).__name__)}"


@dataclasses.dataclass(frozen=True)
class ObservedDeath:
    """A `PythonDeath` in the names of the joint graph, which every policy's graph keeps for its nodes."""
    producers: tuple[tuple[str, int], ...]   # (node name, output position) of the storages the object had
    last_node: str | None                    # the last node made before it died that a graph keeps, if any
    in_backward: bool                        # it died in backward: autograd, not Python, held it last
    saved: bool = False                      # autograd's saved reference (PythonDeath.saved)


def resolve_deaths(deaths: Sequence[PythonDeath], joint) -> tuple[ObservedDeath, ...]:
    """The deaths in terms of the traced joint graph (`joint`: its GraphModule): each storage key becomes
    the node that made that storage, the last node the nearest earlier one still in the graph."""
    producer_of: dict[int, tuple[str, int]] = {}
    kept: set[str] = set()
    for node in joint.graph.nodes:
        kept.add(node.name)
        for position, t in enumerate(flat_tensors(node.meta.get("val"))):    # as OpDraft.outputs
            producer_of.setdefault(storage_key(t), (node.name, position))
    resolved = []
    for death in deaths:
        node, in_backward = death.last_node, False
        while node is not None and getattr(node, "op", None) != "root" and node.name not in kept:
            node = node.prev
        if node is not None and getattr(node, "op", None) != "root":
            in_backward = node.meta.get("partitioner_tag") == "is_backward"
        name = node.name if node is not None and getattr(node, "op", None) != "root" else None
        producers = tuple(producer_of[k] for k in death.storage_keys if k in producer_of)
        resolved.append(ObservedDeath(producers=producers, last_node=name, in_backward=in_backward,
                                      saved=death.saved))
    return tuple(resolved)


class PythonLifetimes:
    """Records `PythonDeath`s while the joint graph is traced. `watch(args, out, inplace)` after each forward
    torch call; `close()` when the trace ends (objects that die afterwards are not the forward's)."""

    def __init__(self):
        self.deaths: list[PythonDeath] = []
        self._keys_of: dict[int, list[int]] = {}     # id(object) -> its storage keys, while it lives
        self._graph = None
        self._open = True
        self._unpacked = None                         # what the unpack hook returned last (see `unpacking`)
        self.packs: list[SavedPack] = []              # every save autograd made in the forward
        self.foreign_hooks: set[str] = set()          # the user's saved-tensor hooks the capture does not run

    def watch(self, args: tuple, out, inplace: bool) -> None:
        graph = self._current_graph()
        if graph is None or not self._open:           # AOT's metadata run of the forward: no graph is traced
            return
        self._graph = graph
        if inplace and args and id(args[0]) in self._keys_of and functional_storage_key(args[0]) is not None:
            # the object now holds the write's result; the storage it had is let go here unless the write
            # went into it (capture/inplace.py: then both are one storage, and the later release counts)
            keys = self._keys_of[id(args[0])]
            self.deaths.append(PythonDeath(tuple(keys), _last_node(graph)))
            keys[:] = [functional_storage_key(args[0])]
        for t in tree_leaves(out):
            if id(t) in self._keys_of:
                continue
            key = functional_storage_key(t)
            keys = [key] if key is not None else _subclass_inner_keys(t)
            if not keys:
                continue
            self._keys_of[id(t)] = keys
            weakref.finalize(t, self._died, id(t), keys)

    @contextlib.contextmanager
    def watching(self):
        """Around a custom Function's Python backward: each torch call it makes is watched as the forward's
        are, so what its locals hold (until it returns) is seen. AOT runs backward inside its own
        torch.autograd.grad call, where the forward's mode is off."""
        with _WatchMode(self):
            yield

    @contextlib.contextmanager
    def saving(self):
        """Autograd's own references, around one forward torch call: every tensor autograd saves in it is
        packed in a holder that dies when its autograd node does. A node dies in the forward when nothing
        the loss needs reaches it (a pooling head whose output the loss ignores): eager frees what it
        saved then, not at the end of the forward. AOT turns saved-tensor hooks off while it traces (they
        are to run at runtime); these are turned on for the call only, and never over the user's own
        hooks (checkpointing's), nor where hooks are disabled."""
        autograd = torch._C._autograd
        if not self._open or self._current_graph() is None or not autograd._saved_tensors_hooks_is_enabled():
            yield
            return
        users = autograd._top_saved_tensors_default_hooks(True)
        if users is not None and getattr(users[0], "func", None) == self._pack:
            yield                     # a torch call inside one this records (a custom Function's forward)
            return
        offload = save_on_cpu_pinning(users) if users is not None else None
        if users is not None and offload is None:
            # the user's own hooks (checkpointing's are modelled by the checkpoint capture; others are named)
            foreign = foreign_hooks_name(users)
            if foreign is not None:
                self.foreign_hooks.add(foreign)
            yield
            return
        tracing = autograd._saved_tensors_hooks_set_tracing(False)
        try:
            # inside the user's save_on_cpu these hooks stand in for its own: what it packs is recorded as
            # offloaded (capture/activation_offload.py makes the copies), and the trace keeps the tensor
            with torch.autograd.graph.saved_tensors_hooks(functools.partial(self._pack, offload=offload),
                                                          self._unpack):
                yield
        finally:
            autograd._saved_tensors_hooks_set_tracing(tracing)

    def _pack(self, t, offload: bool | None = None):
        holder = _SavedHolder(t, offloaded=offload is not None)
        key = functional_storage_key(t)
        if key is not None and self._open and self._current_graph() is not None:
            inner = torch._from_functional_tensor(t.elem)
            pack = SavedPack(storage_key=key, nbytes=inner.numel() * inner.element_size(),
                             shape=tuple(int(d) for d in inner.shape), dtype=dtype_name(inner.dtype),
                             pack_node=_last_node(self._current_graph()), offload=offload)
            self.packs.append(pack)
            weakref.finalize(holder, self._pack_released, pack)
            if offload is None:      # an offloaded save holds the host copy, not this storage
                weakref.finalize(holder, self._saved_died, key)
        return holder

    def _pack_released(self, pack: SavedPack) -> None:
        if self._open and self._graph is not None:
            pack.release_node = _last_node(self._graph)

    def _unpack(self, holder: _SavedHolder):
        # without hooks, autograd hands back a saved original as it is and makes a variable of a saved
        # output by a detach: the original's detach is the one to answer (`unpacking`)
        self._unpacked = holder.tensor if holder.original else None
        return holder.tensor

    @contextlib.contextmanager
    def unpacking(self):
        """While the joint is traced: autograd makes a new variable of what an unpack hook returns, by a
        dispatched detach, which for a saved original (not a node's own output) autograd without hooks
        does not make; that detach is answered with a new functional wrapper of the same value, made
        without dispatch, so the traced backward is the one eager's saved tensors give."""
        from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
        dispatch = FunctionalTensorMode.__torch_dispatch__
        lifetimes = self

        def __torch_dispatch__(mode, func, types, args=(), kwargs=None):
            unpacked, lifetimes._unpacked = lifetimes._unpacked, None
            # a saved wrapper subclass (a DTensor) is detached by its own dispatch, on its inner tensors
            if func is torch.ops.aten.detach.default and unpacked is not None and args and args[0] is unpacked \
                    and (isinstance(unpacked, FunctionalTensor) or not is_traceable_wrapper_subclass(unpacked)):
                return FunctionalTensor(unpacked.elem, mode)
            return dispatch(mode, func, types, args, kwargs)

        FunctionalTensorMode.__torch_dispatch__ = __torch_dispatch__
        try:
            yield
        finally:
            FunctionalTensorMode.__torch_dispatch__ = dispatch
            self._unpacked = None

    def _saved_died(self, key: int) -> None:
        if self._open and self._graph is not None:
            self.deaths.append(PythonDeath((key,), _last_node(self._graph), saved=True))

    def close(self) -> None:
        self._open = False

    def take_deaths(self) -> list[PythonDeath]:
        """The deaths recorded, handed over once: the finalizers of objects that outlive the trace (module
        attributes, the loss) keep this recorder alive, so it lets go of the graph and its nodes."""
        deaths, self.deaths, self._graph = self.deaths, [], None
        self._keys_of.clear()
        return deaths

    def take_packs(self) -> list[SavedPack]:
        """The saves recorded, handed over once (after `take_deaths`)."""
        packs, self.packs = self.packs, []
        return packs

    def _died(self, object_id: int, keys: list[int]) -> None:
        self._keys_of.pop(object_id, None)
        if self._open and self._graph is not None:
            self.deaths.append(PythonDeath(tuple(keys), _last_node(self._graph)))

    @staticmethod
    def _current_graph():
        from torch.fx.experimental.proxy_tensor import get_proxy_mode
        mode = get_proxy_mode()
        return getattr(getattr(mode, "tracer", None), "graph", None)


class _WatchMode(torch.overrides.TorchFunctionMode):
    """Watches the outputs of every torch call for `PythonLifetimes` (the forward's mode does more)."""

    def __init__(self, lifetimes: "PythonLifetimes"):
        super().__init__()
        self._lifetimes = lifetimes

    def __torch_function__(self, func, types, args=(), kwargs=None):
        from tracer.capture.inplace import is_inplace_call
        out = func(*args, **(kwargs or {}))
        self._lifetimes.watch(args, out, is_inplace_call(func, kwargs))
        return out


class _SavedHolder:
    """What a saved-tensor pack hook returns, holding what autograd would hold without hooks: a node's own
    output as `tensor_data()` would (a traced detach, so no node -> holder -> tensor -> node cycle keeps
    the node, and every node before it, alive past the forward, and the trace has the detach eager's
    save makes), anything else as it is. An output is told apart by its grad_fn: the node being built
    is the newest one (its sequence number is the last one handed out)."""
    __slots__ = ("tensor", "original", "__weakref__")

    def __init__(self, tensor, offloaded: bool = False):
        from torch._subclasses.functional_tensor import FunctionalTensor
        node = tensor.grad_fn
        self.original = not (isinstance(tensor, FunctionalTensor) and node is not None
                             and node._sequence_nr() == torch._C._autograd._get_sequence_nr() - 1)
        if self.original and offloaded and isinstance(tensor, FunctionalTensor):
            # save_on_cpu keeps a copy, not the object: the object dies when the forward's Python lets go
            # of it, as in eager; the trace keeps the value through a new wrapper made without dispatch
            self.tensor = FunctionalTensor(tensor.elem, torch._C._get_dispatch_mode(
                torch._C._TorchDispatchModeKey.FUNCTIONAL))
        else:
            self.tensor = tensor if self.original else tensor.detach()


def functional_storage_key(t) -> int | None:
    """The storage key of the fake tensor a functional tensor wraps now (None: not a functional tensor)."""
    from torch._subclasses.functional_tensor import FunctionalTensor
    if not isinstance(t, FunctionalTensor):
        return None
    return storage_key(torch._from_functional_tensor(t.elem))


def _subclass_inner_keys(t) -> list[int]:
    """The storage keys of a tensor subclass's inner tensors (torchao's float8 tensors: data and scale),
    which the object holds while it lives; [] for anything else."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not isinstance(t, torch.Tensor) or not is_traceable_wrapper_subclass(t):
        return []
    names, _ = t.__tensor_flatten__()
    keys = [functional_storage_key(getattr(t, name)) for name in names]
    return [k for k in keys if k is not None]


def _last_node(graph):
    return next(iter(reversed(graph.nodes)), None)


@dataclasses.dataclass(frozen=True)
class ObservedHolds:
    until: dict[int, int]          # storage id -> index of the last forward op a Python object held it through
    unseen: frozenset[int]         # storages an object of which outlived the forward: when its Python
                                   # references went is not seen (autograd's saved reference kept it)
    saved_until: dict[int, int] = dataclasses.field(default_factory=dict)
                                   # storage id -> the backward op after which autograd let go of it: what
                                   # eager saves, used in backward or not (only the joint as traced has it)
    backward_until: dict[int, int] = dataclasses.field(default_factory=dict)
                                   # storage id -> the backward op through which a custom Function's Python
                                   # backward held what it made (its locals live until it returns)


def observed_holds(deaths: Sequence[ObservedDeath], sid_of_output: dict[tuple[str, int], int],
                   op_index_of: dict[str, int], joint_order: Sequence[str],
                   backward_index_of: dict[str, int] | None = None,
                   python_backward_outputs: dict[tuple[str, int], int] | None = None) -> ObservedHolds:
    """`sid_of_output`: (node name, output position) -> storage id, for the forward's intermediates;
    `op_index_of`: the op index of each forward op's node name; `joint_order`: the joint graph's node names
    in order (a death after a node that is no op, a getitem or a placeholder, is placed at the nearest
    earlier op; before any, it holds nothing). An object that dies in backward was kept by autograd (a saved
    tensor holds the object itself), so its storage is `unseen`: under a policy that does not save it,
    another rule must say how long Python held it. `backward_index_of` (backward ops' node names, for a
    step read from the joint as traced): autograd's saved references that die in backward give
    `saved_until`; `python_backward_outputs` ((node name, position) -> storage id of what the ops of a custom
    Function's Python backward make) gives `backward_until`, from the deaths of that code's objects."""
    op_at = _nearest_earlier(op_index_of, joint_order)
    backward_at = _nearest_earlier(backward_index_of or {}, joint_order)
    until: dict[int, int] = {}
    saved_until: dict[int, int] = {}
    unseen: set[int] = set()
    backward_until: dict[int, int] = {}
    for death in deaths:
        op_index = op_at.get(death.last_node) if not death.in_backward else None
        if death.in_backward and not death.saved and python_backward_outputs and death.last_node in backward_at:
            for producer in death.producers:
                sid = python_backward_outputs.get(producer)
                if sid is not None:
                    backward_until[sid] = max(backward_until.get(sid, -1), backward_at[death.last_node])
        for producer in death.producers:
            sid = sid_of_output.get(producer)
            if sid is None:
                continue
            if death.in_backward and death.saved:
                if death.last_node in backward_at:
                    saved_until[sid] = max(saved_until.get(sid, -1), backward_at[death.last_node])
            elif death.in_backward:
                unseen.add(sid)
            elif op_index is not None:
                until[sid] = max(until.get(sid, -1), op_index)
    return ObservedHolds(until=until, unseen=frozenset(unseen), saved_until=saved_until, backward_until=backward_until)


def _nearest_earlier(index_of: dict[str, int], order: Sequence[str]) -> dict[str, int]:
    """node name -> the index of the nearest op at or before it in `order` that `index_of` names."""
    at: dict[str, int] = {}
    latest = None
    for name in order:
        latest = index_of.get(name, latest)
        if latest is not None:
            at[name] = latest
    return at
