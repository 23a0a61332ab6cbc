"""Ground truth: one real eager training step on CPU, measured at storage level.

A TorchDispatchMode sees every storage an op returns and puts a `weakref.finalize` on it, so frees are
seen when the last reference (Python variable, autograd saved tensor, .grad) goes away; this matches the
allocator-level profiler to the byte at op boundaries on CPU (shared/notes/GROUND_TRUTH.md section 2),
except kernel-internal scratch. Saved-for-backward bytes come from `saved_tensors_hooks`, deduplicated
by storage, parameters excluded, counted when forward ends while an autograd node (or a checkpoint) still
holds them: a tensor saved by a branch of the graph that the loss never reaches (a recurrent state updated
after the last chunk, then dropped) dies with its branch during forward, and backward never reads it. Source lines: forward ops take the innermost user
frame; backward ops take the forward line stamped on their autograd node by a TorchFunctionMode.
This is test code: it runs the real model with real memory.
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import time
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_OPTIM_DIR = os.path.join(_TORCH_DIR, "optim") + os.sep
_HERE = os.path.abspath(__file__)


def _user_line() -> str | None:
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if path != _HERE and not path.startswith("<") and (not path.startswith(_TORCH_DIR) or path.startswith(_OPTIM_DIR)):
            return f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return None


class _LineStamper(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        line = _user_line()
        stack = [t.grad_fn for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        while stack:                      # every autograd node this call created gets the caller's line
            node = stack.pop()
            if node is None or "line" in node.metadata or type(node).__name__ == "AccumulateGrad":
                continue
            node.metadata["line"] = line
            stack.extend(fn for fn, _ in node.next_functions)
        return out


def _holds_memory(storage) -> bool:
    """False for the storage of a wrapper tensor subclass (a functional collective's AsyncCollectiveTensor,
    a DTensor): it is a placeholder of the wrapper's size whose data pointer is invalid; the memory is the
    inner tensor's, which is counted on its own."""
    try:
        storage.data_ptr()
    except RuntimeError:
        return False
    return True


_COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd")
# long enough for gloo's worker thread to be scheduled on a loaded machine: 0.02 s was not, once, under the
# CI run's two test processes and their ranks on two cores (a tensor released 40,960 B late in backward)
_GLOO_SETTLE_SECONDS = 0.1


