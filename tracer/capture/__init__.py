"""Capture one training step (forward, loss, backward, optimizer step, zero_grad) as a `StepGraph`.

This package is the only code that touches torch.export, fx and fake tensors. `capture_steps` builds the
model under FakeTensorMode (no real memory), takes the joint forward+backward graph, converts it to ops
over storages per recompute policy, then records the optimizer step on fake tensors (once, spliced into
every policy). The capture ladder: the joint traced from the module directly (`aot-joint`, one trace;
models that run torch.utils.checkpoint skip it) -> torch.export non-strict, then strict, then AOT on the
exported module (`export-joint`) -> torch.compile's joint graph (`compile-joint`, dynamo_joint.py) ->
when all fail, the whole step run op by op on fake tensors (`dispatch.py`: eager memory and attribution,
no recompute policies); a direct trace that fails inside a custom autograd Function's backward goes straight
to it (export would replace that backward by its forward's: joint.py `_failing_custom_backward`). The
report's capture path and notes say which rung was used and why. An analysis that reads only the eager
step (`CaptureOptions.op_by_op_first`, which the pipeline sets for the eager policy without a lever or a
sharding, tensor- or pipeline-parallel pass) runs the step op by op first, which costs less than a joint
trace, and keeps that run (capture path `dispatch.VOUCHED_PATH`) unless it used something the two paths are
not held equal on (dispatch.py `graph_rung_features`: a checkpointed region, a value read, a tensor
subclass, a custom op's kernel, an RNN module, a collective, saved-tensor hooks of the model's own, a leaf
made in forward, a forward write into a parameter; or a routing decision) or failed: then the ladder runs.

The modules are stages, each importing only those before it (tests/test_package_imports.py holds the list):
what every stage reads (meta.py: the fx-meta keys and AOT descriptor predicates; source, storages,
precision, target, ...) -> the model input (model_input, loop_declarations, routing) -> building the model
on fake tensors (build, lora) -> tracing the joint graph (joint, dynamo_joint, forward_leaves, inplace,
eager_kernels, python_lifetimes) -> scheduling (schedule, policies, inductor_plan, compiled_blocks,
eager_rerun) -> conversion to ops over storages (convert, splice) -> eager lifetimes (formulas, calls,
eager_checkpoint, autocast_cache, caller_held) -> the step around it (optimizer, recorder, accumulation,
offload, bnb8bit, lion) -> the dispatch front end and this module, which runs them in that order.
"""
from __future__ import annotations

import contextlib
import dataclasses
import gc
import math
import warnings

from tracer.capture.accumulation import KeptPairs, MicroBatch, chain_micro_batches
from tracer.capture.build import restore_module_caches
from tracer.capture.caller_held import observe_kept_outputs
from tracer.capture.convert import OpDraft, convert_step, input_values
from tracer.capture.eager_checkpoint import eager_checkpoint_semantics, recompute_local_holds
from tracer.capture.forward_leaves import leaf_note
from tracer.capture.dispatch import (CAPTURE_PATH as DISPATCH_PATH, VOUCHED_PATH, capture_step_dispatch,
                                     parameter_counts)
from tracer.capture import dynamo_joint as compile_rung   # a module: its function shares its name
from tracer.errors import CaptureError, TracerError, UsageError
from tracer.capture.joint import export_joint
from tracer.capture.model_input import ModelSource, load_model_source
from tracer.capture.target import parse_target
from tracer.capture.source import caller_frames_left_out
from tracer.capture.policies import policy_schedule
from tracer.capture.precision import PRECISIONS, autocast_dtype, make_grad_scaler, uses_grad_scaler
from tracer.capture.autocast_cache import autocast_cache_holds, reuse_cached_casts
from tracer.capture.lightning_loop import autocast_cache_enabled
from tracer.capture.kernel_scratch import unmodelled_scratch_notes
from tracer.capture.device_queries import device_queries_observed, device_query_note
from tracer.capture.calls import call_holds
from tracer.capture.formulas import expression_holds
from tracer.capture.pylocals import local_holds
from tracer.capture.python_lifetimes import observed_holds
from tracer.capture.routing import RoutingError, parse_routing, routing_assumption
from tracer.capture.offload import offload_step
from tracer.capture.optimizer import OPTIMIZERS, record_optimizer_step, splice_optimizer_step
from tracer.capture.context_parallel import load_balanced, no_ring_error, ring_attention
from tracer.capture.process_group import collective_ops, no_collective_error, rank_zero_of
from tracer.capture.quantized_base import QLORA_RANK
from tracer.capture.storages import StorageTable, dtype_name, flat_tensors
from tracer.policies import PolicySpec
from tracer.stepgraph import OpNode, Phase, StepConfig, StepGraph, StorageRole, TensorValue

