"""Data-dependent sizes under fake tensors: the routing assumption of mixture-of-experts models.

Some aten ops size their output by the values of their input: `nonzero` (and `torch.where(mask)`,
`argwhere`, boolean indexing), `masked_select`, `unique`, `repeat_interleave` with tensor repeats,
`bincount`, and `_local_scalar_dense` (`.item()`, `.tolist()`, `int(t)`). Fake tensors have no values,
so these ops raise. In a mixture-of-experts layer they decide how many tokens each expert sees, which
depends on the trained router and the data: no static tool can know it. It is modelled explicitly:

* a router op (`topk`, `argmax`, `max(dim)` over floating-point logits) gets concrete *shadow* indices
  from the routing assumption (`RoutingAssumption`): balanced (every expert gets tokens * top_k / experts
  token-choices), worst (every token picks the same top_k experts: each of them sees every token) or
  per-expert counts read from a JSON file. Which token goes to which expert does not change any size;
  only the counts do.
* every op whose tensor inputs all have shadows (int / bool index arithmetic, small factories: integer
  ones, and floating-point ones of determined values (`ones`, `full`, `arange`, not `empty` nor random:
  a random weight's or a random input's value is never taken as known), constants lifted into the trace:
  `torch.tensor([-1, 0])`) runs on the shadows too, on real CPU
  tensors, so a shadow follows the routing through `one_hot`, `==`, `sum`, `sort` ..., and a value read of
  a tensor made from constants (transformers' `fast_all(torch.ones(b, s))` deciding SDPA's `is_causal`) is
  answered as eager answers it. A tensor written in place by an op the shadows do not follow loses its
  shadow, and so does every other tensor on its storage (a view's write changes its base).
* a collective over the fake process group of `--ep` ranks (capture/process_group.py) gives what symmetric
  ranks give, every rank sending what rank 0 sends: an all-to-all of shadowed values (the per-expert token
  counts an expert-parallel MoE exchanges) gives rank 0, from each rank, the block that rank addresses to
  rank 0; a gather or broadcast repeats rank 0's values (as the fake group does); any other collective's
  result has no shadow, so a value read of it stops the capture with the op named.
* a data-dependent op whose inputs have shadows gets its size (and its value, for `.item()`) from them.
  Where they have none, capture stops with a `RoutingError` naming the user's line and the op.
* `aten._ctc_loss` has no fake kernel: its log_alpha is sized by the longest target, read from the target
  lengths (a list, or a known tensor: transformers' CTC loss sums a mask of the labels); its backward's
  gradient is shaped as its log_probs.
* each shadow knows where its values came from (`_Origin`): constants only (computed exactly), a random
  op (the example batch's random tokens: tracer's own draw, which a real batch may answer otherwise), or a
  router (the routing assumption). Each note says which.

`routing_assumption(assumption)` is active for a whole capture: it wraps `FakeTensorMode.dispatch` (every
fake mode: export and torch.compile make their own), relaxes the grouped-matmul meta kernel's bf16-only
check (the CPU kernel runs fp32; its output size does not depend on routing), and keeps fake-tensor's
own error log (a traceback per failing meta kernel) away from the user. Its `notes` name each
data-dependent op, its line and the assumed sizes, for the report.

Not handled: routers that choose experts with ops other than topk / argmax / max (sampling, sort over
logits, expert-choice routing); data-dependent ops on values that do not follow from a router or from
constants (they raise `RoutingError`); per-layer counts in a FILE (one list applies to every router).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os

import torch
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from tracer.errors import CaptureError, UsageError

ROUTING_CHOICES = ("balanced", "worst")
_SHADOW_LIMIT = 1 << 24              # elements: larger results get no shadow (never index data in practice)
_FACTORY_LIMIT = 1 << 20
aten = torch.ops.aten


class RoutingError(CaptureError):
    """A data-dependent op whose size the routing assumption cannot give (no capture path can do better)."""

    def __init__(self, message: str, *, hint: str = ""):
        super().__init__(message, hint=hint, next_rung_may_work=False)


@dataclasses.dataclass(frozen=True)
class RoutingAssumption:
    """How a router spreads token-choices over experts: `kind` balanced | worst | file (then `counts`)."""
    kind: str = "balanced"
    counts: tuple[int, ...] = ()
    path: str = ""

    @property
    def label(self) -> str:
        return self.path if self.kind == "file" else self.kind

    def expert_counts(self, tokens: int, experts: int, top_k: int) -> tuple[int, ...]:
        """Token-choices per expert for one router call; each at most `tokens` (a token picks distinct
        experts), summing to tokens * top_k. Raises ValueError when a FILE's counts do not fit the call."""
        total = tokens * top_k
        if self.kind == "balanced":
            base, extra = divmod(total, experts)
            return tuple(base + (e < extra) for e in range(experts))
        if self.kind == "worst":
            return tuple(tokens if e < top_k else 0 for e in range(experts))
        if len(self.counts) != experts or sum(self.counts) != total or max(self.counts) > tokens:
            raise ValueError(f"{self.path} gives {len(self.counts)} counts summing to {sum(self.counts)}, but this "
                             f"router sends {tokens} tokens x top-{top_k} = {total} token-choices to {experts} "
                             f"experts (each expert at most {tokens})")
        return self.counts