def _memory_holders(t: torch.Tensor) -> list[torch.Tensor]:
    """The tensors whose storages hold `t`'s memory: `t` itself, or a wrapper subclass's inner tensors (a
    DTensor's local shard), recursively."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if not is_traceable_wrapper_subclass(t):
        return [t]
    names, _ = t.__tensor_flatten__()
    inner = (getattr(t, name) for name in names)       # a DTensor also names its device mesh
    return [holder for value in inner if isinstance(value, torch.Tensor) for holder in _memory_holders(value)]


class StorageTracker(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live: dict[int, tuple[int, str | None, str]] = {}   # key -> (nbytes, line, phase born)
        self.current = 0
        self.peak = 0
        self.peak_phase = ""
        self.peak_live: dict[int, tuple[int, str | None, str]] = {}
        self.phase = "setup"
        self.phase_peaks: dict[str, int] = {}
        self.op_of: dict[int, tuple] = {}

    def track_existing(self, tensors, label: str) -> None:
        for t in tensors:
            for inner in _memory_holders(t):
                self._register(inner.untyped_storage(), label, "before")

    def _register(self, storage, line, phase) -> None:
        key = storage._cdata
        if key in self.live or not _holds_memory(storage):
            return
        self.live[key] = (storage.nbytes(), line, phase)
        self.current += storage.nbytes()
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        nbytes, _, _ = self.live.pop(key)
        self.current -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.utils._python_dispatch import is_traceable_wrapper_subclass
        if any(is_traceable_wrapper_subclass(t) for t in tree_leaves((args, kwargs or {}))
               if isinstance(t, torch.Tensor)):
            return NotImplemented       # a subclass (a DTensor) runs the op on its inner tensors, seen here next
        out = func(*args, **(kwargs or {}))
        if func.namespace in _COLLECTIVE_NAMESPACES:
            # gloo's worker thread drops its references to a collective's tensors shortly after the work
            # completes; a tensor the step lets go of before then would be freed on that thread, at a time
            # that varies from run to run. Waiting here lets the worker finish first, as it almost always does.
            time.sleep(_GLOO_SETTLE_SECONDS)
        node = torch._C._current_autograd_node()
        line = node.metadata.get("line") if node is not None else _user_line()
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._register(t.untyped_storage(), line, self.phase)
                self.op_of[t.untyped_storage()._cdata] = (str(func), node.name() if node is not None else None)
        self._observe()
        return out

    def _observe(self) -> None:
        self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.current)
        if self.current > self.peak:
            self.peak, self.peak_phase = self.current, self.phase
            self.peak_live = dict(self.live)


@dataclasses.dataclass
class Measurement:
    peak_bytes: int
    peak_phase: str
    phase_peaks: dict[str, int]
    start_bytes: int
    saved_bytes: int
    lines_at_peak: dict[str, int]
    forward_end_bytes: int = 0          # live right after forward + loss (start + everything kept for backward)


class Checkpointed(torch.nn.Module):
    """Wraps a block in torch.utils.checkpoint (non-reentrant), optionally selective: `save_ops` is a set of
    aten OpOverloads whose outputs are kept (MUST_SAVE); everything else is recomputed."""

    def __init__(self, block: torch.nn.Module, save_ops=None):
        super().__init__()
        self.block = block
        self.save_ops = save_ops

    def forward(self, *args):
        from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
        if self.save_ops is None:
            return checkpoint(self.block, *args, use_reentrant=False)

        def policy(ctx, op, *a, **k):
            return CheckpointPolicy.MUST_SAVE if op in self.save_ops else CheckpointPolicy.PREFER_RECOMPUTE

        return checkpoint(self.block, *args, use_reentrant=False,
                          context_fn=lambda: create_selective_checkpoint_contexts(policy))


def measure_step(model: torch.nn.Module, batch: tuple, optimizer, *, precision: str = "fp32",
                 steady: bool = True, set_to_none: bool = True, retain_graph: bool = False,
                 resident: tuple = (), loop_held=None) -> Measurement:
    """Runs (steady: one warm-up step, then) one tracked step: forward+loss, backward, step, zero_grad.
    `retain_graph`: the loop calls loss.backward(retain_graph=True) and drops the loss after the step;
    `resident`: tensors the loop holds on the device for the whole step besides the model; `loop_held()`:
    the tensors the loop still holds from the warm-up step when the tracked one starts (its variables, which
    the tracked forward rebinds)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    autocast = (lambda: torch.autocast("cpu", dtype=dtype)) if dtype is not None else contextlib.nullcontext
    # fp16: torch.amp.GradScaler as a training loop uses it (scale(loss).backward(), step, update)
    scaler = torch.amp.GradScaler("cpu") if precision == "fp16" else None
    params = list(model.parameters())
    if steady:
        with autocast():
            loss = model(*batch)
        _backward(loss, scaler, retain_graph)
        if optimizer is not None:
            _optimizer_step(optimizer, scaler)
            optimizer.zero_grad(set_to_none=set_to_none)
        else:
            model.zero_grad(set_to_none=set_to_none)
        del loss
    param_keys = {part.untyped_storage()._cdata for p in params for part in _memory_holders(p)}
    saved = _SavedStorages(param_keys)
    tracker = StorageTracker()
    tracker.track_existing(params, "parameter")
    tracker.track_existing(list(model.buffers()), "buffer")
    kept = [t for m in model.modules() for k, v in vars(m).items()
            if k not in ("_parameters", "_buffers", "_modules") for t in _held_tensors(v)
            if not isinstance(t, torch.nn.Parameter)]
    tracker.track_existing(kept, "module attribute")      # tensors a previous step left on module attributes
    del kept                                               # (holding them here would keep them alive)
    tracker.track_existing(_batch_tensors(batch), "input")
    tracker.track_existing(list(resident) + (list(loop_held()) if loop_held is not None and steady else []),
                           "caller-held")
    tracker.track_existing([p.grad for p in params if p.grad is not None], "gradient")
    if optimizer is not None:
        from tracer.capture.optimizer import optimizer_held_tensors
        state = [tensor for tensor, _ in optimizer_held_tensors(optimizer)]   # in containers and subclasses too
        tracker.track_existing(state, "optimizer_state")
        del state                                          # an optimizer may replace (and free) its state in step()
    if scaler is not None and steady:
        tracker.track_existing([scaler._scale, scaler._growth_tracker], "optimizer_state")
        scale_before = scaler.get_scale()
    start = tracker.current
    real_get_rng_state = torch.get_rng_state

    def tracked_get_rng_state():       # checkpoint saves the CPU RNG state; it is made outside the dispatcher
        state = real_get_rng_state()
        tracker._register(state.untyped_storage(), _user_line(), tracker.phase)
        return state

    torch.get_rng_state = tracked_get_rng_state
    try:
        with _checkpoint_holds_counted(saved):
            forward_end = _run_tracked_step(tracker, model, batch, optimizer, saved, autocast, set_to_none, scaler,
                                            retain_graph)
    finally:
        torch.get_rng_state = real_get_rng_state
    if scaler is not None and steady:          # the step was taken: no gradient overflowed, the scale held
        assert scaler.get_scale() == scale_before, "the measured fp16 step skipped its optimizer step"
    lines: dict[str, int] = {}
    for nbytes, line, _ in tracker.peak_live.values():
        lines[str(line)] = lines.get(str(line), 0) + nbytes
    return Measurement(peak_bytes=tracker.peak, peak_phase=tracker.peak_phase, phase_peaks=dict(tracker.phase_peaks),
                       start_bytes=start, saved_bytes=saved.bytes_at_forward_end, lines_at_peak=lines,
                       forward_end_bytes=forward_end)


