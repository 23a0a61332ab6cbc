"""A deep step graph built from the same step captured with a few identical blocks.

    synthesize_depth(graph, depth, group=1) -> StepGraph
    block_reach(graph) -> int          the smallest `group` the synthesis of its model can work in

`graph` is the step of the model cut to k >= 4 blocks (`blocks.0` ... `blocks.{k-1}`, found by
blocks.py's `repeated_blocks`); the result is the step with `depth` blocks: the elements of block 1 (a
middle block: its forward, backward and recomputed ops, the optimizer's per-parameter ops, the storages
they make, its parameters, gradients and optimizer state, its entries in foreach tensor lists) are copied
`depth - k` times between blocks 1 and 2, and blocks 2 ... k-1 are renamed `blocks.{2 + depth - k}` ...
With `group` g > 1, units of g consecutive blocks take the blocks' place below (unit 1 is blocks g ... 2g-1,
copied (depth - k) / g times; a last unit may be shorter): compiled code can hand a buffer on across up to g
blocks, which one-block units cannot place (`block_reach`).
Nothing about the model is assumed; everything is read from the graph:

* An op's block is the block its module lies in; a module-less forward or backward op (the autograd
  engine summing gradients) belongs to the block of the op before it; an optimizer op belongs to the one
  block whose storages it touches (several: a foreach op, whose tensor lists get the copies' entries).
  A storage's block is its name's (parameters, gradients, optimizer state), else the block of the op
  that first touches it (an entry of a foreach op's output list: the block of that list position).
* Blocks 1 and 2 are aligned op by op (same targets, module paths relative to the block, phases); the
  alignment maps every storage block 1 touches to the one block 2 touches in the same place (its own,
  the previous block's output, the next block's incoming gradient, or a shared storage: itself).
* A storage that blocks two or more apart touch or free (a buffer compiled code reuses in every block or
  frees blocks later) is shared like one outside the blocks; a storage that blocks 1 and 2 both free at
  one op is freed there by every copy.
* Copy c of a block-1 element refers to copy c of its block's storages and ops, to copy c-1's (block 1's
  for c = 1) where block 1 refers to block 0, and to copy c+1's (block 2's for the last copy) where block
  1 refers to block 2. Block 2 then refers to the last copy, block 1 to the first. Storage ids and op
  indices are renumbered in step order, copies placed where the captured step puts the next block's
  (after block 1 in forward order, before it in backward order), with fresh autograd node ids.

Not checked here: that the result is the deeper model's step. The caller checks that by synthesizing a
depth it captured too and comparing the analyses (tracer/depth_capture.py). Refused with DepthError: fewer
than 4 blocks, blocks 1 and 2 that differ, and references this construction cannot place (an op outside
the blocks reading a block's storage outside a tensor list, a block reading a block two away).
"""
from __future__ import annotations

import dataclasses
import math
import re

from tracer.passes.blocks import block_of, repeated_blocks
from tracer.passes.depth import DepthError
from tracer.stepgraph import OpNode, Phase, Storage, StepGraph, StorageRole, TensorValue

_BASE = 1                      # the copied block
_NEXT = 2                      # the block the copies go before
_NUMBER = re.compile(r"(\d+)")