def parse_routing(value: str) -> RoutingAssumption:
    """`balanced`, `worst`, or a JSON file of per-expert token counts (a list of integers, or an object
    with a `counts` list). Raises UsageError naming the value."""
    if value in ROUTING_CHOICES:
        return RoutingAssumption(kind=value)
    hint = "--moe-routing takes balanced, worst, or a JSON file holding a list of per-expert token counts"
    if not os.path.isfile(value):
        raise UsageError(f"--moe-routing {value!r}: not balanced, worst or an existing file", hint=hint)
    try:
        with open(value) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--moe-routing {value}: cannot read JSON: {exc}", hint=hint) from exc
    counts = data.get("counts") if isinstance(data, dict) else data
    if not (isinstance(counts, list) and counts and all(isinstance(c, int) and c >= 0 for c in counts)):
        raise UsageError(f"--moe-routing {value}: expected a list of non-negative integers", hint=hint)
    return RoutingAssumption(kind="file", counts=tuple(counts), path=value)


def assign_experts(counts: tuple[int, ...], tokens: int, top_k: int) -> torch.Tensor:
    """(tokens, top_k) int64 expert ids in which expert e appears `counts[e]` times and no token picks an
    expert twice: the token-choices, choice-major, are filled with expert 0's count, then expert 1's ...
    (wrapping from one choice column to the next); a count of at most `tokens` never meets itself."""
    flat = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts, dtype=torch.long))
    return flat.view(top_k, tokens).t().contiguous()


@dataclasses.dataclass
class _Router:
    line: str
    op: str
    tokens: int
    experts: int
    top_k: int
    counts: tuple[int, ...]