class _SavedStorages:
    """Storages saved for backward, deduplicated, the excluded (parameters) left out. A storage counts when
    forward ends if it is alive and something still holds it for backward: an autograd node's saved tensor
    (the detached alias `pack` returns, alive while its node is), or a checkpoint's hold (`add` without a
    holder). A branch the loss never reaches frees its nodes in forward, and with them what they saved,
    even where the storage itself lives on (a module buffer)."""

    def __init__(self, excluded_keys: set):
        self.excluded_keys = excluded_keys
        self.entries: list[tuple[weakref.ref, weakref.ref | None]] = []     # (storage, its holder)
        self.bytes_at_forward_end = 0

    def add(self, storage, holder: torch.Tensor | None = None) -> None:
        if storage._cdata not in self.excluded_keys:
            self.entries.append((weakref.ref(storage), weakref.ref(holder) if holder is not None else None))

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """saved_tensors_hooks' pack: counts `t`'s storage while the returned alias is held."""
        # a detached alias (same storage): returning `t` itself makes a saved output hold its own grad_fn, a
        # cycle through C++ that keeps a branch the loss never reaches (BERT's pooler) alive to the step's end
        packed = t.detach()
        for holder in _memory_holders(t):       # a wrapper subclass (a DTensor) by its inner tensors' storages
            self.add(holder.untyped_storage(), packed)
        return packed

    def forward_ended(self) -> None:
        live: dict[int, int] = {}
        for storage_ref, holder_ref in self.entries:
            storage = storage_ref()
            if storage is not None and (holder_ref is None or holder_ref() is not None):
                live[storage._cdata] = storage.nbytes()
        self.bytes_at_forward_end = sum(live.values())