def synthesize_depth(graph: StepGraph, depth: int, group: int = 1) -> StepGraph:
    """`graph` with `depth` blocks (at least its own), copying units of `group` consecutive blocks (blocks
    `group` ... `2 * group - 1` are unit 1, the copied one). Raises DepthError when its units cannot be
    aligned or a reference cannot be placed."""
    blocks = repeated_blocks(graph)
    units = -(-len(blocks) // group)
    if units < 4:
        raise DepthError(f"the captured step has {len(blocks)} repeated blocks: synthesis in units of {group} needs "
                         f"at least {3 * group + 1} (two middle units to align)")
    extra = depth - len(blocks)
    if extra < 0 or extra % group:
        raise DepthError(f"cannot synthesize {depth} blocks from a step with {len(blocks)} in units of {group}")
    if extra == 0:
        return graph
    tags = _Tags(graph, blocks, group)
    align = _Alignment(graph, tags, blocks, group)
    return _Builder(graph, blocks, tags, align, extra // group, group).build()


def block_reach(graph: StepGraph) -> int:
    """How many blocks apart the ops that touch one storage lie, at most, among storages no op of the
    first or of the last block touches together with the other (those may be pools every block shares):
    the unit `synthesize_depth` needs for `graph`'s model (compiled code that hands a buffer from block to
    block, such as Inductor giving a block's weight gradient the buffer three later blocks used in turn,
    needs units of that many blocks). 0 for a step without repeated blocks."""
    blocks = repeated_blocks(graph)
    index_of = {b: i for i, b in enumerate(blocks)}
    touched: dict[int, set[int]] = {}
    for op in graph.ops:
        if block := block_of(op.module, index_of):
            for value in op.outputs + op.input_values():
                touched.setdefault(value.storage_id, set()).add(index_of[block])
    spans = [max(t) - min(t) for t in touched.values() if not (0 in t and len(blocks) - 1 in t)]
    return max(spans, default=0)


# ---------------------------------------------------------------------------------------------- tags

class _Tags:
    """The unit index (block index // group; None: outside the blocks) of every op and storage."""

    def __init__(self, graph: StepGraph, blocks: list[str], group: int = 1):
        unit_of = {b: i // group for i, b in enumerate(blocks)}
        self.op: list[int | None] = []
        self.storage: list[int | None] = [None] * len(graph.storages)
        seen = [False] * len(graph.storages)
        for s in graph.storages:                       # named: parameters, gradients, optimizer state
            block = block_of(s.name, unit_of) if s.name else ""
            if block:
                self.storage[s.storage_id], seen[s.storage_id] = unit_of[block], True
        previous: tuple[Phase, int | None] = (Phase.OPTIMIZER, None)
        for op in graph.ops:
            tag = self._op_tag(op, unit_of, previous)
            self.op.append(tag)
            previous = (op.phase, tag)
            position_tags = self._position_tags(op) if tag is None else {}
            for value in op.outputs + op.input_values():
                if not seen[value.storage_id]:
                    seen[value.storage_id] = True
                    self.storage[value.storage_id] = tag if tag is not None else position_tags.get(value.storage_id)
        self.pools = self._pools(graph)
        for sid in self.pools:
            self.storage[sid] = None

    def _pools(self, graph: StepGraph) -> frozenset[int]:
        """Storages that blocks two or more apart touch or free: a buffer compiled code reuses in every block
        or frees blocks later, one storage every block updates in place. Shared, like a storage outside the
        blocks."""
        touched: dict[int, set[int]] = {}
        for op, tag in zip(graph.ops, self.op):
            if tag is not None:
                for value in op.outputs + op.input_values():
                    touched.setdefault(value.storage_id, set()).add(tag)
        for s in graph.storages:                       # freed blocks away from its uses (compiled code's del)
            for op in (s.released_after_op, s.held_until_op):
                # (zero_grad's release of every gradient at the step's end is not a block's: under a
                # for-loop optimizer that op is the last parameter's)
                if op is not None and s.storage_id in touched and self.op[op] is not None \
                        and graph.ops[op].phase is not Phase.OPTIMIZER:
                    touched[s.storage_id].add(self.op[op])
        return frozenset(sid for sid, blocks in touched.items() if max(blocks) - min(blocks) > 1)

    def _op_tag(self, op: OpNode, unit_of: dict, previous) -> int | None:
        if op.phase is Phase.OPTIMIZER:
            found = {self.storage[v.storage_id] for v in op.outputs + op.input_values()} - {None}
            return found.pop() if len(found) == 1 else None
        block = block_of(op.module, unit_of)
        if block:
            return unit_of[block]
        if not op.module and previous[0] is op.phase:
            return previous[1]
        return None

    def _position_tags(self, op: OpNode) -> dict[int, int]:
        """An op outside the blocks with tensor lists: an untagged entry takes the block of the tagged
        entries at its position in lists of the same length (a foreach op's outputs, unnamed state)."""
        lists = [item for item in _lists(op)]
        by_length: dict[int, dict[int, int]] = {}
        for items in lists:
            for i, value in enumerate(items):
                tag = self.storage[value.storage_id]
                if tag is not None:
                    by_length.setdefault(len(items), {}).setdefault(i, tag)
        out = {}
        for items in lists:
            known = by_length.get(len(items), {})
            for i, value in enumerate(items):
                if i in known:
                    out.setdefault(value.storage_id, known[i])
        return out


def _lists(op: OpNode):
    """The tensor lists of an op: tuple arguments of tensors, and its outputs."""
    for arg in op.args + tuple(v for _, v in op.kwargs):
        if isinstance(arg, tuple) and arg and all(isinstance(a, TensorValue) for a in arg):
            yield arg
    if op.outputs:
        yield op.outputs


# ---------------------------------------------------------------------------------------------- alignment

def _runs(tags: list, wanted: int) -> list[list[int]]:
    """Maximal runs of consecutive positions tagged `wanted`."""
    runs: list[list[int]] = []
    for i, tag in enumerate(tags):
        if tag == wanted:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
    return runs


class _Alignment:
    """Block 1's elements -> block 2's: `op[i]`, and `storage[s]` for every storage block 1 touches."""

    def __init__(self, graph: StepGraph, tags: _Tags, blocks: list[str], group: int = 1):
        self.graph, self.tags, self.group = graph, tags, group
        base_runs, next_runs = _runs(tags.op, _BASE), _runs(tags.op, _NEXT)
        if [len(r) for r in base_runs] != [len(r) for r in next_runs]:
            raise DepthError(f"blocks {_BASE} and {_NEXT} run {len(sum(base_runs, []))} and "
                             f"{len(sum(next_runs, []))} ops in runs of {[len(r) for r in base_runs][:6]} and "
                             f"{[len(r) for r in next_runs][:6]}: the blocks are not identical")
        self.op: dict[int, int] = {}
        self.storage: dict[int, int] = {}
        for base, other in zip(base_runs, next_runs):
            for a, b in zip(base, other):
                self._pair_ops(graph.ops[a], graph.ops[b])
        for op, tag in zip(graph.ops, tags.op):
            if tag is None:
                for items in _lists(op):
                    self._pair_entries(items, op)
        self._pair_untouched_by_name(blocks)
        for s in graph.storages:
            if tags.storage[s.storage_id] == _BASE and s.storage_id not in self.storage:
                raise DepthError(f"storage {s.storage_id} ({s.name or s.role.value}) of block {_BASE} has no "
                                 f"counterpart in block {_NEXT}")
        self.storage_inverse = {b: a for a, b in self.storage.items()}
        self.op_inverse = {b: a for a, b in self.op.items()}

    def _pair_untouched_by_name(self, blocks: list[str]) -> None:
        """Named unit-1 storages no op pairs (optimizer state a fused step never reads as a tensor, e.g.
        the simulated bitsandbytes moments) -> the unit-2 storage of the same name relative to its block."""
        prefix = blocks[0].rsplit(".", 1)[0]
        paired = set(self.storage.values())
        by_name = {s.name: s for s in self.graph.storages
                   if s.name and self.tags.storage[s.storage_id] == _NEXT and s.storage_id not in paired}
        for s in self.graph.storages:
            if self.tags.storage[s.storage_id] != _BASE or s.storage_id in self.storage or not s.name:
                continue
            twin = by_name.get(_shift_block(s.name, prefix, self.group))
            if twin is not None and _storage_shape(twin) == _storage_shape(s):
                self.storage[s.storage_id] = twin.storage_id

    def _pair_ops(self, a: OpNode, b: OpNode) -> None:
        if _op_shape(a) != _op_shape(b):
            raise DepthError(f"op {a.index} ({a.target} in {a.module or '(root)'}) and op {b.index} ({b.target} in "
                             f"{b.module or '(root)'}) are at the same place in blocks {_BASE} and {_NEXT}: the "
                             "blocks are not identical")
        self.op[a.index] = b.index
        values_a, values_b = _values(a), _values(b)
        if len(values_a) != len(values_b):
            raise DepthError(f"op {a.index} ({a.target}) and its block-{_NEXT} twin op {b.index} take different "
                             "tensors")
        for x, y in zip(values_a, values_b):
            self._pair_storage(x.storage_id, y.storage_id, a)

    def _pair_entries(self, items: tuple, op: OpNode) -> None:
        base = [v.storage_id for v in items if self.tags.storage[v.storage_id] == _BASE]
        other = [v.storage_id for v in items if self.tags.storage[v.storage_id] == _NEXT]
        if len(base) != len(other):
            raise DepthError(f"op {op.index} ({op.target}) lists {len(base)} tensors of block {_BASE} and "
                             f"{len(other)} of block {_NEXT}")
        for x, y in zip(base, other):
            self._pair_storage(x, y, op)

    def _pair_storage(self, x: int, y: int, op: OpNode) -> None:
        tag_x, tag_y = self.tags.storage[x], self.tags.storage[y]
        shared = tag_x is None or tag_x not in (_BASE - 1, _BASE, _NEXT)
        pooled = x in self.tags.pools and y in self.tags.pools     # which pool buffer a block takes is immaterial
        if (shared and x != y and not pooled) or (not shared and tag_y != tag_x + 1) or \
                self.storage.setdefault(x, y) != y:
            raise DepthError(f"op {op.index} ({op.target} in {op.module or '(root)'}): storage {x} (block {tag_x}) "
                             f"and storage {y} (block {tag_y}) are at the same place in blocks {_BASE} and {_NEXT}")
        sx, sy = self.graph.storages[x], self.graph.storages[y]
        if not shared and _storage_shape(sx) != _storage_shape(sy):
            raise DepthError(f"storages {x} and {y} ({sx.name or sx.role.value}) differ between blocks {_BASE} "
                             f"and {_NEXT}")


def _shift_block(path: str, prefix: str, by: int) -> str:
    """`prefix.j.rest` -> `prefix.{j + by}.rest`; any other path unchanged."""
    if not path.startswith(prefix + "."):
        return path
    index, dot, tail = path[len(prefix) + 1:].partition(".")
    return f"{prefix}.{int(index) + by}{dot}{tail}" if index.isdigit() else path


def _values(op: OpNode) -> tuple[TensorValue, ...]:
    return op.input_values() + op.outputs


def _op_shape(op: OpNode) -> tuple:
    return (op.target, op.phase, op.recomputed, op.micro_batch, op.is_view, _relative_module(op.module),
            tuple(v.shape for v in _values(op)), tuple(v.dtype for v in _values(op)))


def _relative_module(module: str) -> str:
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.isdigit():
            return ".".join(parts[:i] + ["*"] + parts[i + 1:])
    return module


def _storage_shape(s: Storage) -> tuple:
    return (s.nbytes, s.role, s.dtype, s.shape, s.preexisting, s.persistent, s.fused, s.host, s.frozen,
            s.caller_held, s.released_after_op is None, s.held_until_op is None)


# ---------------------------------------------------------------------------------------------- building

class _ValueMap:
    """An op's arguments as copy `copy` of an element of block `tag` refers to them: each TensorValue on
    the storage that copy refers to, made once per value (a value is read by many ops)."""

    def __init__(self, builder: "_Builder", copy: int, tag: int):
        self.builder, self.copy, self.tag = builder, copy, tag
        self.made = builder.values.setdefault((copy, tag), {})        # id(TensorValue) -> its counterpart

    def __call__(self, obj):
        if isinstance(obj, TensorValue):
            new = self.made.get(id(obj))
            if new is None:
                new = self.made[id(obj)] = TensorValue(
                    self.builder._storage_ref(self.copy, self.tag, obj.storage_id), obj.shape, obj.dtype)
            return new
        if isinstance(obj, tuple):
            return tuple([self(item) for item in obj])
        return obj


class _Builder:
    """The deeper graph: elements are (copy, original index), copy 0 being the captured element."""

    def __init__(self, graph: StepGraph, blocks: list[str], tags: _Tags, align: _Alignment, copies: int,
                 group: int = 1):
        self.graph, self.blocks, self.tags, self.align, self.copies = graph, blocks, tags, align, copies
        self.group = group
        self.prefix = blocks[0].rsplit(".", 1)[0]
        self.refs: dict[tuple, int] = {}
        self.values: dict[tuple, dict] = {}          # (copy, tag) -> _ValueMap's values made so far
        self.counters = self._name_counters()

    def build(self) -> StepGraph:
        op_order = _stretch(list(range(len(self.graph.ops))), self.tags.op, self.align.op, self.copies)
        storage_order = _stretch(list(range(len(self.graph.storages))), self.tags.storage, self.align.storage,
                                 self.copies)
        self.op_index = {element: i for i, element in enumerate(op_order)}
        self.storage_id = {element: i for i, element in enumerate(storage_order)}
        self.nodes = self._node_ids()
        ops = tuple(self._op(copy, i, new_index) for new_index, (copy, i) in enumerate(op_order))
        storages = tuple(self._storage(copy, s, new_id) for new_id, (copy, s) in enumerate(storage_order))
        params, frozen = self._block_parameters()
        loss = self.graph.loss_storage_id
        return dataclasses.replace(
            self.graph, ops=ops, storages=storages,
            parameter_count=self.graph.parameter_count + self.copies * params,
            frozen_parameter_count=self.graph.frozen_parameter_count + self.copies * frozen,
            loss_storage_id=None if loss is None else self.storage_id[(0, loss)])

    # --- references

    def _storage_ref(self, copy: int, tag: int | None, sid: int) -> int:
        """The new id of storage `sid` as referred to by copy `copy` of an element of block `tag`."""
        key = (copy, tag, sid)
        if key not in self.refs:
            self.refs[key] = self.storage_id[self._ref(copy, tag, self.tags.storage[sid], sid, self.align.storage,
                                                       self.align.storage_inverse, "storage")]
        return self.refs[key]

    def _ref(self, copy: int, tag: int | None, target_tag: int | None, target: int, forward: dict, inverse: dict,
             what: str) -> tuple[int, int]:
        if copy:                                                  # a copy of a block-1 element
            if target_tag is None:
                return 0, target
            if target_tag not in (_BASE - 1, _BASE, _NEXT):
                raise DepthError(f"block {_BASE} refers to {what} {target} of block {target_tag}, two or more "
                                 "blocks away")
            if target_tag == _BASE:
                return copy, target
            if target_tag == _BASE - 1:
                return (0, forward[target]) if copy == 1 else (copy - 1, forward[target])
            return (0, target) if copy == self.copies else (copy + 1, inverse[target])
        if tag == _NEXT and target_tag == _BASE:
            return self.copies, target
        if tag == _BASE and target_tag == _NEXT:
            return 1, inverse[target]
        if tag is None and target_tag in (_BASE, _NEXT) and what == "storage":
            raise DepthError(f"an op outside the blocks reads storage {target} of block {target_tag} outside a "
                             "tensor list")
        if tag is not None and target_tag is not None and abs(tag - target_tag) > 1 and \
                {tag, target_tag} & {_BASE, _NEXT}:
            raise DepthError(f"block {tag} refers to {what} {target} of block {target_tag}, two or more blocks away")
        return 0, target

    def _op_ref(self, copy: int, storage: Storage, attribute: str) -> int | None:
        """The new index of the op `storage.<attribute>` names (released_after_op, held_until_op)."""
        op = getattr(storage, attribute)
        if op is None:
            return None
        sid = storage.storage_id
        tag, target_tag = self.tags.storage[sid], self.tags.op[op]
        twin = self.align.storage.get(sid) if tag == _BASE else self.align.storage_inverse.get(sid) \
            if tag == _NEXT else None
        if twin is not None and getattr(self.graph.storages[twin], attribute) == op:
            return self.op_index[(0, op)]     # blocks 1 and 2 both freed at one op: so is every copy
        if copy and target_tag == _BASE - 1:
            twin = getattr(self.graph.storages[self.align.storage[storage.storage_id]], attribute)
            if twin is None or self.tags.op[twin] != _BASE:
                raise DepthError(f"storage {storage.storage_id}'s {attribute} has no counterpart in block {_NEXT}")
            return self.op_index[(0, twin) if copy == 1 else (copy - 1, twin)]
        return self.op_index[self._ref(copy, tag, target_tag, op, self.align.op, self.align.op_inverse, "op")]

    # --- elements

    def _op(self, copy: int, index: int, new_index: int) -> OpNode:
        op = self.graph.ops[index]
        tag = self.tags.op[index]
        if tag is None:
            args = tuple(self._global_arg(a, op) for a in op.args)
            kwargs = tuple((k, self._global_arg(v, op)) for k, v in op.kwargs)
            outputs = self._global_list(op.outputs, op)
        else:
            fix = _ValueMap(self, copy, tag)
            args, kwargs, outputs = fix(op.args), tuple((k, fix(v)) for k, v in op.kwargs), fix(op.outputs)
        return _changed(op, index=new_index, name=op.name if not copy else f"{op.name}_copy{copy}", args=args,
                        kwargs=kwargs, outputs=outputs, module=self._rename(op.module, copy, tag),
                        autograd_node=self.nodes.get((copy, op.autograd_node), op.autograd_node))

    def _global_arg(self, obj, op: OpNode):
        if isinstance(obj, TensorValue):
            return _changed(obj, storage_id=self._storage_ref(0, None, obj.storage_id))
        if isinstance(obj, tuple) and obj and all(isinstance(item, TensorValue) for item in obj):
            return self._global_list(obj, op)
        if isinstance(obj, tuple):
            return tuple(self._global_arg(item, op) for item in obj)
        return obj

    def _global_list(self, items: tuple, op: OpNode) -> tuple:
        """A tensor list of an op outside the blocks, with the copies' entries after block 1's."""
        tags = [self.tags.storage[v.storage_id] for v in items]
        position = {v.storage_id: i for i, v in enumerate(items)}
        partner = {i: position[self.align.storage[v.storage_id]] for i, v in enumerate(items)
                   if tags[i] == _BASE and self.align.storage.get(v.storage_id) in position}
        out = []
        for copy, i in _stretch(list(range(len(items))), tags, partner, self.copies):
            out.append(_changed(items[i], storage_id=self.storage_id[(copy, items[i].storage_id)]))
        return tuple(out)

    def _storage(self, copy: int, sid: int, new_id: int) -> Storage:
        s = self.graph.storages[sid]
        tag = self.tags.storage[sid]
        return _changed(s, storage_id=new_id, name=self._rename_storage(s.name, copy, tag) if tag is not None else s.name,
                        released_after_op=self._op_ref(copy, s, "released_after_op"),
                        held_until_op=self._op_ref(copy, s, "held_until_op"))

    def _rename(self, path: str, copy: int, tag: int | None) -> str:
        """`blocks.j.x` of unit 1 in copy c -> `blocks.{j + c * group}.x`; `blocks.j.x` of unit 2 or later ->
        `blocks.{j + copies * group}.x`."""
        if tag is None or not path.startswith(self.prefix + "."):
            return path
        index = path[len(self.prefix) + 1:].partition(".")[0]
        if not index.isdigit():
            return path
        by = copy * self.group if copy else (self.copies * self.group if int(index) >= _NEXT * self.group else 0)
        return _shift_block(path, self.prefix, by)

    def _rename_storage(self, name: str, copy: int, tag: int) -> str:
        """A name with a number that counts blocks ("checkpoint RNG state, region 2"), the number found
        from the names of block 1's storages and their block-2 twins; else as `_rename`."""
        position = self.counters.get(_NUMBER.sub("#", name))
        if position is None:
            return self._rename(name, copy, tag)
        parts = _NUMBER.split(name)
        number = int(parts[2 * position + 1])
        step = self.group
        parts[2 * position + 1] = str(number + copy * step if copy else number + self.copies * step if tag >= _NEXT
                                      else number)
        return "".join(parts)

    def _name_counters(self) -> dict[str, int]:
        """Name template (digits as #) -> which of its numbers counts blocks: the one that is `group` more
        in the unit-2 twin of a unit-1 storage."""
        out: dict[str, int] = {}
        for x, y in self.align.storage.items():
            if self.tags.storage[x] != _BASE:
                continue
            a, b = _NUMBER.split(self.graph.storages[x].name), _NUMBER.split(self.graph.storages[y].name)
            if len(a) != len(b) or a[0::2] != b[0::2]:
                continue
            steps = [i for i in range(len(a) // 2) if int(b[2 * i + 1]) - int(a[2 * i + 1]) == self.group]
            if len(steps) == 1 and all(a[2 * i + 1] == b[2 * i + 1] for i in range(len(a) // 2) if i != steps[0]):
                out[_NUMBER.sub("#", self.graph.storages[x].name)] = steps[0]
        return out

    def _node_ids(self) -> dict[tuple[int, int], int]:
        """Fresh autograd node ids for the copies of nodes that only block 1 runs."""
        owners: dict[int, set] = {}
        for op, tag in zip(self.graph.ops, self.tags.op):
            if op.autograd_node is not None:
                owners.setdefault(op.autograd_node, set()).add(tag)
        own = sorted(node for node, tags in owners.items() if tags == {_BASE})
        start = max(owners, default=0) + 1
        return {(copy, node): start + (copy - 1) * len(own) + i
                for copy in range(1, self.copies + 1) for i, node in enumerate(own)}

    def _block_parameters(self) -> tuple[int, int]:
        """(parameters, of which frozen) of block 1: one parameter storage per parameter name (--offload
        adds copies named "<parameter> (host copy)", "<parameter> (device copy for forward)" ...)."""
        params = [s for s, tag in zip(self.graph.storages, self.tags.storage)
                  if tag == _BASE and s.role is StorageRole.PARAMETER]
        params = list({s.name.split(" (", 1)[0]: s for s in reversed(params)}.values())   # one per parameter
        def weights(s: Storage) -> int:
            return s.weights if s.weights is not None else math.prod(s.shape)
        return sum(weights(s) for s in params), sum(weights(s) for s in params if s.frozen)


def _changed(element, **changes):
    """`dataclasses.replace(element, **changes)` without its per-call field walk (a deep model's synthesis
    makes ~10^5 elements): every field is carried, none of these frozen classes has a `__post_init__`."""
    new = object.__new__(type(element))
    new.__dict__.update(element.__dict__, **changes)
    return new


def _stretch(items: list[int], tags: list, partner: dict[int, int], copies: int) -> list[tuple[int, int]]:
    """`items` as (copy, item) with `copies` copies of every run of block-1 items: after the run when its
    block-2 partner comes later (forward order), before it, last copy first, when earlier (backward order)."""
    out: list[tuple[int, int]] = []
    runs = {run[0]: run for run in _runs([tags[i] for i in items], _BASE)}
    position = 0
    while position < len(items):
        run = runs.get(position)
        if run is None:
            out.append((0, items[position]))
            position += 1
            continue
        members = [items[p] for p in run]
        later = [partner.get(m) for m in members]
        if any(p is None for p in later):
            raise DepthError(f"an element of block {_BASE} has no block-{_NEXT} counterpart to order its copies by")
        originals = [(0, m) for m in members]
        if all(p > members[-1] for p in later):
            out += originals + [(c, m) for c in range(1, copies + 1) for m in members]
        elif all(p < members[0] for p in later):
            out += [(c, m) for c in range(copies, 0, -1) for m in members] + originals
        else:
            raise DepthError(f"block {_BASE}'s elements {members[0]}..{members[-1]} interleave with block {_NEXT}'s")
        position = run[-1] + 1
    return out