__all__ = ["CaptureOptions", "capture_step", "capture_steps", "PolicySpec", "load_model_source", "ModelSource", "OPTIMIZERS", "PRECISIONS"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class CaptureOptions:
    batch: int = 2
    seq: int = 1024
    precision: str = "fp32"          # capture/precision.py: fp32 | bf16 | bf16-pure | fp16 (autocast + GradScaler)
    optimizer: str = "adamw"         # used when the model file defines no make_optimizer
    foreach: bool | None = None      # None: torch's default for the target's device (foreach on CUDA, loop on CPU)
    step: str = "steady"             # steady (optimizer state exists) | first (state created lazily)
    zero_grad_set_to_none: bool = True
    capture: str = "auto"            # auto (every graph rung, then dispatch) | export | compile | dispatch
    target: str = "cpu"              # cpu | cuda | cuda:<gpu>: trace for a CUDA run (capture/target.py)
    moe_routing: str = "balanced"    # balanced | worst | a JSON file of per-expert token counts (routing.py)
    accumulate: int = 1              # micro-batches of forward + backward per optimizer step (accumulation.py)
    offload: str | None = None       # None | optimizer | optimizer+params: held in host memory (offload.py)
    lora_rank: int | None = None     # LoRA adapters of this rank on the built model (lora.py); None: off
    lora_targets: tuple[str, ...] = ()
    quantized_base: str | None = None  # 4bit | 8bit: the linears as bitsandbytes' layers (quantized_base.py)
    trainer_args: str | None = None    # TrainingArguments JSON: the Trainer's own optimizer (trainer_optimizer.py)
    fp8: str | None = None             # torchao's float8 recipe on the linears (float8.py)
    ep: int = 1                        # built and stepped as rank 0 of this many ranks (process_group.py)
    cp: int = 1                        # context parallelism: `seq` is one rank's share (context_parallel.py)
    # the eager-only analysis runs the step op by op first, and captures the joint graph only where that
    # run used something the two are not held equal on (`_op_by_op_first`); set by the pipeline for an
    # analysis whose passes read nothing but the eager step
    op_by_op_first: bool = False


def capture_step(source: ModelSource, options: CaptureOptions, spec: PolicySpec | None = None) -> StepGraph:
    spec = spec or PolicySpec(name="eager")
    return capture_steps(source, options, (spec,))[spec.label]


def capture_steps(source: ModelSource, options: CaptureOptions, specs: tuple[PolicySpec, ...],
                  on_policy=None, on_stage=None) -> dict[str, StepGraph]:
    """Capture the joint graph once, then build one StepGraph per policy (keyed by `PolicySpec.label`).
    `on_policy(label)` before each policy's step is built; `on_stage(message)` as each capture path is tried."""
    graphs = capture_step_requests(source, tuple((options, spec) for spec in specs), on_policy, on_stage)
    return {spec.label: graph for spec, graph in zip(specs, graphs)}


# CaptureOptions fields that change only the step around forward and backward (the optimizer step, its
# state, accumulation, offload): requests that differ in these alone share one joint capture
STEP_FIELDS = ("optimizer", "foreach", "step", "zero_grad_set_to_none", "accumulate", "offload")
# the step fields the optimizer step's recording depends on: accumulation's micro-batches and the offload
# lever change what surrounds the recorded step, not the step, so their variants splice the same recording
RECORDING_FIELDS = ("optimizer", "foreach", "step", "zero_grad_set_to_none")


def capture_step_requests(source: ModelSource, requests: tuple[tuple[CaptureOptions, PolicySpec], ...],
                          on_policy=None, on_stage=None) -> tuple[StepGraph, ...]:
    """One StepGraph per (options, policy) request, from one joint capture: the requests' options may differ
    only in `STEP_FIELDS` (an optimizer, accumulation or offload lever on the same forward and backward).
    Raises UsageError when they differ in anything else."""
    options = requests[0][0]
    if any(joint_key(o) != joint_key(options) for o, _ in requests):
        raise UsageError("capture requests that share a joint capture may differ only in "
                         + ", ".join(STEP_FIELDS))
    if options.quantized_base is not None:
        from tracer.capture.quantized_base import quantized_base_source
        source = quantized_base_source(source, options.quantized_base, options.precision)
    if options.fp8 is not None:
        from tracer.capture.float8 import float8_source
        source = float8_source(source, options.fp8)
    rank = options.lora_rank if options.lora_rank is not None or options.quantized_base is None else QLORA_RANK
    if rank is not None:
        from tracer.capture.lora import lora_source
        source = lora_source(source, rank, options.lora_targets)
        if options.lora_rank is None:
            source = dataclasses.replace(source, notes=source.notes + (
                f"--base {options.quantized_base}: the frozen quantized base is trained through LoRA adapters of "
                f"rank {rank} (--lora RANK sets another)",))
    if options.trainer_args is not None and source.make_optimizer is None:
        from tracer.capture.trainer_optimizer import trainer_optimizer_source
        source = trainer_optimizer_source(source, options.trainer_args)
    try:
        with rank_zero_of(max(options.ep, options.cp), flag="--cp" if options.cp > 1 else "--ep"), \
                ring_attention(options.cp, options.seq * options.cp):
            graphs = _requested_steps(source, requests, options, on_policy, on_stage)
    finally:
        restore_module_caches()        # the process's libraries keep no tensor of this capture
    if options.ep > 1 or options.cp > 1:
        note = _rank_note(graphs, options, source.name)
        graphs = tuple(_with_notes(graph, (note,)) for graph in graphs)
    return graphs


def _rank_note(graphs, options: CaptureOptions, model: str) -> str:
    """What --ep or --cp assumed, with the collectives the step ran. Raises UsageError when it ran none (the
    model's experts, or its attention, were not split)."""
    collectives = tuple(dict.fromkeys(name for graph in graphs for name in collective_ops(graph)))
    if options.ep > 1:
        if not collectives:
            raise no_collective_error(options.ep, model)
        return (f"--ep {options.ep}: built and stepped as rank 0 of {options.ep} ranks of a fake process group "
                f"(nothing is sent); every rank is assumed to hold a batch of this shape and to route it as "
                f"--moe-routing says; the step's collectives: {', '.join(collectives)}")
    if not collectives:
        raise no_ring_error(options.cp, model)
    whole = options.seq * options.cp
    balance = ("head-tail load-balanced when attention is causal" if load_balanced(whole, options.cp)
               else f"not load-balanced: {whole} is not a multiple of {2 * options.cp}")
    return (f"--cp {options.cp}: built and stepped as rank 0 of {options.cp} ranks of a fake process group, its "
            f"batch {options.seq} of the {whole} positions (--seq), attention as torch's context_parallel "
            f"rings it ({balance}); the step's collectives: {', '.join(collectives)}")


def _requested_steps(source, requests, options, on_policy, on_stage) -> tuple[StepGraph, ...]:
    with warnings.catch_warnings(), _gc_skips_the_heap_so_far():
        # torch's own pytree deprecation warnings while tracing are noise for the user
        warnings.filterwarnings("ignore", category=FutureWarning)
        # anomaly mode's report of an error the capture ladder handles (reentrant checkpointing under AOT)
        warnings.filterwarnings("ignore", message="Error detected in")
        with routing_assumption(parse_routing(options.moe_routing)) as routing, device_queries_observed() as asked:
            graphs = _capture_steps(source, requests, on_policy, on_stage or (lambda message: None), routing)
        notes = source.notes + routing.notes + device_query_note(asked, parse_target(options.target).is_cuda)
        if routing.grouped_mm_lines and options.target != "cpu":
            notes += ("whether the CUDA grouped matmul takes "
                      + "/".join(dict.fromkeys(routing.grouped_mm_lines.values()))
                      + " inputs was not checked on a GPU (transformers calls it on compute capability 8.0+)",)
        shapes = seq_free_input_shapes(source, options.batch, options.seq)
        breaks = routing.graph_break_note()
        if not notes and shapes is None and breaks is None:
            return graphs
        return tuple(dataclasses.replace(graph, config=dataclasses.replace(
                     graph.config, notes=graph.config.notes + notes + _compiled_only(breaks, spec), input_shapes=shapes))
                     for graph, (_, spec) in zip(graphs, requests))


def _compiled_only(note: str | None, spec) -> tuple[str, ...]:
    """`note` for a policy Inductor plans the whole step of (not the compiled blocks' own: a graph break
    inside a block is in their not-modelled list)."""
    return (note,) if note is not None and spec.policy.compiled else ()


def seq_free_input_shapes(source: ModelSource, batch: int, seq: int) -> str | None:
    """The example batch's first tensor's shape ("2x3x224x224") when `seq` does not change the batch's shapes
    (an image model), else None: example_batch is called again at another length under a fake mode."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._pytree import tree_leaves
    if source.example_batch is None:
        return None
    try:
        with FakeTensorMode(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            shapes = [[tuple(t.shape) for t in tree_leaves(source.example_batch(batch, length))
                       if isinstance(t, torch.Tensor)] for length in (seq, seq + 1)]
    except Exception:          # noqa: BLE001 - a length it refuses is a length it reads
        return None
    if not shapes[0] or shapes[0] != shapes[1]:
        return None
    return "x".join(map(str, shapes[0][0]))       # the first tensor: the images (the labels follow the batch)


def joint_key(options: CaptureOptions) -> CaptureOptions:
    """The options with the step-only fields at their defaults: equal keys share one joint capture
    (--offload activations is traced under save_on_cpu: a capture of its own; whether an eager-only request
    may run op by op first is no part of it)."""
    key = dataclasses.replace(options, op_by_op_first=False, **{f: getattr(CaptureOptions, f) for f in STEP_FIELDS})
    return dataclasses.replace(key, offload="activations") if options.offload == "activations" else key


@contextlib.contextmanager
def _gc_skips_the_heap_so_far():
    """Full garbage collections during a capture walk every object of torch's imported modules (about 12%
    of an 88m capture); the objects that exist now are moved out of their reach for the capture. Frees
    the capture observes are reference-count driven, so they do not depend on when collections run."""
    if gc.get_freeze_count():
        yield                               # the caller froze the heap itself
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _capture_steps(source, requests, on_policy, on_stage, routing=None) -> tuple[StepGraph, ...]:
    options = requests[0][0]
    kept = observe_kept_outputs(source, options) if source.keep is not None else ()
    if _op_by_op_first(source, requests):
        on_stage("running the step op by op on fake tensors ...")
        graphs = _vouched_op_by_op(source, requests, kept, routing)
        if graphs is not None:
            return graphs
    if options.capture == "dispatch":
        on_stage("running the step op by op on fake tensors (no graph) ...")
        return _dispatch_requests(source, requests, reason="--capture dispatch: the step runs op by op, as asked",
                                  kept=kept, chosen=True)
    if options.quantized_base is not None and options.capture == "auto":
        on_stage("running the step op by op on fake tensors (a quantized base) ...")
        return _dispatch_requests(source, requests, reason=QUANTIZED_BASE_REASON, kept=kept, chosen=True)
    if source.create_graph:
        if options.capture != "auto":
            raise UsageError(f"--capture {options.capture}: {source.name} declares create_graph = True, and a "
                             "captured graph's gradients have no graph to differentiate",
                             hint="drop --capture (the step runs op by op)")
        on_stage("running the step op by op on fake tensors (the loop differentiates the gradients) ...")
        return _dispatch_requests(source, requests, reason=CREATE_GRAPH_REASON, kept=kept, chosen=True)
    cap, failures = None, []
    for label, rung in _ladder(options.capture):
        on_stage(f"tracing {label} ..." if not failures else f"that failed; tracing {label} ...")
        try:
            cap = rung(source, options)
            break
        except RoutingError:
            raise                                       # no capture path can size the op better
        except CaptureError as exc:
            failures.append(exc)
            if not exc.next_rung_may_work:
                break                                   # the forward itself cannot run on fake tensors
    if cap is None:
        if options.capture != "auto":      # the export rungs observe the forward: their errors name the line
            raise next((e for e in failures if not e.direct), failures[0])
        on_stage("no graph; running the step op by op on fake tensors ...")
        return _dispatch_requests(source, requests, reason="; ".join(str(e) for e in failures), kept=kept)
    cap.fallback_notes = tuple(f"{e} (the next capture path was used)" for e in failures
                               if not e.quiet)
    kept = kept or _default_loop_kept(source, options, cap.loss_position, cap.model)
    planning: dict = {}
    try:
        _refuse_overwritten_saved_values(cap)
        out, recordings, schedules = [None] * len(requests), {}, {}
        # compiled policies for a CUDA target are planned in forked children, one at a time (a memory budget
        # sweep asks for many), the first started before the other policies are built here
        for i, (request_options, spec) in enumerate(requests):
            if _planned_for_cuda(request_options, spec):
                planning[i] = _compiled_for_cuda(cap, source, request_options, spec,
                                                 parse_target(request_options.target).gpu, kept)
        for planned in list(planning.values())[:1]:
            planned.start()
        for i, (request_options, spec) in enumerate(requests):
            if on_policy is not None:
                on_policy(spec.label)
            if i in planning:
                continue
            if spec not in schedules:
                schedules[spec] = policy_schedule(cap, spec)
            out[i] = _step_for_policy(cap, source, request_options, spec, schedules[spec],
                                      recordings.setdefault(_recording_key(request_options), []), kept)
        # a planning child needs the optimizer step only once its plan is made: it is handed the one
        # recorded here (for the other policies, or now, while it plans) instead of recording it at the end
        # of its chain
        for i, planned in planning.items():
            planned.hand_over(_recording_to_hand_over(cap, source, requests[i][0], recordings))
        for i, planned in planning.items():
            out[i] = planned()
        return tuple(out)
    finally:
        for finish in planning.values():
            finish.abandon()
        cap.exit_stack.close()


def _recording_key(options: CaptureOptions) -> tuple:
    """The policies whose options share this key share one recording of the optimizer step."""
    return tuple(getattr(options, f) for f in RECORDING_FIELDS)


def compiled_planned_apart(options: CaptureOptions, specs) -> bool:
    """Whether `capture_steps` plans the compiled ones of `specs` in forked children while it builds the
    others (a CUDA target's Triton plan, where it can be made here)."""
    from tracer.capture.triton_target import triton_unavailable
    return any(_planned_for_cuda(options, spec) for spec in specs) and triton_unavailable() is None


def _planned_for_cuda(options: CaptureOptions, spec: PolicySpec) -> bool:
    """A compiled policy for a CUDA target: its step comes from `_compiled_for_cuda`."""
    return parse_target(options.target).is_cuda and spec.policy.compiled_any


class _PlannedStep:
    """A compiled policy's StepGraph planned in a forked child (`_compiled_for_cuda`): `start()` forks the
    planner, `__call__` starts it if need be and returns the step, waiting for it; `abandon()` stops a
    planner whose answer is no longer wanted."""

    def __init__(self, start=None, finish=None, graph: StepGraph | None = None, recording=None):
        self._start, self._finish, self._graph = start, finish, graph
        self._forked = None
        self._recording = recording          # a HandOver of the optimizer step's recording (None: none is)

    def hand_over(self, recording) -> None:
        """The optimizer step's recording the planner splices instead of recording it (None: it records)."""
        if self._recording is not None:
            self._recording.send(recording)

    def start(self) -> None:
        if self._forked is None and self._start is not None:
            self._forked = self._start()

    def __call__(self) -> StepGraph:
        if self._graph is None:
            self.start()
            self._graph = self._finish(self._forked)
        return self._graph

    def abandon(self) -> None:
        if self._forked is not None:
            self._forked.abandon()
        if self._recording is not None:
            self._recording.close()


def _compiled_for_cuda(cap, source, options: CaptureOptions, spec: PolicySpec, gpu, kept) -> _PlannedStep:
    """A compiled policy for a CUDA target, planned by Inductor's Triton scheduling for `gpu` in a forked
    child (capture/triton_target.py), started by the result's `start()` and collected by calling it.
    pad_mm's decisions that Inductor times on the GPU are planned both ways: the step is the padded plan,
    and a note gives the unpadded plan's own peaks. The optimizer step's recording is handed to the child
    (`_PlannedStep.hand_over`) once this process has made it for its other policies. Without triton (or a
    compiler) here, the C++ plan with a note saying so."""
    from tracer.capture.inductor_plan import planned_peak_bytes
    from tracer.capture.triton_target import (TRITON_REQUIREMENT, HandOver, TritonPlanError, install_cuda_planning,
                                              retarget_to_cuda, start_forked, triton_unavailable)

    unavailable = triton_unavailable()
    if unavailable is not None:
        graph = _step_for_policy(cap, source, options, spec, policy_schedule(cap, spec), [], kept)
        return _PlannedStep(graph=_with_notes(graph, (
            f"compiled plan: Inductor's C++ scheduling stands in for Triton's, which CUDA runs: {unavailable}; "
            f"Triton fuses, splits reductions and reuses buffers by its own rules (install {TRITON_REQUIREMENT} "
            "for its plan)",)))

    handed = HandOver()

    def plan(pad: bool):
        def work():
            decisions = install_cuda_planning(gpu, pad_decision=pad)
            retarget_to_cuda(cap.joint, cap.fake_mode)
            schedule = policy_schedule(cap, spec, plans_in_parallel=True)
            recording = handed.received()
            graph = _step_for_policy(cap, source, options, spec, schedule,
                                     [] if recording is None else [recording], kept)
            plans = [(schedule.forward_plan, schedule.backward_plan)] + [
                (region.forward_plan, region.backward_plan) for region in schedule.regions]
            peaks = tuple(max((planned_peak_bytes(p[i]) for p in plans if p[i] is not None), default=0)
                          for i in (0, 1))
            return graph, tuple(decisions.timed_pad_mm), peaks
        return start_forked(work)

    def answer(forked):
        try:
            return forked.result()
        except TritonPlanError as exc:
            raise CaptureError(f"Inductor's Triton plan for {gpu.description} failed: {exc}",
                               hint="use --target cpu for the C++ plan, or report the model") from None

    def finish(padded) -> StepGraph:
        graph, timed, (forward_peak, backward_peak) = answer(padded)
        notes = (f"compiled plan: Inductor's Triton scheduling for the {gpu.description} ({gpu.sm_count} SMs, "
                 f"sm{gpu.sm[0]}{gpu.sm[1]}), planned without a GPU; no kernel compiled",)
        if timed:
            _, _, (forward_unpadded, backward_unpadded) = answer(plan(False))
            notes += (f"pad_mm: Inductor times {len(timed)} unaligned matmul(s) on the GPU to decide whether to "
                      f"pad them; planned padded. Unpadded, the compiled graphs' own buffers peak at "
                      f"{forward_unpadded:,} B (forward) and {backward_unpadded:,} B (backward) instead of "
                      f"{forward_peak:,} B and {backward_peak:,} B",)
        return _with_notes(graph, notes)

    return _PlannedStep(start=lambda: plan(True), finish=finish, recording=handed)


def _with_notes(graph: StepGraph, notes: tuple[str, ...]) -> StepGraph:
    return dataclasses.replace(graph, config=dataclasses.replace(graph.config, notes=graph.config.notes + notes))


def _default_loop_kept(source, options, loss_position: int | None, model=None) -> tuple:
    """What the loop keeps of forward's outputs when the model file declares nothing about it
    (caller_held.py): the default loop (`logits, loss = model(X, Y)`) keeps the other outputs of a tuple or
    list; Lightning's keeps a training_step mapping's other tensors (lightning_loop.py)."""
    from tracer.capture.lightning_loop import is_lightning_module, training_step_extras
    if source.keep is not None:
        return ()
    if is_lightning_module(model):
        return observe_kept_outputs(dataclasses.replace(source, keep=training_step_extras), options, declared=False,
                                    loop="Lightning's closure keeps what training_step returned until the step ends")
    if loss_position is None:
        return ()
    from tracer.capture.caller_held import outputs_besides
    return observe_kept_outputs(dataclasses.replace(source, keep=outputs_besides(loss_position)), options,
                                declared=False)


def _refuse_overwritten_saved_values(cap) -> None:
    """ModelRunError, as eager's backward raises it, when an in-place call of the forward writes into a
    tensor that backward reads (capture/inplace.py `overwritten_backward_reads`), naming the call's line."""
    from tracer.capture.inplace import overwritten_backward_reads
    from tracer.capture.source import loc_from_stack_trace
    from tracer.errors import ModelRunError

    for write, reader in overwritten_backward_reads(cap.joint):
        loc = loc_from_stack_trace(write.meta.get("stack_trace"))
        where = f"{loc.file}:{loc.line}: {loc.code.strip()!r}" if loc is not None else f"the op {write.target}"
        saver = next((n for n in cap.joint.graph.nodes if n.meta.get("partitioner_tag") == "is_forward"
                      and n.meta.get("seq_nr") == reader.meta.get("seq_nr")
                      and not getattr(n.target, "is_view", True)), None)
        saved_by = "an earlier op"
        if saver is not None:
            saver_loc = loc_from_stack_trace(saver.meta.get("stack_trace"))
            saved_by = str(saver.target).rsplit(".", 1)[0] + (f" (line {saver_loc.line})" if saver_loc else "")
        raise ModelRunError(f"{where} writes in place into a tensor that {saved_by} saved for backward; eager "
                            "PyTorch refuses the backward: one of the variables needed for gradient computation "
                            "has been modified by an inplace operation",
                            hint="write it out of place (y = y * 2), or clone the tensor before the in-place op")


CREATE_GRAPH_REASON = ("the loop calls loss.backward(create_graph=True) (create_graph = True in the model file): "
                       "the optimizer differentiates the gradients, so the step runs op by op")


QUANTIZED_BASE_REASON = ("--base: bitsandbytes' quantized layers are run op by op (their Parameter subclasses "
                         "cannot be traced into a graph)")


OP_BY_OP_REASON = ("eager only: the step ran op by op on fake tensors; it uses nothing that run and the joint "
                   "graph differ on (--capture export traces the graph)")


def _op_by_op_first(source, requests) -> bool:
    """The eager-only analysis of a plain step: every request the eager policy, with the options' defaults
    but for batch, shape, optimizer and target (each lever, fp16's GradScaler and autocast's casts, a
    first step and kept gradients are captured as a graph: the two paths are not held equal on them)."""
    options = requests[0][0]
    plain = CaptureOptions(batch=options.batch, seq=options.seq, optimizer=options.optimizer, foreach=options.foreach,
                           target=options.target, moe_routing=options.moe_routing, op_by_op_first=True,
                           precision=options.precision if options.precision in ("fp32", "bf16-pure") else "fp32")
    return (options.op_by_op_first and not source.create_graph
            and all(o == plain and spec == PolicySpec(name="eager") for o, spec in requests))


def _vouched_op_by_op(source, requests, kept, routing) -> tuple[StepGraph, ...] | None:
    """The requests' steps run op by op, or None where that run used something the op-by-op run and the
    joint graph are not held equal on (dispatch.py `GraphRungNeeded`) or failed (the graph rungs then report
    the model's error as they do): the caller captures the graph, with the routing assumption's record of
    this run forgotten."""
    try:
        return _dispatch_requests(source, requests, reason=OP_BY_OP_REASON, kept=kept, chosen=True, vouched=True)
    except Exception:           # noqa: BLE001 - GraphRungNeeded, or a failure the graph rungs report as before
        if routing is not None:
            routing.reset()
        return None


def _dispatch_requests(source, requests, *, reason: str, kept, chosen: bool = False,
                       vouched: bool = False) -> tuple[StepGraph, ...]:
    """The dispatch rung once per distinct options of the requests; `chosen`: run op by op for `reason`, not
    because every graph rung failed with it; `vouched`: raise GraphRungNeeded where it cannot stand for the
    graph's eager step."""
    by_options: dict = {}
    for options, spec in requests:
        by_options.setdefault(options, []).append(spec)
    graphs = {}
    for options, specs in by_options.items():
        for spec, graph in zip(specs, _dispatch_steps(source, options, tuple(specs), reason=reason,
                                                      kept=kept, chosen=chosen, vouched=vouched).values()):
            graphs[(options, spec)] = graph
    return tuple(graphs[(options, spec)] for options, spec in requests)


def _ladder(capture: str) -> list:
    """The graph rungs to try in order, as (what it traces, for progress lines; the rung): the module traced
    directly (one trace), non-strict export, strict export, torch.compile's joint graph. `auto` falls back
    to the dispatch run after them."""
    def direct(source, o):
        return export_joint(source, o.batch, o.seq, o.precision, target=o.target, direct=True,
                            offload_activations=o.offload == "activations", steady=o.step == "steady")

    def non_strict(source, o):
        return export_joint(source, o.batch, o.seq, o.precision, target=o.target)

    def strict(source, o):
        return export_joint(source, o.batch, o.seq, o.precision, strict=True, target=o.target)

    def compiled(source, o):
        return compile_rung.dynamo_joint(source, o.batch, o.seq, o.precision, target=o.target)

    direct_, non_strict_, strict_, compiled_ = (
        ("the joint graph from the module", direct), ("the joint graph through torch.export (non-strict)", non_strict),
        ("the joint graph through torch.export (strict)", strict), ("torch.compile's joint graph", compiled))
    rungs = {"auto": [direct_, non_strict_, strict_, compiled_], "export": [direct_, non_strict_, strict_],
             "compile": [compiled_]}
    if capture not in rungs:
        raise UsageError(f"unknown capture path {capture!r}", hint="valid: auto, export, compile, dispatch")
    return rungs[capture]


def _dispatch_steps(source, options, specs, *, reason: str, kept=(), chosen: bool = False,
                    vouched: bool = False) -> dict[str, StepGraph]:
    """The ladder's last rung: no graph, so only the eager policy can be simulated."""
    why = f"; the step runs op by op: {reason}" if chosen else f", and none could be captured: {reason}"
    fix = "" if chosen else "fix what export reports, or "
    if options.offload is not None and options.offload != "activations":    # save_on_cpu runs in it (dispatch.py)
        raise CaptureError(f"--offload rewrites a captured graph's optimizer step{why}", hint=f"{fix}drop --offload")
    if options.accumulate > 1:
        raise CaptureError(f"--accumulate {options.accumulate} repeats a captured graph's forward and backward{why}",
                           hint=f"{fix}drop --accumulate")
    others = [spec.label for spec in specs if spec.name != "eager"]
    if others:
        raise CaptureError(f"policies {', '.join(others)} need a captured graph{why}",
                           hint=f"{fix}ask for --policy eager only")
    with caller_frames_left_out():
        ops, table, (n_params, n_frozen), notes, loss_position, model = capture_step_dispatch(
            source, options, chosen=chosen, vouched=vouched)
    _eager_reduced_loss_storages(ops, table)      # the fake kernel's 0-dim loss; eager's keeps more
    notes += _caller_held(ops, table, source, options, kept or _default_loop_kept(source, options, loss_position, model),
                          model)
    notes += _loop_order(ops, table, model, options.step == "steady")
    config = StepConfig(model=source.name, batch=options.batch, seq=options.seq, precision=options.precision,
                        optimizer=_optimizer_label(source, options, model), step=options.step,
                        zero_grad_set_to_none=options.zero_grad_set_to_none,
                        capture_path=VOUCHED_PATH if vouched else DISPATCH_PATH,
                        policy="eager", target=options.target,
                        notes=(reason if chosen else f"export failed: {reason}",) + notes)
    frozen_ops = tuple(_freeze(i, d, eager_autograd=False) for i, d in enumerate(ops))
    cpu = not parse_target(options.target).is_cuda
    # run op by op, an RNN module runs the C++ kernels eager's CPU step runs; a CUDA target's cuDNN is not them
    fused = () if cpu else tuple(_fused_module_notes(model, cpu=False))
    config = dataclasses.replace(config, notes=config.notes + fused + unmodelled_scratch_notes(frozen_ops, cpu=cpu))
    graph = StepGraph(config=config, ops=frozen_ops, storages=table.freeze(), parameter_count=n_params,
                      frozen_parameter_count=n_frozen)
    return {spec.label: graph for spec in specs}


def _step_for_policy(cap, source: ModelSource, options: CaptureOptions, spec: PolicySpec, schedule,
                     recordings: list, kept=()) -> StepGraph:
    """`recordings`: the optimizer step, recorded by the first policy and spliced into every one with the
    same `RECORDING_FIELDS`; `schedule`: the policy's partition (policy_schedule)."""
    steady = options.step == "steady"
    offload_activations = options.offload == "activations"
    first = _options_micro_batch(cap, options, schedule)
    part, table = first.part, first.table
    if not recordings:
        recordings.append(_record_optimizer(cap, source, options, part.grad_sid_by_param))
    ops, accumulation_notes = part.ops, ()
    if options.accumulate > 1:
        later = _options_micro_batch(cap, options, schedule, later=True)
        ops, accumulation_notes = chain_micro_batches(first, later, options.accumulate,
                                                      _shared_storages(cap, first, later))
    opt_ops = splice_optimizer_step(recordings[0], cap.model, part.grad_sid_by_param, table, ops_offset=len(ops))
    ops, offload_notes = ops + opt_ops, ()
    wrapper = recordings[0].host_offload            # an optimizer wrapper that is the offload lever
    if (options.offload is not None and not offload_activations) or wrapper is not None:
        trainable = [p for p in cap.model.parameters() if id(p) in part.grad_sid_by_param
                     and (options.offload is not None or id(p) in wrapper.host_parameter_ids)]
        ops, offload_notes = offload_step(
            ops, table, mode=options.offload or "optimizer", compiled=schedule.compiled,
            param_sids=tuple(dict.fromkeys(table.lookup(p) for p in trainable)),
            grad_sids=tuple(dict.fromkeys(part.grad_sid_by_param[id(p)] for p in trainable)),
            **({} if options.offload is not None else {
                "wrapper": wrapper.wrapper, "free_device_gradients": wrapper.free_device_gradients,
                "device_state_names": recordings[0].device_state_names}))
    held_notes = _caller_held(ops, table, source, options, kept, cap.model) + _loop_order(ops, table, cap.model, steady)
    ops = tuple(_freeze(i, d, eager_autograd=not schedule.compiled) for i, d in enumerate(ops))
    scratch_notes = unmodelled_scratch_notes(ops, cpu=not parse_target(options.target).is_cuda)
    config = StepConfig(model=source.name, batch=options.batch, seq=options.seq, precision=options.precision,
                        optimizer=_optimizer_label(source, options, cap.model), step=options.step,
                        zero_grad_set_to_none=options.zero_grad_set_to_none,
                        capture_path=cap.path,
                        policy=spec.label, target=options.target, accumulate=options.accumulate, offload=options.offload,
                        notes=_capture_notes(cap, cpu=not parse_target(options.target).is_cuda) + schedule.notes + first.notes
                        + recordings[0].notes + accumulation_notes
                        + offload_notes + held_notes + scratch_notes)
    n_params, n_frozen = parameter_counts(cap.model)
    return StepGraph(config=config, ops=ops, storages=table.freeze(), parameter_count=n_params,
                     loss_storage_id=part.loss_sid, frozen_parameter_count=n_frozen)


def _options_micro_batch(cap, options: CaptureOptions, schedule, *, later: bool = False) -> MicroBatch:
    """One forward + backward under `schedule` with `options`' precision and target: the step's first (or
    only) one, or with `later` one after it in gradient accumulation (steady, its gradients exist)."""
    steady = later or options.step == "steady"
    autocast = autocast_dtype(options.precision)
    return _micro_batch(cap, schedule, StorageTable(), steady=steady,
                        grads_preexisting=later or (steady and not options.zero_grad_set_to_none),
                        autocast_dtype=dtype_name(autocast) if autocast is not None else None,
                        scaled_loss=uses_grad_scaler(options.precision),
                        offload_activations=options.offload == "activations",
                        cuda=parse_target(options.target).is_cuda)


def _record_optimizer(cap, source: ModelSource, options: CaptureOptions, grad_sid_by_param: dict):
    """The optimizer step over the parameters with gradients (`grad_sid_by_param`'s keys), recorded once for
    every policy whose options share `_recording_key`."""
    from tracer.capture.triton_target import host_device_answers
    with host_device_answers():         # in a planning child: the step's own view of the machine
        return record_optimizer_step(
            cap.model, set(grad_sid_by_param), cap.fake_mode, make_optimizer=source.make_optimizer,
            optimizer_name=options.optimizer, foreach=options.foreach, steady=options.step == "steady",
            set_to_none=options.zero_grad_set_to_none, target=options.target,
            grad_scaler=make_grad_scaler(options.precision))


def _recording_to_hand_over(cap, source: ModelSource, options: CaptureOptions, recordings: dict):
    """The optimizer step's recording a planning child is handed: the one made for this process's own
    policies, else one made now, while the child plans (which parameters get gradients does not depend on
    the policy, so the eager micro-batch, the cheapest, names them); None where making it fails (the child
    makes it, and reports the failure as before)."""
    made = recordings.setdefault(_recording_key(options), [])
    if not made:
        try:
            first = _options_micro_batch(cap, options, policy_schedule(cap, PolicySpec(name="eager")))
            made.append(_record_optimizer(cap, source, options, first.part.grad_sid_by_param))
        except TracerError:                 # the model's or the optimizer's: the child meets it and reports it
            return None
    return made[0]


def _micro_batch(cap, schedule, table: StorageTable, *, steady: bool, grads_preexisting: bool,
                 autocast_dtype: str | None, scaled_loss: bool = False, offload_activations: bool = False,
                 cuda: bool = False) -> MicroBatch:
    """One forward + backward over `table`, with eager's lifetimes (Python locals, backward formulas'
    temporaries, checkpointing, autocast's cast cache, tensors kept on module attributes, activation
    offloading). `autocast_dtype`: the dtype name of the autocast around forward and loss, or None;
    `scaled_loss`: the loop calls `scaler.scale(loss).backward()` (GradScaler); `offload_activations`:
    --offload activations (else only the model file's save_on_cpu regions are); `cuda`: a CUDA target."""
    part = convert_step(cap, table, schedule, grads_preexisting=grads_preexisting)
    # eager's own autograd graph: the joint as traced, no block compiled (a compiled block saves its own set)
    joint_as_traced = not schedule.compiled and schedule.forward is None and not schedule.regions
    offloaded, offload_notes = _offloaded_activations(cap, part, table, everything=offload_activations, cuda=cuda,
                                                      joint_as_traced=joint_as_traced)
    leaves = frozenset(sid for sid in (table.lookup(leaf.tensor) for leaf in cap.forward_leaves) if sid is not None)
    requiring_grad = _requiring_grad(part.ops, table, leaves)
    cached_dtype = autocast_dtype if autocast_cache_enabled(cap.model) else None     # the loop's autocast
    notes = reuse_cached_casts(part.ops, table, cached_dtype, requiring_grad) if not schedule.compiled else ()
    last_backward = max((i for i, d in enumerate(part.ops) if d.phase is Phase.BACKWARD), default=None)
    if last_backward is not None and part.seed_sid is not None:
        # torch.autograd.backward holds the seed gradient (ones_like(loss)) until backward returns
        table.update(part.seed_sid, released_after_op=last_backward)
    if scaled_loss and last_backward is not None:
        _loss_as_the_loop_holds_it(part, table, last_backward)
    if not schedule.compiled:          # compiled code keeps no Python locals alive
        forward = [(i, d.frames, _python_visible_outputs(d),
                    tuple(v.storage_id for v in input_values(d)))
                   for i, d in enumerate(part.ops) if d.phase is Phase.FORWARD and d.frames]
        holds, saved_until = _python_holds(cap, part.ops, table, forward, joint_as_traced=joint_as_traced)
        if offloaded is not None:     # autograd holds the host copies, not the storages they were copied from
            saved_until = {sid: i for sid, i in saved_until.items() if sid not in offloaded.offloaded}
            for sid, op_index in offloaded.holds.items():
                table.hold_until(sid, op_index)
        recompute_local_holds(part.ops, table, holds)
        # eager's hold rules, each storage id -> the last op through which something holds it; merged by
        # extending only (a new rule is one entry here)
        for rule_holds in (holds,                                       # the forward's Python locals
                           saved_until,                                 # autograd's own saved references
                           expression_holds(part.ops, cap.python_backward_nodes),  # backward formulas' temporaries
                           call_holds(part.ops),                        # torch calls' arguments, C++ kernels' locals
                           autocast_cache_holds(part.ops, table, cached_dtype, requiring_grad)):  # autocast's cache
            for sid, op_index in rule_holds.items():
                table.hold_until(sid, op_index)
        _eager_saved_for_shape(part.ops, requiring_grad)
        _eager_reduced_loss_storages(part.ops, table)
    if not schedule.compiled and any(d.checkpoint_region is not None for d in part.ops):
        remade = {table.lookup(leaf.tensor): leaf.region for leaf in cap.forward_leaves if leaf.region is not None}
        eager_checkpoint_semantics(part.ops, table, remade, cuda=cuda)
    kept = _keep_attribute_tensors(cap.seen.kept_attributes, part.ops, table, steady=steady)
    return MicroBatch(part=part, table=table, kept=kept, notes=tuple(notes) + offload_notes)


def _offloaded_activations(cap, part, table: StorageTable, *, everything: bool, cuda: bool, joint_as_traced: bool):
    """The step with its saved tensors offloaded where the model file's save_on_cpu or --offload activations
    says (activation_offload.py; `part.ops` is replaced), or None; and the notes: what was offloaded, the
    user's saved-tensor hooks that are not run, a save_on_cpu the step cannot apply."""
    from tracer.capture.activation_offload import offload_note, offload_saved_tensors
    notes = tuple(f"the forward's saved-tensor hooks {name} are not run by the capture: what they pack is "
                  "counted as autograd saves it without hooks (save_on_cpu and checkpointing are modelled)"
                  for name in cap.foreign_saved_hooks)
    if everything and cap.saved_packs is None:
        raise UsageError(f"--offload activations needs the joint graph traced from the module; {cap.path} does "
                         "not see autograd's saves", hint="drop --offload activations, or pass --capture auto")
    packs = cap.saved_packs or ()
    in_file = any(p.offload is not None for p in packs)
    if not (everything or in_file):
        return None, notes
    if not joint_as_traced or any(d.checkpoint_region is not None or d.recomputed for d in part.ops):
        if in_file:
            notes += ("the model file's save_on_cpu is modelled on the eager step without checkpointing only: "
                      "under this policy its saved tensors are counted on the device",)
        return None, notes
    forward_outputs = {d.name: d.outputs for d in part.ops if d.phase is Phase.FORWARD and not d.recomputed}
    placeholders = {n.name: n for n in cap.joint.graph.find_nodes(op="placeholder")}

    def sid_of(producer: tuple[str, int]) -> int | None:
        name, position = producer
        if name in forward_outputs:
            outputs = forward_outputs[name]
            return outputs[position].storage_id if position < len(outputs) else None
        if name in placeholders:
            values = flat_tensors(placeholders[name].meta.get("val"))
            return table.lookup(values[position]) if position < len(values) else None
        return None

    step = offload_saved_tensors(part.ops, table, packs, everything=everything, cuda=cuda, sid_of=sid_of,
                                 joint_order=[node.name for node in cap.joint.graph.nodes])
    part.ops = step.ops
    return step, notes + (offload_note(step, everything=everything, cuda=cuda),)


def _loss_as_the_loop_holds_it(part, table: StorageTable, last_backward: int) -> None:
    """`loss = model(...)` then `scaler.scale(loss).backward()`: the loop's `loss` (the unscaled one) lives
    through the step, the scaled temporary only until backward returns. The graph's loss output is the
    scaled one (the capture scales it, tracer/capture/precision.py): the step's loss becomes its input."""
    producer = next((d for d in part.ops if d.phase is Phase.FORWARD
                     and any(v.storage_id == part.loss_sid for v in d.outputs)), None)
    if producer is None or producer.target not in ("aten.mul.Tensor", "aten.mul.Scalar") or producer.is_view:
        return
    unscaled = input_values(producer)[0].storage_id
    table.update(unscaled, persistent=True, name="loss")
    table.update(part.loss_sid, persistent=False, name="scaler.scale(loss)", released_after_op=last_backward)
    part.loss_sid = unscaled


def _python_holds(cap, ops, table: StorageTable, forward: list, *,
                  joint_as_traced: bool) -> tuple[dict[int, int], dict[int, int]]:
    """storage id -> the op through which the forward's Python code holds it: seen where the trace ran the
    user's Python (python_lifetimes.py), read from the source (pylocals.py) elsewhere and for the storages
    whose release the trace could not see (an object autograd saved). Second, where the step is the joint
    as traced (`joint_as_traced`: eager's own autograd graph), storage id -> the backward op after which
    autograd let go of what it saved (ObservedHolds.saved_until)."""
    op_index_of = {d.name: i for i, d in enumerate(ops) if d.phase is Phase.FORWARD and not d.recomputed}
    if cap.python_deaths is None or not op_index_of:
        return local_holds(forward, cap.executed_lines), {}
    # backward ops keep their joint node names in a partition (recomputed ops are new nodes)
    backward_index_of = {d.name: i for i, d in enumerate(ops) if d.phase is Phase.BACKWARD and not d.recomputed}
    sid_of_output = {(d.name, position): value.storage_id for d in ops if d.phase is Phase.FORWARD and not d.recomputed
                     for position, value in enumerate(d.outputs)
                     if table.get(value.storage_id).role is StorageRole.INTERMEDIATE
                     and not table.get(value.storage_id).preexisting}
    # what a Python backward makes (or writes in place: `grad += part` rebinds the local to the write's result
    # in the traced graph): its locals hold it until they let go of it, at the latest when it returns
    python_backward_outputs = {(d.name, position): value.storage_id for d in ops
                               if d.phase is Phase.BACKWARD and d.seq_nr in cap.python_backward_nodes
                               and not d.recomputed and not d.rerun and (not d.is_view or d.writes_in_place)
                               for position, value in enumerate(d.outputs)}
    observed = observed_holds(cap.python_deaths, sid_of_output, op_index_of,
                              [node.name for node in cap.joint.graph.nodes], backward_index_of,
                              python_backward_outputs)
    holds = dict(observed.until)
    for sid, op_index in observed.backward_until.items():
        holds[sid] = max(op_index, holds.get(sid, -1))
    if observed.unseen:
        for sid, op_index in local_holds(forward, cap.executed_lines).items():
            if sid in observed.unseen:
                holds[sid] = max(op_index, holds.get(sid, -1))
    return holds, observed.saved_until if joint_as_traced else {}


def _shared_storages(cap, first: MicroBatch, later: MicroBatch) -> dict[int, int]:
    """`later`'s storages of the parameters, buffers and gradients -> `first`'s."""
    shared = {}
    for owner in list(cap.param_by_fqn.values()) + list(cap.buffer_by_fqn.values()):
        if owner in later.table and owner in first.table:
            shared[later.table.lookup(owner)] = first.table.lookup(owner)
    for param_id, sid in later.part.grad_sid_by_param.items():
        shared[sid] = first.part.grad_sid_by_param[param_id]
    return shared


def _loop_order(ops, table, model, steady: bool) -> tuple[str, ...]:
    """A loop that zeroes the gradients somewhere else than after the optimizer step (Lightning's, before
    backward: lightning_loop.py), put on the step's storages; returns its notes."""
    from tracer.capture.caller_held import hold_previous_gradients, inputs_at_their_turn
    from tracer.capture.lightning_loop import is_lightning_module
    if not is_lightning_module(model):
        return ()
    inputs_at_their_turn(ops, table)
    return hold_previous_gradients(ops, table, steady=steady)


def _optimizer_label(source: ModelSource, options: CaptureOptions, model) -> str:
    """The optimizer the config names: "custom" when the model file (make_optimizer) or the module
    (Lightning's configure_optimizers) builds it, else the --optimizer option."""
    from tracer.capture.lightning_loop import optimizer_factory
    return "custom" if optimizer_factory(model, source.make_optimizer) is not None else options.optimizer


def _caller_held(ops, table, source: ModelSource, options: CaptureOptions, kept, model) -> tuple[str, ...]:
    """What the model file says its training loop holds, put on the step's storages (caller_held.py).
    Lightning's loop holds nothing of a step into the next one's forward."""
    from tracer.capture.caller_held import hold_caller_tensors
    from tracer.capture.lightning_loop import is_lightning_module
    from tracer.capture.loop_declarations import extra_bytes
    extra = 0 if source.extra_resident_bytes is None else extra_bytes(source.extra_resident_bytes, source.name,
                                                                      options.batch, options.seq)
    return tuple(hold_caller_tensors(ops, table, kept=kept, extra_resident_bytes=extra,
                                     retain_graph=source.retain_graph,
                                     steady=options.step == "steady" and not is_lightning_module(model),
                                     accumulate=options.accumulate))


def _capture_notes(cap, *, cpu: bool) -> tuple[str, ...]:
    seen = cap.seen
    notes = list(cap.fallback_notes) + list(cap.build_notes) + checkpoint_notes(seen.checkpoint_calls)
    notes += _fused_module_notes(cap.model, cpu=cpu)
    for kept in seen.kept_attributes:
        where = f" (made at {kept.source.short()})" if kept.source else ""
        notes.append(f"{kept.module or 'the model'}.{kept.attribute} keeps a {kept.nbytes:,} B tensor past the "
                     f"step{where}")
    notes += [leaf_note(leaf) for leaf in cap.forward_leaves]
    return tuple(notes)


def _fused_module_notes(model, *, cpu: bool) -> list[str]:
    """Modules whose eager kernel the traced step does not run as eager runs it (so what eager saves for
    backward differs): on CUDA, nn.LSTM / nn.GRU / nn.RNN run cuDNN's fused RNN, which saves a workspace of its
    own; on the CPU, nn.RNN's cells (nn.LSTM runs oneDNN's RNN and nn.GRU ATen's in-place cells, both traced
    as eager runs them: eager_kernels.lstm_as_in_eager, gru_as_in_eager). Flagged, never silently off:
    measured on a 2-layer LSTM (hidden 64, batch 4, seq 32, CPU) traced cell by cell, the trace saved
    575,492 B where eager saves 1,198,084 B and the forward peak was 29% low."""
    from torch import nn
    def modeled(m) -> bool:           # an LSTM with projections runs ATen's cells on the CPU too
        return cpu and (isinstance(m, nn.GRU) or (isinstance(m, nn.LSTM) and not m.proj_size))
    rnns = [(name or "(root)", m) for name, m in model.named_modules() if isinstance(m, nn.RNNBase) and not modeled(m)]
    if not rnns:
        return []
    kernel = "ATen's RNN cells" if cpu else "cuDNN's fused RNN kernel"
    return [f"{', '.join(name for name, _ in rnns)}: nn.{type(rnns[0][1]).__name__} runs {kernel} in eager, "
            "which the traced step does not reproduce op for op, so its saved activations and the peaks around "
            "it are not exact (a fused RNN traced cell by cell measured 52% low in saved bytes)"]


# aten ops whose Python-level callers (F.layer_norm, F.dropout, F.scaled_dot_product_attention, F.nll_loss, ...)
# return only their first output: the others (mean and rstd, masks, logsumexp) are never bound to a name
_FIRST_OUTPUT_ONLY = frozenset({
    "native_layer_norm", "native_batch_norm", "_native_batch_norm_legit", "_native_batch_norm_legit_no_training",
    "_native_batch_norm_legit_functional", "native_group_norm", "_fused_rms_norm", "native_dropout",
    "nll_loss_forward", "nll_loss2d_forward", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_fused_attention_overrideable"})


def _python_visible_outputs(d: OpDraft) -> tuple[int, ...]:
    """Storage ids of the op's outputs that a Python name can hold."""
    from tracer.policies import op_packet
    outputs = d.outputs[:1] if op_packet(d.target) in _FIRST_OUTPUT_ONLY else d.outputs
    return tuple(v.storage_id for v in outputs)


def checkpoint_notes(calls) -> list[str]:
    """One line per checkpointed region the forward runs: how it was written (module, partial, method or
    function; reentrant or not; its policy) and the line that calls checkpoint."""
    return [f"checkpointed region {c.index}: {c.describe()}" for c in calls]


def _keep_attribute_tensors(kept, ops: list[OpDraft], table: StorageTable, *, steady: bool) -> KeptPairs:
    """A tensor stored on a module attribute lives until the next step overwrites it: the new one lives to
    the end of the step; in steady state the previous step's lives until the new one is assigned.
    Returns (the previous step's storage or None, the new one) per attribute."""
    pairs = []
    for attr in kept:
        op_index = _producer_of(attr, ops)
        if op_index is None:
            continue
        value = next(v for v in ops[op_index].outputs if _holds_attribute(v, attr))
        table.update(value.storage_id, persistent=True)
        previous = None
        if steady:
            previous = table.add(None, StorageRole.INTERMEDIATE, nbytes=attr.nbytes, dtype=str(attr.dtype).removeprefix("torch."),
                      shape=attr.shape, preexisting=True, released_after_op=op_index,
                      name=f"{attr.module}.{attr.attribute} from the previous step")
        pairs.append((previous, value.storage_id))
    return tuple(pairs)


def _holds_attribute(value, attr) -> bool:
    """An op's output is the kept tensor's storage: its shape, or its element count where the module keeps
    a view of it (`self.pyramid = [corr.reshape(...)]`)."""
    return value.shape == attr.shape or (math.prod(value.shape) == math.prod(attr.shape)
                                         and value.dtype == str(attr.dtype).removeprefix("torch."))


def _producer_of(attr, ops: list[OpDraft]) -> int | None:
    """The last forward op of the attribute's module on its source line that outputs the kept tensor
    (`_holds_attribute`)."""
    if attr.source is None:
        return None
    found = None
    for i, d in enumerate(ops):
        # the op runs inside the attribute's module, or in an enclosing one whose forward calls a method of
        # it directly (`self.corr_block.build_pyramid(...)` does not enter the module's call)
        in_module = _nested(d.module, attr.module) or _nested(attr.module, d.module)
        if (d.phase is Phase.FORWARD and in_module and d.source is not None and d.source.file == attr.source.file
                and d.source.line == attr.source.line and any(_holds_attribute(v, attr) for v in d.outputs)):
            found = i
    return found


def _nested(inner: str, outer: str) -> bool:
    """Module path `inner` is `outer` or inside it ("" is the root)."""
    return not outer or inner == outer or inner.startswith(outer + ".")


def _eager_reduced_loss_storages(ops: list[OpDraft], table: StorageTable) -> None:
    """A reduced loss whose eager kernel keeps the elementwise loss's storage (`eager_kernels.
    REDUCED_KEEPS_ELEMENTWISE`: F.mse_loss, smooth_l1, soft_margin, binary_cross_entropy) holds those bytes,
    not the 4 of its fake 0-dim value."""
    from tracer.capture.eager_kernels import reduced_loss_nbytes

    for d in ops:
        if d.phase is not Phase.FORWARD or len(d.outputs) != 1:
            continue
        nbytes = reduced_loss_nbytes(d.target, d.args, dict(d.kwargs), d.outputs[0].dtype)
        if nbytes is not None and nbytes > table.get(d.outputs[0].storage_id).nbytes:
            table.update(d.outputs[0].storage_id, nbytes=nbytes)


def _requiring_grad(ops: list[OpDraft], table: StorageTable, leaves: frozenset[int]) -> frozenset[int]:
    """Storage ids whose forward values may require grad: the trainable parameters, the leaves the forward
    flags requires_grad (`leaves`), and the outputs of every forward op that reads one of them. An
    over-approximation: a value made under `torch.no_grad()` or by `detach` (a view: its base's storage)
    counts when what it was made from does."""
    grad = {sid for sid in range(len(table))
            if table.get(sid).role is StorageRole.PARAMETER and not table.get(sid).frozen} | set(leaves)
    for d in ops:
        if d.phase is Phase.FORWARD and any(v.storage_id in grad for v in input_values(d)):
            grad.update(v.storage_id for v in d.outputs)
    return frozenset(grad)


def _eager_saved_for_shape(ops: list[OpDraft], requiring_grad: frozenset[int]) -> None:
    """Inputs that eager autograd saves although the traced backward reads only their shape
    (`eager_kernels.SAVED_FOR_SHAPE`): the first op of the forward op's autograd node (same seq_nr) reads
    them too, as a keyword the formulas ignore, so they live (and count as saved) until that node runs.
    Only where an input of the op may require grad (`requiring_grad`: storage ids): otherwise eager makes
    no autograd node for it and saves nothing, and the traced op's seq_nr is that of a neighbouring node
    (Funnel gathers its position embeddings from a sinusoid table the forward builds, right after a
    LayerNorm: the table was kept for the LayerNorm's backward)."""
    from tracer.capture.eager_kernels import SAVED_FOR_SHAPE

    first_backward: dict[int, int] = {}
    for i, d in enumerate(ops):
        if d.phase is Phase.BACKWARD and d.seq_nr is not None and not d.recomputed:
            first_backward.setdefault(d.seq_nr, i)
    for d in ops:
        positions = SAVED_FOR_SHAPE.get(d.target, ())
        if d.phase is not Phase.FORWARD or not positions or d.seq_nr not in first_backward \
                or not any(v.storage_id in requiring_grad for v in input_values(d)):
            continue
        kept = tuple(d.args[p] for p in positions if p < len(d.args) and isinstance(d.args[p], TensorValue))
        j = first_backward[d.seq_nr]
        ops[j] = dataclasses.replace(ops[j], kwargs=ops[j].kwargs + (("eager_saved", kept),))


def _freeze(index: int, d: OpDraft, *, eager_autograd: bool) -> OpNode:
    node = d.seq_nr if eager_autograd and d.phase is Phase.BACKWARD else None
    return OpNode(index=index, name=d.name, target=d.target, phase=d.phase, args=d.args, kwargs=d.kwargs,
                  outputs=d.outputs, source=d.source, module=d.module, is_view=d.is_view,
                  autograd_node=node, recomputed=d.recomputed, micro_batch=d.micro_batch)