@contextlib.contextmanager
def _checkpoint_holds_counted(saved: _SavedStorages):
    """Saved-for-backward also counts what a non-reentrant torch.utils.checkpoint holds for its recompute
    outside saved_tensors_hooks: the tensors its function closes over as a functools.partial (transformers
    passes masks and rotary embeddings so), its keyword arguments, and the CPU RNG state it saves."""
    import functools
    import torch.utils.checkpoint as ckpt
    real = ckpt._checkpoint_without_reentrant_generator

    def count(tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor):
                saved.add(t.untyped_storage())

    @contextlib.contextmanager
    def rng_states_counted():
        """The CPU RNG states checkpoint takes while inside count as saved (made outside the dispatcher)."""
        real_get = torch.get_rng_state

        def get_rng_state():
            state = real_get()
            count([state])
            return state
        torch.get_rng_state = get_rng_state
        try:
            yield
        finally:
            torch.get_rng_state = real_get

    def generator(fn, preserve_rng_state=True, context_fn=ckpt.noop_context_fn, determinism_check="default",
                  debug=False, *args, **kwargs):
        held, inner_fn = [kwargs], fn
        while isinstance(inner_fn, functools.partial):
            held += [inner_fn.args, inner_fn.keywords]
            inner_fn = inner_fn.func
        count(tree_leaves(held))
        with rng_states_counted():
            inner = real(fn, preserve_rng_state, context_fn, determinism_check, debug, *args, **kwargs)
            next(inner)
        yield
        next(inner, None)

    real_forward = ckpt.CheckpointFunction.forward

    def reentrant_forward(ctx, run_function, preserve_rng_state, *args):    # saves the CPU RNG state on ctx
        with rng_states_counted():
            return real_forward(ctx, run_function, preserve_rng_state, *args)

    ckpt._checkpoint_without_reentrant_generator = generator
    ckpt.CheckpointFunction.forward = staticmethod(reentrant_forward)
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = real
        ckpt.CheckpointFunction.forward = staticmethod(real_forward)