class RoutingShadows:
    """The state of one capture: shadow values of fake tensors, routers seen, data-dependent ops answered."""

    def __init__(self, assumption: RoutingAssumption):
        from torch.utils.weak import WeakIdKeyDictionary
        self.assumption = assumption
        self.shadow = WeakIdKeyDictionary()
        self.origin = WeakIdKeyDictionary()     # fake -> _Origin flags of its shadow (absent: constants only)
        self.shadowed_storages: set[int] = set()   # storage keys of shadowed fakes (no weak references:
                                                   # torch.utils.swap_tensors refuses a tensor that has them)
        self.routers: dict[str, _Router] = {}
        self.answered: dict[tuple[str, str], list[str]] = {}   # (op, line) -> what each call decided
        self.answered_origin: dict[tuple[str, str], int] = {}  # (op, line) -> _Origin flags of its inputs
        self.scalar_reads: dict[str, int] = {}                  # line that read a value -> _Origin flags
        self.grouped_mm_lines: dict[str, str] = {}              # line -> dtype
        self.asserted_lines: dict[str, None] = {}               # lines whose `assert` read a value: True

    @property
    def decided_anything(self) -> bool:
        """A router was seen, a data-dependent size answered, or a value read or asserted."""
        return bool(self.routers or self.answered or self.scalar_reads or self.asserted_lines or self.grouped_mm_lines)

    def reset(self) -> None:
        """Forget what a capture decided (before another path captures the same step again)."""
        self.__init__(self.assumption)

    @property
    def notes(self) -> tuple[str, ...]:
        from tracer.capture.pylocals import assertion_note
        notes = []
        routed = any(o & _ROUTED for o in (*self.answered_origin.values(), *self.scalar_reads.values()))
        for router in self.routers.values() if routed else ():   # else: no note
            notes.append(f"routing assumed {self.assumption.label} at the router {router.op} at {router.line}: "
                         f"{router.tokens} tokens x top-{router.top_k} over {router.experts} experts, tokens per "
                         f"expert {_counts_text(router.counts)} (change with --moe-routing balanced|worst|FILE)")
        for (op, line), decided in self.answered.items():
            sizes = ", ".join(dict.fromkeys(decided))
            notes.append(f"{op} at {line} has a data-dependent size: {_origin_text(self.answered_origin[op, line])} "
                         f"({_clip(sizes)})")
        by_origin: dict[int, list[str]] = {}
        for line, origin in self.scalar_reads.items():
            by_origin.setdefault(origin, []).append(line)
        for origin, lines in sorted(by_origin.items()):
            notes.append(f"values read from tensors {_ORIGIN_MADE[origin]} (.item(), `if`, a tensor index) at "
                         + _clip(", ".join(lines)) + f": {_origin_text(origin)}")
        notes += [assertion_note(line) for line in self.asserted_lines]
        for line, dtype in self.grouped_mm_lines.items():
            notes.append(f"grouped matmul (aten._grouped_mm) at {line} in {dtype}: sized as torch's CPU kernel "
                         "runs it (its fake kernel takes only bf16); its sizes do not depend on routing")
        return tuple(notes)

    def graph_break_note(self) -> str | None:
        """For a compiled policy: the ops with a data-dependent output size, where torch.compile breaks the
        graph by default, which the plan of the step as one graph does not model; None when there is none.
        (A value read into Python is not named: code written for torch.compile, transformers' among it, skips
        such reads while Dynamo traces it, and the capture runs the eager branch.)"""
        if not self.answered:
            return None
        places = ", ".join(f"{op} at {line}" for op, line in self.answered)
        return (f"{_clip(places)} has a data-dependent output size: torch.compile breaks the graph there "
                "unless torch._dynamo.config.capture_dynamic_output_shape_ops is set; the step is planned as one "
                "graph, as with it set (the graphs a break makes are not modelled)")

    # ---- dispatch -------------------------------------------------------------------------------------
    def dispatch(self, mode, original, func, types, args, kwargs):
        tensors = _tensor_arguments(args, kwargs)
        if tensors is None:                  # nested deeper than an op's tensor lists: pytree's walk
            tensors = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        if func in _ROUTERS and tensors and tensors[0].is_floating_point() and not self._known(tensors[0]):
            out = original(mode, func, types, args, kwargs)
            self._route(func, args, kwargs, out)
            return out
        if func is aten._grouped_mm.default and tensors[0].dtype != torch.bfloat16:
            return self._grouped_mm(mode, args, kwargs)
        if func in _CTC_LOSS:
            return self._ctc_loss(mode, func, args, kwargs)
        shadowed = bool(tensors) and all(self._known(t) for t in tensors)
        try:
            out = original(mode, func, types, args, kwargs)
        except (_DynamicOutputShape, _DataDependentOutput) as exc:
            passing = self._asserted(func, tensors) if not shadowed and isinstance(exc, _DataDependentOutput) else None
            if passing is not None:
                return passing               # `assert (t == 0).all()`: the step predicted is one that runs
            if not shadowed and isinstance(exc, _DataDependentOutput):
                raise                        # a value read (`if t.sum() > 0`): the capture ladder reports it
            if not shadowed and _in_inductor_pass():
                raise RoutingError(f"{_op_name(func)} has a data-dependent output size that Inductor's passes ask for "
                                   "again while planning a compiled policy, on a graph where no routing assumption "
                                   "follows its input", hint="analyse this model with a policy that is not compiled, "
                                   "or with an implementation without data-dependent sizes (transformers' MoE: "
                                   "--hf-config experts_implementation=grouped_mm)") from exc
            if not shadowed:
                raise RoutingError(f"{_user_line(short=False)}: {_op_name(func)} has a data-dependent output size and its "
                                   "input does not follow from a router (topk / argmax over logits) or constants",
                                   hint="no routing assumption applies; compute the size from a router's indices "
                                        "or make it static") from exc
            return self._answer(mode, func, *tree_flatten((args, kwargs)))
        if shadowed or (not tensors and _is_small_factory(out)):
            self._follow(func, *tree_flatten((args, kwargs)), out)
        elif tensors and self.shadowed_storages:
            self._forget_mutated(func, args)
        return out

    def _asserted(self, func, tensors) -> bool | None:
        """For a bool read by an `assert` statement of the user's code, the value that lets it pass (recorded
        for the report's note); else None."""
        from tracer.capture.pylocals import is_assertion, passing_truth
        from tracer.capture.source import loc_from_python_stack
        if func is not aten._local_scalar_dense.default or tensors[0].dtype != torch.bool:
            return None
        loc = loc_from_python_stack()
        if loc is None or not is_assertion(loc.file, loc.line):
            return None
        self.asserted_lines.setdefault(loc.short(), None)
        return passing_truth(loc.file, loc.line)

    def _known(self, t: torch.Tensor) -> bool:
        """`t` has a shadow, or is itself a small real tensor (a constant the trace lifts: `torch.tensor([-1, 0])`).
        Every shadow's storage is in `shadowed_storages`, so a step with none skips the weak-reference lookup."""
        return (bool(self.shadowed_storages) and t in self.shadow) or _is_constant(t)

    def _value(self, t: torch.Tensor) -> torch.Tensor:
        """The real value of a known tensor; KeyError when it is not known (any more: the op's own nested
        calls may have written into it), so that no fake tensor ever reaches a real kernel."""
        if t in self.shadow:
            return self.shadow[t]
        if _is_constant(t):
            return t.clone()        # a private copy: holding the step's own tensor would keep it alive
        raise KeyError("no known value")

    def _origin_of(self, func, flat) -> int:
        origin = _RANDOM if torch.Tag.nondeterministic_seeded in getattr(func, "tags", ()) else 0
        for a in flat:
            if isinstance(a, torch.Tensor):
                origin |= self.origin.get(a, 0)
        return origin

    def _real(self, func, flat, spec):
        with _no_python_dispatch():      # the copies and the op itself are not the step's
            real_flat = [self._value(a) if isinstance(a, torch.Tensor) else a for a in flat]
            args, kwargs = tree_unflatten(real_flat, spec)
            kwargs = {k: (torch.device("cpu") if k == "device" else v) for k, v in kwargs.items()}
            return func(*args, **kwargs)

    def _follow(self, func, flat, spec, out) -> None:
        """Run `func` on the shadows too; give each tensor output the matching real result."""
        if any(isinstance(a, torch.Tensor) and a.numel() > _SHADOW_LIMIT for a in flat):
            return
        if func is _WITH_EFFECTS or _is_collective(func):
            args, _ = tree_unflatten(flat, spec)
            if func is _WITH_EFFECTS and len(args) > 1 and _is_collective(args[1]):
                # an effectful op in a joint trace: with_effects(token, op, *args) -> (token, *outputs)
                func, args, out = args[1], args[2:], (out[1] if isinstance(out, tuple) and len(out) == 2 else None)
            if _is_collective(func) and func not in _SYMMETRIC_AS_RUN:
                self._follow_collective(func, args, out, flat)
                return
        try:
            real = self._real(func, flat, spec)
        except Exception:                    # an op the shadows cannot run: the outputs simply get none
            return
        origin = self._origin_of(func, flat)
        self._pair(out, real, origin, floats=not (origin & _RANDOM or _makes_uninitialised(func)))

    def _follow_collective(self, func, args, out, flat) -> None:
        """A collective over the fake group of `--ep` ranks (capture/process_group.py), as symmetric ranks
        make it: every rank sends what rank 0 sends, so rank 0 receives from each rank the block it sends to
        itself (all-to-all). Other collectives give their outputs and the tensors they write no value."""
        import torch.distributed as dist
        if func in _ALL_TO_ALL:
            written, source, source_splits = ((args[0], args[1], args[4]) if func is _ALL_TO_ALL[0]
                                              else (out, args[0], args[2]))
            if not isinstance(written, torch.Tensor):
                return
            received = _received_from_symmetric_ranks(self._value(source), source_splits, dist.get_world_size())
            if received is not None and received.shape == written.shape:
                self._set(written, received, self._origin_of(func, flat))
                return
            self.forget(written)
            return
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.forget(t)
        self._forget_mutated(func, args)

    def _pair(self, out, real, origin: int = 0, *, floats: bool = True) -> None:
        """Give each fake output its real result; `floats` False: floating-point outputs get none (random
        or uninitialised values, weights among them, which a value read must not take as known)."""
        outs, _ = tree_flatten(out)
        reals, _ = tree_flatten(real)
        for o, r in zip(outs, reals):
            if isinstance(o, torch.Tensor) and isinstance(r, torch.Tensor) and o.shape == r.shape:
                if floats or not o.is_floating_point():
                    self._set(o, r, origin)
                else:
                    self.forget(o)            # an in-place random op (normal_) on a known tensor

    def _set(self, fake: torch.Tensor, real: torch.Tensor, origin: int) -> None:
        self.shadow[fake] = real
        if origin:
            self.origin[fake] = origin
        else:
            self.origin.pop(fake, None)
        self.shadowed_storages.add(fake.untyped_storage()._cdata)

    def forget(self, t: torch.Tensor) -> None:
        """`t` and every shadowed tensor on its storage have no known values any more."""
        self.shadow.pop(t, None)
        self.origin.pop(t, None)
        key = t.untyped_storage()._cdata
        if key in self.shadowed_storages:
            self.shadowed_storages.discard(key)
            for other in [o for o in self.shadow.keys() if o.untyped_storage()._cdata == key]:
                self.shadow.pop(other, None)
                self.origin.pop(other, None)

    def _answer(self, mode, func, flat, spec):
        """The data-dependent op, sized by the shadows' result."""
        real = self._real(func, flat, spec)
        line = _user_line()
        origin = self._origin_of(func, flat)
        if func is aten._local_scalar_dense.default:
            self.scalar_reads[line] = self.scalar_reads.get(line, 0) | origin
            return real
        device = next((a.device for a in flat if isinstance(a, torch.Tensor)), torch.device("cpu"))
        fakes = tree_map_only(torch.Tensor, lambda r: _fake_like(mode, r, device), real)
        self._pair(fakes, real, origin)
        shapes = [tuple(r.shape) for r in tree_flatten(real)[0] if isinstance(r, torch.Tensor)]
        key = (_op_name(func), line)
        self.answered.setdefault(key, []).append("x".join(map(str, shapes[0])) if len(shapes) == 1 else str(shapes))
        self.answered_origin[key] = self.answered_origin.get(key, 0) | origin
        return fakes

    def _route(self, func, args, kwargs, out) -> None:
        logits = args[0]
        if func is aten.topk.default:
            k = args[1]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            indices = out[1]
        else:
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is None:
                return                              # argmax over everything: not a router
            k, indices = 1, (out if func is aten.argmax.default else out[1])
        dim = dim % logits.dim()
        experts = logits.shape[dim]
        tokens = logits.numel() // experts if experts else 0
        if tokens == 0 or k > experts or logits.numel() > _SHADOW_LIMIT:
            return
        line = _user_line()
        try:
            counts = self.assumption.expert_counts(tokens, experts, k)
        except ValueError as exc:
            raise RoutingError(f"{_user_line(short=False)}: the router {_op_name(func)}: {exc}",
                               hint="give one count per expert, summing to tokens x top_k") from exc
        chosen = assign_experts(counts, tokens, k)                        # (tokens, k)
        moved = list(logits.shape[:dim]) + list(logits.shape[dim + 1:]) + [k]
        real = chosen.view(moved).movedim(-1, dim)
        if k == 1 and indices.dim() == logits.dim() - 1:
            real = real.squeeze(dim)                # argmax / max(dim) without keepdim drop the experts' dim
        if tuple(real.shape) != tuple(indices.shape):
            return
        self._set(indices, real.contiguous() if indices.is_contiguous() else real, _ROUTED)
        self.routers.setdefault(line, _Router(line, _op_name(func), tokens, experts, k, counts))

    def _grouped_mm(self, mode, args, kwargs):
        """aten._grouped_mm on fp32/fp16: the CPU kernel takes them; the meta kernel asks for bf16 (CUDA's
        rule). The output is sized as the meta kernel sizes a bf16 one, in the input's dtype."""
        from torch._meta_registrations import _create_grouped_mm_output_tensor
        mat_a, mat_b = args[0], args[1]
        offs = args[2] if len(args) > 2 else kwargs.get("offs")
        out_dtype = (args[4] if len(args) > 4 else kwargs.get("out_dtype")) or mat_a.dtype
        with _no_python_dispatch():
            meta = [None if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
                    for t in (mat_a, mat_b, offs)]
            out = _create_grouped_mm_output_tensor(*meta, out_dtype)
        line = _user_line()
        if line != "an unknown line":
            self.grouped_mm_lines.setdefault(line, str(mat_a.dtype).removeprefix("torch."))
        return mode.fake_tensor_converter.from_meta_and_device(mode, out, mat_a.device)

    def _ctc_loss(self, mode, func, args, kwargs):
        """aten._ctc_loss (no fake kernel: its log_alpha is sized by the longest target): (neg_log_likelihood
        (batch,), log_alpha (batch, frames, 2 x longest target + 1)), as the CPU and CUDA kernels allocate them;
        the target lengths come from a list or a known tensor (labels the example batch made); its backward,
        a gradient shaped as log_probs."""
        names = [a.name for a in func._schema.arguments]
        bound = dict(zip(names, args)) | kwargs
        log_probs = bound["log_probs"]
        if func in (aten._ctc_loss_backward.default, aten._ctc_loss_backward.Tensor):
            return self._fake_empty(mode, tuple(log_probs.shape), log_probs)
        lengths, origin = bound["target_lengths"], 0
        if isinstance(lengths, torch.Tensor):
            if not self._known(lengths):
                raise RoutingError(f"{_user_line(short=False)}: ctc_loss's target lengths do not follow from the "
                                   "example batch or constants, and they size its log_alpha",
                                   hint="compute target_lengths from the labels (labels_mask.sum(-1))")
            lengths, origin = self._value(lengths).tolist(), self.origin.get(lengths, 0)
        longest = max(lengths, default=0)
        batch = log_probs.shape[1] if log_probs.dim() == 3 else 1
        key = (_op_name(func), _user_line())
        self.answered.setdefault(key, []).append(f"log_alpha {batch}x{log_probs.shape[0]}x{2 * longest + 1}")
        self.answered_origin[key] = self.answered_origin.get(key, 0) | origin
        return (self._fake_empty(mode, (batch,), log_probs),
                self._fake_empty(mode, (batch, log_probs.shape[0], 2 * longest + 1), log_probs))

    @staticmethod
    def _fake_empty(mode, shape: tuple, like: torch.Tensor) -> torch.Tensor:
        with _no_python_dispatch():
            meta = torch.empty(shape, dtype=like.dtype, device="meta")
        return mode.fake_tensor_converter.from_meta_and_device(mode, meta, like.device)

    def _forget_mutated(self, func, args) -> None:
        """An in-place op the shadows did not follow leaves its mutated shadowed inputs stale, and every
        other shadowed tensor on the same storage (a write through a view changes its base). A higher-order
        op (run_and_save_rng_state around a recomputed random op) has no schema and mutates nothing."""
        schema = getattr(func, "_schema", None)
        for i, argument in enumerate(schema.arguments if schema is not None else ()):
            if argument.alias_info is not None and argument.alias_info.is_write and i < len(args):
                for t in tree_flatten(args[i])[0]:
                    if isinstance(t, torch.Tensor):
                        self.forget(t)