def _held_tensors(value) -> list[torch.Tensor]:
    """The tensors a module attribute holds: itself, or the elements of a list, tuple or dict."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, torch.Tensor)]
    if isinstance(value, dict):
        return [v for v in value.values() if isinstance(v, torch.Tensor)]
    return []


def _batch_tensors(batch: tuple) -> list[torch.Tensor]:
    """The batch's tensors, also those a dataclass batch holds in its fields (`Batch(tokens, targets)`) and
    those in lists, tuples and dicts (a detection model's list of images and its targets' boxes)."""
    items = []
    for item in batch:
        items += [getattr(item, f.name) for f in dataclasses.fields(item)] if dataclasses.is_dataclass(item) else [item]
    return [t for t in tree_leaves(items) if isinstance(t, torch.Tensor)]


def _backward(loss, scaler, retain_graph: bool = False) -> None:
    (scaler.scale(loss) if scaler is not None else loss).backward(retain_graph=retain_graph)


def _optimizer_step(optimizer, scaler) -> None:
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)
        scaler.update()


def _run_tracked_step(tracker, model, batch, optimizer, saved: _SavedStorages, autocast, set_to_none, scaler=None,
                      retain_graph=False) -> int:
    """forward+loss, backward, step, zero_grad under the tracker; returns live bytes right after forward.
    `loss` (and with retain_graph the graph it holds) lives until the step has ended."""
    with tracker:
        tracker.phase = "forward"
        with _LineStamper(), torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), autocast():
            loss = model(*batch)
        forward_end = tracker.current
        saved.forward_ended()
        tracker.phase = "backward"
        _backward(loss, scaler, retain_graph)
        tracker.phase = "optimizer"
        if optimizer is not None:
            _optimizer_step(optimizer, scaler)
            optimizer.zero_grad(set_to_none=set_to_none)
        else:
            model.zero_grad(set_to_none=set_to_none)
    return forward_end


def assert_step_exact(predicted, measured, *, scalar_bytes: int = 0) -> None:
    """A prediction (PolicyAnalysis) equals a real step: start bytes, saved bytes and the peak's phase
    exactly; every phase peak within `scalar_bytes` (0: to the byte, as every caller asks today)."""
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert abs(p - m) <= scalar_bytes, f"{phase}: predicted {p:,} measured {m:,}"


def balanced_routers(model: torch.nn.Module) -> torch.nn.Module:
    """Every top-k router of a transformers MoE made to route as tracer's `balanced` assumption
    (`route_as_balanced`)."""
    for module in model.modules():
        if is_topk_router(module):
            route_as_balanced(module, module.num_experts, module.top_k)
    return model


def route_as_balanced(router: torch.nn.Module, experts: int, k: int) -> None:
    """A router whose weight maps hidden states to per-expert logits, made to route as tracer's `balanced`
    assumption: its weight reads the first `experts` features, and a pre-hook feeds it token t's preference
    for experts (t * k + j) % experts, j < k, 1000 above the others, plus a thousandth of the real hidden
    state (so the router still gets a gradient). One AdamW step moves the weight by about 1e-3: the choice
    stays fixed. A hook runs again when checkpointing recomputes the router, so the choice does too."""
    with torch.no_grad():
        router.weight.zero_()
        router.weight[:, :experts] = torch.eye(experts)

    def prefer(mod, args):
        hidden = args[0].reshape(-1, args[0].shape[-1])                          # (T, H)
        slots = torch.arange(hidden.shape[0])[:, None] * k + torch.arange(k)     # (T, k)
        wanted = torch.nn.functional.one_hot(slots % experts, hidden.shape[-1]).sum(1)
        # the router's other arguments (a score-correction bias, ...) pass through unchanged
        return (hidden * 1e-3 + wanted.to(hidden.dtype) * 1e3, *args[1:])

    router.register_forward_pre_hook(prefer)


class BalancedTopk(TorchFunctionMode):
    """Every router call of a real step chooses as tracer's `balanced` routing assumption, whatever the
    model's router looks like: a `topk` or `argmax` over the last dim of a floating-point tensor gives
    token t's j-th choice expert (t * k + j) % experts. The op runs as it is (the same allocations, the
    same saves for backward); its outputs are then overwritten outside the tracked dispatch and outside
    autograd's version counters, the values read from the input at the chosen indices, so the gradient
    flows to the chosen logits. Which token goes to which expert changes no size, only the counts do."""

    worst = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in (torch.topk, torch.Tensor.topk):
            x = args[0]
            k = args[1] if len(args) > 1 else kwargs["k"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            if _routes_over_last_dim(x, dim):
                _choose_balanced(x, out.indices, k, values=out.values, worst=self.worst)
        elif func in (torch.argmax, torch.Tensor.argmax):
            x = args[0]
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if dim is not None and _routes_over_last_dim(x, dim):
                _choose_balanced(x, out, 1, worst=self.worst)
        return out


class WorstTopk(BalancedTopk):
    """Every router call chooses as tracer's `worst` assumption: every token's j-th choice is expert j."""
    worst = True


def _routes_over_last_dim(x, dim) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dim() >= 1 and dim in (-1, x.dim() - 1)


def _choose_balanced(x: torch.Tensor, indices: torch.Tensor, k: int, *, values: torch.Tensor | None = None,
                     worst: bool = False) -> None:
    from torch.utils._python_dispatch import _disable_current_modes
    experts = x.shape[-1]
    with _disable_current_modes(), torch.no_grad():
        tokens = indices.numel() // k
        slots = torch.arange(k).expand(tokens, k) if worst else torch.arange(tokens)[:, None] * k + torch.arange(k)
        chosen = (slots % experts).reshape(indices.shape)
        with torch.autograd._unsafe_preserve_version_counter(indices):
            indices.copy_(chosen)
        if values is not None:
            with torch.autograd._unsafe_preserve_version_counter(values):
                values.copy_(x.gather(-1, chosen))


def is_topk_router(module: torch.nn.Module) -> bool:
    """A transformers mixture-of-experts router (MixtralTopKRouter, Qwen2MoeTopKRouter, ...)."""
    return type(module).__name__.endswith("TopKRouter")


def measure_step_at_allocator(model: torch.nn.Module, batch: tuple, optimizer, *, steady: bool = True,
                              create_graph: bool = False, saved_on_cpu: bool = False) -> dict[str, int]:
    """Peak bytes per phase (forward, backward, optimizer) of one real CPU step (steady: one warm-up step
    first; else the first step, which makes the optimizer's state), read from the CPU allocator's own
    events (torch.profiler, profile_memory=True): what a
    dispatch-level tracker cannot see is counted too (tensors a custom op's kernel makes and frees inside
    its call, compiled code). The bytes held when the step starts are the unique storages of the
    parameters, buffers, batch and every tensor the optimizer holds (tracer's one reader of them).
    `create_graph`: the loop calls loss.backward(create_graph=True) (a second-order optimizer differentiates
    the gradients). The loop drops `loss`, and with it the graph, when the step ends. `saved_on_cpu`: the
    loop runs forward and loss inside torch.autograd.graph.save_on_cpu(pin_memory=True)."""
    from torch.profiler import record_function

    def step(ranged: bool):
        def phase(name):
            return record_function(f"phase:{name}") if ranged else contextlib.nullcontext()
        saving = torch.autograd.graph.save_on_cpu(pin_memory=True) if saved_on_cpu else contextlib.nullcontext()
        with phase("forward"), saving:
            loss = model(*batch)
        with phase("backward"):
            loss.backward(create_graph=create_graph)
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = None          # the loop's `loss` (and what its graph still holds) lives through the step

    if callable(getattr(optimizer, "train", None)) and callable(getattr(optimizer, "eval", None)):
        optimizer.train()            # schedule-free optimizers step in train mode, as the loop sets it
    if steady:
        step(ranged=False)
    return peaks_at_allocator(step, model, batch, optimizer)


def peaks_at_allocator(step, model: torch.nn.Module, batch, optimizer) -> dict[str, int]:
    """Peak bytes per phase of `step(ranged=True)`, whose phases are `record_function("phase:<name>")`
    ranges, from the CPU allocator's events; held when it starts: the unique storages of the model's
    parameters, buffers and held tensors, the batch's tensors (a tuple or a dict) and the optimizer's."""
    from torch.profiler import ProfilerActivity, profile

    from tracer.capture.build import model_held_tensors
    from tracer.capture.optimizer import optimizer_held_tensors

    tensors = list(batch.values()) if isinstance(batch, dict) else _batch_tensors(batch)
    held = [*model.parameters(), *model.buffers(), *tensors,
            *(tensor for tensor, _ in model_held_tensors(model)),
            *(tensor for tensor, _ in optimizer_held_tensors(optimizer))]
    live = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}.values())
    del held
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step(ranged=True)
    events = list(prof.profiler.kineto_results.events())
    ranges = {e.name().removeprefix("phase:"): (e.start_ns(), e.start_ns() + e.duration_ns())
              for e in events if e.name().startswith("phase:")}
    changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    peaks = {}
    for phase, (begin, end) in ranges.items():
        # what is held when the phase begins (a phase that only frees peaks there), then after each event
        now = live + sum(nbytes for at, nbytes in changes if at < begin)
        peaks[phase] = now
        for at, nbytes in changes:
            if begin <= at <= end:
                now += nbytes
                peaks[phase] = max(peaks[phase], now)
    return peaks