def _tensor_arguments(args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
    """The tensors among an op's arguments, in pytree's order (`tree_flatten((args, kwargs))`'s leaves):
    each argument is a tensor, a scalar or a list of them, so one level is walked here, without pytree's
    per-leaf bookkeeping, which every op of a capture and of Inductor's passes pays. None where an argument
    nests deeper or is of another kind (the caller flattens it as pytree does)."""
    tensors = []
    for value in (*args, *kwargs.values()):
        kind = type(value)
        if kind in _LEAF_TYPES:
            continue
        if isinstance(value, torch.Tensor):
            tensors.append(value)
        elif kind is list or kind is tuple:
            for item in value:
                if isinstance(item, torch.Tensor):
                    tensors.append(item)
                elif type(item) not in _LEAF_TYPES:
                    return None
        else:
            return None
    return tensors


# the argument types that never hold a tensor: scalars, symbolic scalars, dtypes, devices, layouts, memory
# formats and sizes
_LEAF_TYPES = frozenset((int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                         torch.memory_format, torch.SymInt, torch.SymFloat, torch.SymBool, torch.Size))
_ROUTERS = (aten.topk.default, aten.argmax.default, aten.max.dim)
_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
_WITH_EFFECTS = getattr(torch.ops.higher_order, "with_effects", None)


def _is_collective(func) -> bool:
    schema = getattr(func, "_schema", None)
    return schema is not None and schema.name.split("::")[0] in _COLLECTIVE_NAMESPACES


def _collective(namespace: str, name: str):
    """The collective op `namespace::name`'s default overload, or None where this torch lacks it."""
    try:
        return getattr(getattr(getattr(torch.ops, namespace), name), "default")
    except (AttributeError, RuntimeError):
        return None


# all-to-all's in-place c10d op (output, input, group, output splits, input splits, ...) and its functional
# form (input, output splits, input splits, group name) -> output
_ALL_TO_ALL = (_collective("c10d", "alltoall_base_"), _collective("_c10d_functional", "all_to_all_single"))
# collectives whose result on the fake group (capture/process_group.py) is already what symmetric ranks
# give: a gather or a broadcast of values every rank holds alike, and waiting
_SYMMETRIC_AS_RUN = frozenset(op for op in (
    _collective("c10d", "allgather_"), _collective("c10d", "_allgather_base_"), _collective("c10d", "broadcast_"),
    _collective("_c10d_functional", "all_gather_into_tensor"), _collective("_c10d_functional", "broadcast"),
    _collective("_c10d_functional", "wait_tensor")) if op is not None)


def _received_from_symmetric_ranks(sent: torch.Tensor, sent_splits, ranks: int) -> torch.Tensor | None:
    """What rank 0 receives in an all-to-all when every rank sends what it sends: from each rank, the
    block the sender addresses to rank 0 (its first block), stacked along dim 0."""
    rows = list(sent_splits) if sent_splits else [sent.shape[0] // ranks] * ranks
    if len(rows) != ranks or sum(rows) != sent.shape[0]:
        return None
    return torch.cat([sent[:rows[0]]] * ranks)


_CTC_LOSS = (aten._ctc_loss.default, aten._ctc_loss.Tensor, aten._ctc_loss_backward.default,
             aten._ctc_loss_backward.Tensor)

# _Origin flags: where a shadow's values came from (none set: constants only, computed exactly)
_RANDOM, _ROUTED = 1, 2
_ORIGIN_MADE = {0: "made from constants", _RANDOM: "drawn at random (the example batch's random values)",
                _ROUTED: "the routing (or constants) decide", _RANDOM | _ROUTED: "the routing and random draws decide"}


def _origin_text(origin: int) -> str:
    if origin & _ROUTED:
        return "taken from the routing assumption" + (" and tracer's own random draw" if origin & _RANDOM else "")
    if origin & _RANDOM:
        return "answered from tracer's own draw of those values (a real batch may answer otherwise)"
    return "computed from those constants, exactly"


def _makes_uninitialised(func) -> bool:
    """`torch.empty` and its kin: the values are whatever the memory held."""
    name = getattr(getattr(func, "_schema", None), "name", "")
    return "empty" in name.split("::")[-1]


def _is_small_factory(out) -> bool:
    return isinstance(out, torch.Tensor) and out.numel() <= _FACTORY_LIMIT


def _is_constant(t: torch.Tensor) -> bool:
    """A small real CPU tensor, as torch.tensor([...]) makes and the fake mode lifts: a plain `torch.Tensor`
    (a parameter over a fake tensor is an `nn.Parameter`, and a fake one a `FakeTensor`)."""
    return type(t) is torch.Tensor and t.device.type == "cpu" and t.numel() <= _FACTORY_LIMIT


def _fake_like(mode, real: torch.Tensor, device: torch.device):
    """A fake tensor shaped as the real result, on the device of the op's inputs (a data-dependent op's
    result is where its input is: the capture's CPU, or CUDA in a compiled plan for a CUDA target)."""
    with _no_python_dispatch():
        meta = torch.empty_strided(real.shape, real.stride(), dtype=real.dtype, device="meta")
    return mode.fake_tensor_converter.from_meta_and_device(mode, meta, device)


def _no_python_dispatch():
    from torch.utils._mode_utils import no_dispatch
    return no_dispatch()


def _op_name(func) -> str:
    return f"aten.{func._schema.name.split('::')[-1]}" + ("" if func._overloadname == "default"
                                                          else f".{func._overloadname}")


def _in_inductor_pass() -> bool:
    """The op is run by Inductor's own code (its post-grad passes refresh fake values of rewritten nodes),
    not by the model's."""
    import sys
    frame = sys._getframe(1)
    while frame is not None:
        if "/torch/_inductor/" in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


def _user_line(short: bool = True) -> str:
    """The innermost user frame: `file.py:line` for notes, the full path for errors."""
    from tracer.capture.source import loc_from_python_stack
    loc = loc_from_python_stack()
    if loc is None or ("/tracer/" in loc.file and "/tracer/models/" not in loc.file):   # a backward: no user line
        return "an unknown line"
    return loc.short() if short else f"{loc.file}:{loc.line}"


def _counts_text(counts: tuple[int, ...]) -> str:
    if len(set(counts)) == 1:
        return f"{counts[0]} each"
    return _clip("[" + ", ".join(map(str, counts)) + "]")


def _clip(text: str, limit: int = 160) -> str:
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _exceptions():
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    return DynamicOutputShapeException, DataDependentOutputException


_DynamicOutputShape, _DataDependentOutput = _exceptions()


_ACTIVE: list[RoutingShadows] = []       # the states of the captures under way (innermost last)


def forget_values(*tensors: torch.Tensor) -> None:
    """The values of `tensors` are no longer known (the build swaps them: `module.to(...)`), nor are those of
    the other tensors on their storages; their shadows, and the weak references they hold, are dropped."""
    for state in _ACTIVE:
        for t in tensors:
            state.forget(t)


def active_routing() -> "RoutingShadows | None":
    """The state of the innermost active routing assumption, if any."""
    return _ACTIVE[-1] if _ACTIVE else None


@contextlib.contextmanager
def routing_assumption(assumption: RoutingAssumption):
    """Active for one capture: yields the `RoutingShadows` whose `notes` say what was assumed."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    state = RoutingShadows(assumption)
    _ACTIVE.append(state)
    original = FakeTensorMode.dispatch

    def dispatch(mode, func, types, args=(), kwargs=None):
        return state.dispatch(mode, original, func, types, args, kwargs or {})

    logger = logging.getLogger("torch._subclasses.fake_tensor")
    level = logger.level
    FakeTensorMode.dispatch = dispatch
    # fake tensors log a traceback for every meta kernel that raises; tracer reports errors itself
    logger.setLevel(logging.CRITICAL)
    try:
        yield state
    finally:
        FakeTensorMode.dispatch = original
        logger.setLevel(level)
        _ACTIVE.remove(state)
