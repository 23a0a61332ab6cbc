"""The one analysis pipeline: a model argument and an `AnalysisOptions` -> `Analysis`, for every command.

`run_analysis(model, options)` loads the model (zoo name, `hf:<type>`, model file or a `ModelSource`),
captures the step once for every policy spec, runs the passes and, for a CUDA target, the device view
of every policy (the caching-allocator model with the cuBLAS workspaces and the GPU's memory).
`tracer.analyze`, the CLI, `tracer check`, the pytest marker, `--fit` and `--by-depth` all call it, so
an option added to `AnalysisOptions` reaches every one of them. A model with more than a few identical
blocks is captured cut to a few of them and its step synthesized at full depth where that is checked
exact (tracer/depth_capture.py), unless `full_capture`.

The default target is CUDA on `DEFAULT_GPU` (tracer/capture/target.py): people plan GPU training with
this tool. `target="cpu"` predicts a CPU step (and is what the exactness tests against real CPU steps use).
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Callable

from tracer.checks.options import MODEL_DEFAULTS

_CAPTURE_FIELDS = ("batch", "seq", "precision", "optimizer", "foreach", "step", "zero_grad_set_to_none", "capture",
                   "moe_routing", "accumulate", "offload", "lora_rank", "lora_targets", "quantized_base",
                   "trainer_args", "fp8", "ep", "cp")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AnalysisOptions:
    """Every setting that changes the answer, in one place (the JSON report's `config` records them). The
    model options' defaults are their table's (tracer/checks/options.py `MODEL_OPTIONS`)."""
    batch: int = MODEL_DEFAULTS["batch"]
    seq: int = MODEL_DEFAULTS["seq"]
    precision: str = MODEL_DEFAULTS["precision"]
    optimizer: str = MODEL_DEFAULTS["optimizer"]
    foreach: bool | None = MODEL_DEFAULTS["foreach"]
    step: str = MODEL_DEFAULTS["step"]
    zero_grad_set_to_none: bool = MODEL_DEFAULTS["zero_grad"] == "none"
    policies: tuple[str, ...] = ("eager",)
    memory_budgets: tuple[float | None, ...] = (None,)   # compiled: one compiled policy per budget
    blocks: str | None = None
    checkpoint_every: int = 1
    save_policy: str | None = None         # selective: a named policy; None: the model file's save_policy(), else
                                           # matmul-attention
    save_ops: tuple[str, ...] = ()
    hf_config: tuple[str, ...] = ()
    model_args: tuple[str, ...] = ()       # "KEY=VALUE" keywords of a model file's build_model (or named factory)
    config_json: str | None = None
    hf_attn: str = MODEL_DEFAULTS["hf_attn"]
    hf_task: str | None = None             # hf: the head (tracer.models.hf.TASKS); None: the architecture's default
    capture: str = MODEL_DEFAULTS["capture"]
    moe_routing: str = MODEL_DEFAULTS["moe_routing"]      # balanced | worst | JSON file (capture/routing.py)
    accumulate: int = MODEL_DEFAULTS["accumulate"]        # micro-batches per optimizer step (capture/accumulation.py)
    offload: str | None = MODEL_DEFAULTS["offload"]       # optimizer | optimizer+params (capture/offload.py)
    target: str = MODEL_DEFAULTS["target"]                # "cuda", "cuda:<gpu>" or "cpu"
    gpu: str | None = MODEL_DEFAULTS["gpu"]               # for a cuda target (None: DEFAULT_GPU)
    alloc_conf: str = ""                   # PYTORCH_CUDA_ALLOC_CONF of the run
    cublas_workspace_config: str | None = None
    cudnn_workspace_cap_bytes: int | None = None   # CUDNN_CONV_WSCAP_DBG of the run: counted per conv call
    device_memory_bytes: int | None = None # the device's memory (default: the total the GPU reports)
    cuda_context_bytes: int | None = None  # the CUDA context, taken from it (default: choices.CUDA_CONTEXT_BYTES)
    nccl_memory_bytes: int | None = None   # one NCCL communicator's buffers (default: choices.NCCL_COMMUNICATOR_BYTES)
    shard: str | None = None               # passes.sharding.STRATEGIES: per-rank memory on `world_size` ranks
    world_size: int | None = None
    reshard_after_forward: bool = True     # fsdp: free gathered blocks after their forward
    fsdp_mixed_precision: bool = False     # fsdp: MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
    lora_rank: int | None = MODEL_DEFAULTS["lora_rank"]   # LoRA rank (capture/lora.py); None: off
    lora_targets: tuple[str, ...] = MODEL_DEFAULTS["lora_targets"]  # (): capture/lora.py's default targets
    quantized_base: str | None = MODEL_DEFAULTS["quantized_base"]  # 4bit | 8bit (capture/quantized_base.py)
    trainer_args: str | None = None  # a TrainingArguments JSON: the Trainer's optimizer (capture/trainer_optimizer.py)
    fp8: str | None = MODEL_DEFAULTS["fp8"]     # torchao's float8 recipe on the linears (capture/float8.py)
    tp: int = MODEL_DEFAULTS["tp"]                        # Megatron tensor-parallel ranks (passes/tensor_parallel.py)
    ep: int = MODEL_DEFAULTS["ep"]                        # expert parallelism: rank 0 of N (capture/process_group.py)
    cp: int = MODEL_DEFAULTS["cp"]                        # context parallelism: rank 0 of N (capture/context_parallel.py)
    sp: bool = MODEL_DEFAULTS["sp"]                       # with tp: Megatron sequence parallelism
    pp: int = MODEL_DEFAULTS["pp"]                        # pipeline stages (passes/pipeline_parallel.py)
    microbatches: int | None = MODEL_DEFAULTS["microbatches"]    # with pp: micro-batches per step (None: pp)
    pp_schedule: str = MODEL_DEFAULTS["pp_schedule"]      # with pp: 1f1b | gpipe | interleaved-1f1b
    pp_return_outputs: bool = MODEL_DEFAULTS["pp_return_outputs"]   # with pp: step(return_outputs=...)
    pp_local_stages: int | None = MODEL_DEFAULTS["pp_local_stages"]   # interleaved-1f1b: stages per rank (None: 2)
    gradient_checkpointing: str | None = MODEL_DEFAULTS["gradient_checkpointing"]  # the model's own method
    full_capture: bool = MODEL_DEFAULTS["full_capture"]   # every block captured, no synthesized depth

    def __post_init__(self):
        self.validate()

    def validate(self) -> None:
        """Every field against its valid values (the model options against tracer.checks.options.MODEL_OPTIONS,
        the rest below): one validation for the CLI, `tracer check`, the marker and `tracer.analyze`. Raises
        UsageError naming the field and its valid values."""
        from tracer.checks.options import MODEL_OPTIONS, check_option_value
        from tracer.errors import UsageError

        for option in MODEL_OPTIONS:
            if option.name == "zero_grad":
                continue                   # the field is zero_grad_set_to_none, checked below
            if option.name == "target":
                continue                   # "cuda:<gpu>" is valid too: target_label() checks it below
            check_option_value(option, getattr(self, option.name))
        for name in ("zero_grad_set_to_none", "reshard_after_forward", "fsdp_mixed_precision", "sp"):
            if not isinstance(getattr(self, name), bool):
                raise UsageError(f"{name}={getattr(self, name)!r} is not valid", hint=f"{name} must be True or False")
        if not isinstance(self.policies, tuple) or not self.policies:
            raise UsageError(f"policies={self.policies!r} is not valid", hint="give at least one policy name")
        for budget in self.memory_budgets:
            if budget is not None and not (isinstance(budget, (int, float)) and not isinstance(budget, bool)
                                           and 0.0 <= budget <= 1.0):
                raise UsageError(f"memory_budget={budget!r} is not valid",
                                 hint="a fraction of activation bytes between 0 and 1, or None")
        if not _positive_int(self.checkpoint_every):
            raise UsageError("--checkpoint-every must be a positive integer")
        if self.device_memory_bytes is not None and not _positive_int(self.device_memory_bytes):
            raise UsageError(f"device_memory_bytes={self.device_memory_bytes!r} is not valid",
                             hint="a positive number of bytes, e.g. --device-memory 80GiB")
        if self.cuda_context_bytes is not None and not (isinstance(self.cuda_context_bytes, int)
                                                        and not isinstance(self.cuda_context_bytes, bool)
                                                        and self.cuda_context_bytes >= 0):
            raise UsageError(f"cuda_context_bytes={self.cuda_context_bytes!r} is not valid",
                             hint="a number of bytes (0 or more), e.g. --cuda-context 600MiB")
        if self.nccl_memory_bytes is not None and not (isinstance(self.nccl_memory_bytes, int)
                                                       and not isinstance(self.nccl_memory_bytes, bool)
                                                       and self.nccl_memory_bytes >= 0):
            raise UsageError(f"nccl_memory_bytes={self.nccl_memory_bytes!r} is not valid",
                             hint="a number of bytes (0 or more), e.g. --nccl-memory 1GiB")
        if self.cudnn_workspace_cap_bytes is not None and not _positive_int(self.cudnn_workspace_cap_bytes):
            raise UsageError(f"cudnn_workspace_cap_bytes={self.cudnn_workspace_cap_bytes!r} is not valid",
                             hint="a positive number of bytes, e.g. --cudnn-workspace-cap 256MiB")
        if self.world_size is not None and not _positive_int(self.world_size):
            raise UsageError(f"--world-size {self.world_size!r} is not valid", hint="a positive integer")
        _check_save_ops(self.save_ops)
        from tracer.capture.accumulation import MAX_STEP_OPS
        if self.accumulate > MAX_STEP_OPS // 2:      # a micro-batch is at least one forward and one backward op
            raise UsageError(f"--accumulate {self.accumulate:,} is more micro-batches than one simulated step holds "
                             f"({MAX_STEP_OPS:,} ops)", hint="pass the accumulation steps of a real run")
        if not all(isinstance(arg, str) for arg in self.model_args):
            raise UsageError(f"model_args={self.model_args!r} is not valid", hint='strings "KEY=VALUE"')
        from tracer.capture.offload import check_offload
        check_offload(self.offload, accumulate=self.accumulate, zero_grad_set_to_none=self.zero_grad_set_to_none,
                      shard=self.shard, policies=self.policies)
        self.tensor_parallel_setup()
        self.pipeline_setup(check_batch=False)        # --fit varies the batch in multiples of the micro-batches
        if self.lora_targets and self.lora_rank is None:
            raise UsageError("--lora-targets needs --lora RANK", hint="e.g. --lora 8 --lora-targets q_proj,v_proj")
        self.policy_specs()
        self.target_label()
        self.sharding_setup()
        self.check_rank_parallel()

    def check_rank_parallel(self) -> None:
        """--ep (the model's own expert parallelism) and --cp (torch's ring attention) capture rank 0 of N
        as it runs: the other parallelisms' passes take a single-rank step, which it is not. Raises
        UsageError for a combination."""
        from tracer.errors import UsageError
        for flag, ranks in (("--ep", self.ep), ("--cp", self.cp)):
            if ranks == 1:
                continue
            combined = [other for other, given in (("--shard", self.shard is not None), ("--tp", self.tp > 1),
                                                   ("--pp", self.pp > 1), ("--ep", self.ep > 1),
                                                   ("--cp", self.cp > 1)) if given and other != flag]
            if combined:
                raise UsageError(f"{flag} with {', '.join(combined)} is not modelled",
                                 hint=f"{flag} captures the rank its collectives make; drop " + ", ".join(combined))
            compiled = [p for p in self.policies if p.startswith("compiled")]
            if compiled:
                raise UsageError(f"{flag} with --policy {compiled[0]} is not planned: Inductor's lowering fails on "
                                 f"the collectives of a fake process group",
                                 hint=f"{flag} takes --policy eager, selective or full")
        if self.cp > 1:
            from tracer.capture.context_parallel import local_seq
            local_seq(self.seq, self.cp)

    @property
    def capture_seq(self) -> int:
        """The positions one rank's batch holds: --seq, or its 1/N share under --cp N."""
        return self.seq // self.cp

    def policy_specs(self, model_save_policy=None) -> tuple:
        """The PolicySpecs to simulate; `model_save_policy`, the model file's `save_policy` function, is the
        selective policy unless save_policy or save_ops names one. Raises UsageError for an unknown policy or
        save policy."""
        from tracer.errors import UsageError
        from tracer.policies import POLICIES, PolicySpec, save_predicate

        unknown = [p for p in self.policies if p not in POLICIES]
        if unknown:
            raise UsageError(f"unknown policy {unknown[0]!r}", hint=f"valid: {', '.join(POLICIES)}")
        if self.checkpoint_every < 1:
            raise UsageError("--checkpoint-every must be a positive integer")
        save_fn = model_save_policy if self.save_policy is None and not self.save_ops else None
        specs = tuple(PolicySpec(name=name, memory_budget=budget, blocks=self.blocks,
                                 checkpoint_every=self.checkpoint_every, save=self.save_policy or "matmul-attention",
                                 save_ops=tuple(self.save_ops), save_fn=save_fn if name == "selective" else None,
                                 model_save_fn_unused=model_save_policy is not None and save_fn is None)
                      for name in self.policies
                      for budget in (self.memory_budgets if name == "compiled" else (None,)))
        for spec in specs:
            save_predicate(spec)
        return specs

    def target_label(self) -> str:
        """"cpu" or "cuda:<gpu>". Raises UsageError (unknown target or GPU, a GPU with a cpu target)."""
        from tracer.capture.target import parse_target
        return parse_target(self.target, self.gpu).label

    def sharding_setup(self):
        """The per-rank view's setup, or None. Raises UsageError for a world size without --shard or a
        --shard without a positive world size."""
        from tracer.errors import UsageError
        from tracer.passes.analysis import ShardingSetup
        from tracer.passes.sharding import STRATEGIES

        if self.shard is not None and self.accumulate > 1:
            raise UsageError("--accumulate with --shard is not modelled (DDP's no_sync and FSDP's gradient "
                             "synchronisation between micro-batches)", hint="drop one of them")
        if not self.reshard_after_forward and self.shard not in ("zero3", "fsdp"):
            raise UsageError("--no-reshard-after-forward is FSDP's reshard_after_forward=False: it needs "
                             "--shard fsdp (or zero3)", hint="add --shard fsdp --world-size N, or drop the flag")
        if self.shard is None:
            if self.fsdp_mixed_precision:
                raise UsageError("--fsdp-mixed-precision needs --shard fsdp --world-size N")
            if self.world_size is not None:
                raise UsageError("--world-size needs --shard", hint=f"--shard {'|'.join(STRATEGIES)}")
            return None
        if self.shard not in STRATEGIES:
            raise UsageError(f"unknown sharding strategy {self.shard!r}", hint=f"valid: {', '.join(STRATEGIES)}")
        if not isinstance(self.world_size, int) or self.world_size < 1:
            raise UsageError("--shard needs --world-size N (a positive integer)")
        if self.fsdp_mixed_precision and (self.shard != "fsdp" or self.precision not in ("fp32", "bf16-pure")):
            raise UsageError("--fsdp-mixed-precision is FSDP2's MixedPrecisionPolicy: it needs --shard fsdp and "
                             "fp32 weights (the default --precision)", hint="drop --precision, or drop the flag")
        return ShardingSetup(self.shard, self.world_size, self.reshard_after_forward,
                             fp32_master=self.fsdp_mixed_precision)

    def tensor_parallel_setup(self):
        """The per-rank tensor-parallel view's setup, or None (tp=1). Raises UsageError for --sp without --tp."""
        from tracer.errors import UsageError
        from tracer.passes.tensor_parallel import TensorParallelSetup

        if self.tp == 1:
            if self.sp:
                raise UsageError("--sp needs --tp N with N > 1", hint="sequence parallelism splits what tensor "
                                 "parallelism replicates: e.g. --tp 4 --sp")
            return None
        return TensorParallelSetup(tp=self.tp, sp=self.sp)

    def settings(self) -> dict:
        """The settings that change the answer, for the JSON report's config (plain values)."""
        return {"target": self.target_label(), "foreach": self.foreach, "capture": self.capture,
                "policies": list(self.policies), "memory_budgets": list(self.memory_budgets),
                "blocks": self.blocks, "checkpoint_every": self.checkpoint_every, "save_policy": self.save_policy,
                "save_ops": list(self.save_ops), "hf_config": list(self.hf_config), "config_json": self.config_json,
                "model_args": list(self.model_args),
                "hf_attn": self.hf_attn, "hf_task": self.hf_task, "alloc_conf": self.alloc_conf,
                "cublas_workspace_config": self.cublas_workspace_config,
                "cudnn_workspace_cap_bytes": self.cudnn_workspace_cap_bytes,
                "cuda_context_bytes": self.cuda_context_bytes, "nccl_memory_bytes": self.nccl_memory_bytes,
                "device_memory_bytes": self.device_memory_bytes, "shard": self.shard, "world_size": self.world_size,
                "reshard_after_forward": self.reshard_after_forward,
                "fsdp_mixed_precision": self.fsdp_mixed_precision, "accumulate": self.accumulate,
                "offload": self.offload, "lora_rank": self.lora_rank, "lora_targets": list(self.lora_targets),
                "quantized_base": self.quantized_base, "fp8": self.fp8, "trainer_args": self.trainer_args, "tp": self.tp, "sp": self.sp, "ep": self.ep, "pp": self.pp, "microbatches": self.microbatches,
                "pp_schedule": self.pp_schedule, "pp_return_outputs": self.pp_return_outputs,
                "pp_local_stages": self.pp_local_stages,
                "gradient_checkpointing": self.gradient_checkpointing}

    def plain(self) -> dict:
        """Every field as a JSON value (tuples as lists): what a baseline records, so that `tracer check`
        replays the step as it was made, whatever the model file defines (its own optimizer, loss, ...)."""
        return {field.name: list(value) if isinstance(value, tuple) else value
                for field in dataclasses.fields(self) for value in (getattr(self, field.name),)}

    def planner_keywords(self) -> dict:
        """Every field but the sizes and the policies, as keywords of the planner's analyses (`fit_budget`,
        `analyze_by_depth`), which choose those themselves."""
        return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)
                if field.name not in ("batch", "seq", "policies", "memory_budgets")}

    def capture_options(self):
        """FSDP2 mixed precision computes with bf16 parameters: the step is captured as bf16-pure, and the
        sharding pass gives the sharded state its fp32 bytes."""
        from tracer.capture import CaptureOptions
        fields = {name: getattr(self, name) for name in _CAPTURE_FIELDS}
        if self.fsdp_mixed_precision:
            fields["precision"] = "bf16-pure"
        fields["seq"] = self.capture_seq
        pipeline = self.pipeline_setup()
        if pipeline is not None:           # the stages' step: the micro-batches' forwards and backwards
            fields.update(batch=self.batch // pipeline.microbatches, accumulate=pipeline.microbatches)
        # only the eager step is read: it may run op by op (the capture's `_op_by_op_first` decides). The
        # policies are read here too: an analysis of several captures them in subsets (a compiled policy
        # planned apart), and a subset of the eager policy alone must not run op by op beside the others' graph
        eager_step_only = self.policies == ("eager",) and self.shard is None and self.tp == 1 and self.pp == 1
        return CaptureOptions(**fields, target=self.target_label(), op_by_op_first=eager_step_only)

    def device_setup(self):
        """The device view's setup for a CUDA target, else None."""
        from tracer.capture.target import device_allocations, parse_target
        from tracer.passes.allocator import parse_alloc_conf
        from tracer.passes.device import DeviceSetup

        target = parse_target(self.target, self.gpu)
        if not target.is_cuda:
            return None
        workspaces = tuple((a.name, a.nbytes) for a in device_allocations(target, cublas_config=self.cublas_workspace_config)
                           for _ in range(a.count))
        from tracer.choices import CUDA_CONTEXT_BYTES, NCCL_COMMUNICATOR_BYTES
        total = self.device_memory_bytes if self.device_memory_bytes is not None else target.gpu.memory_bytes
        context = self.cuda_context_bytes if self.cuda_context_bytes is not None else CUDA_CONTEXT_BYTES
        system = target.gpu.system_bytes if self.device_memory_bytes is None else 0   # unified: the OS's share
        communicators = self.nccl_communicators()
        per_communicator = (self.nccl_memory_bytes if self.nccl_memory_bytes is not None
                            else target.gpu.nccl_communicator_bytes or NCCL_COMMUNICATOR_BYTES)
        nccl = communicators * per_communicator
        return DeviceSetup(device_label=target.label, matmul_extra=workspaces, config=parse_alloc_conf(self.alloc_conf),
                           capacity_bytes=max(total - context - system - nccl, 0), context_bytes=context,
                           conv_workspace_cap_bytes=self.cudnn_workspace_cap_bytes, system_bytes=system,
                           nccl_bytes=nccl, nccl_communicators=communicators)

    def nccl_communicators(self) -> int:
        """The NCCL communicators a rank of this step holds: one for the sharded data-parallel group
        (--shard over more than one rank), one for the tensor-parallel group (--tp > 1), one for the
        pipeline's sends and receives (--pp > 1), one for the expert-parallel group (--ep > 1), one for the
        context-parallel group (--cp > 1)."""
        return (int(self.shard is not None and (self.world_size or 1) > 1) + int(self.tp > 1) + int(self.pp > 1)
                + int(self.ep > 1) + int(self.cp > 1))

    def pipeline_setup(self, *, check_batch: bool = True):
        """The pipeline-parallel view's setup, or None (pp=1). Raises UsageError for what it cannot take
        (`check_batch`: a batch the micro-batches do not split)."""
        from tracer.errors import UsageError
        from tracer.passes.pipeline_parallel import PipelineSetup
        if self.pp == 1:
            if self.microbatches is not None or self.pp_schedule != MODEL_DEFAULTS["pp_schedule"] \
                    or self.pp_return_outputs != MODEL_DEFAULTS["pp_return_outputs"] \
                    or self.pp_local_stages is not None:
                raise UsageError("--microbatches, --pp-schedule, --pp-local-stages and --no-pp-return-outputs need "
                                 "--pp N with N > 1", hint="e.g. --pp 4 --microbatches 8 --pp-schedule 1f1b")
            return None
        interleaved = self.pp_schedule == "interleaved-1f1b"
        if self.pp_local_stages is not None and not interleaved:
            raise UsageError(f"--pp-local-stages: --pp-schedule {self.pp_schedule} holds one stage on each rank",
                             hint="add --pp-schedule interleaved-1f1b, or drop --pp-local-stages")
        microbatches = self.microbatches or self.pp
        if check_batch and self.batch % microbatches:
            raise UsageError(f"--pp: --batch {self.batch} does not split into {microbatches} micro-batches",
                             hint="pick a --batch that --microbatches divides (each micro-batch is batch / M)")
        refused = [flag for flag, given in (("--accumulate", self.accumulate > 1), ("--shard", self.shard is not None),
                                            ("--tp", self.tp > 1), ("--offload", self.offload is not None))
                   if given]
        refused += [f"--policy {p}" for p in self.policies if p != "eager"]
        if refused:
            raise UsageError(f"--pp with {', '.join(refused)} is not modelled",
                             hint="pipeline stages are simulated on the eager step alone; drop "
                                  + ", ".join(refused))
        return PipelineSetup(stages=self.pp, microbatches=microbatches, schedule=self.pp_schedule,
                             return_outputs=self.pp_return_outputs,
                             stages_per_rank=(self.pp_local_stages or 2) if interleaved else 1)


# Young objects allocated between two collections of the youngest generation (CPython's default: 700). A
# capture allocates millions of small objects (fx nodes, fake tensors, StepGraph records) that stay alive
# until the report, so collecting every 700 finds little garbage, and every tenth collection of the middle
# generation walks the whole heap. Measured on llama-88m's first command: 0.7 s of 6.3 s in the collector
# with the default, 0.3 s with this; llama-70b `--policy all`: 14.6 CPU s over its processes, 4.1 s.
YOUNG_OBJECTS_PER_COLLECTION = 50_000


def space_collections() -> tuple[int, int, int]:
    """The garbage collector runs after `YOUNG_OBJECTS_PER_COLLECTION` new objects from now on (the older
    generations' thresholds are kept, a larger one too); returns the thresholds it had."""
    import gc
    previous = gc.get_threshold()
    gc.set_threshold(max(YOUNG_OBJECTS_PER_COLLECTION, previous[0]), *previous[1:])
    return previous


@contextlib.contextmanager
def spaced_collections():
    """`space_collections` inside it, the caller's thresholds after; as a decorator, around each call.
    Processes forked inside it (the compiled policy's planning) inherit it."""
    import gc
    previous = space_collections()
    try:
        yield
    finally:
        gc.set_threshold(*previous)


@spaced_collections()
def run_analysis(model, options: AnalysisOptions, *, on_progress: Callable[[str], None] | None = None,
                 workers: int = 1):
    """`model`: a zoo name, `hf:<type>`, a model file path, or a `ModelSource`. Returns an `Analysis`.
    `workers` > 1 (the CLI passes one per CPU core): a deep model named by a string has its two cut
    captures made at once, the deeper in a forked child (`_processes_beside`; a model of 8 to 10 blocks
    too where that pays, `_cut_beside_deeper_than`), and a model captured in full has its policies other
    than compiled captured in a spawned process unless the capture plans the compiled ones in forked
    children itself (a CUDA target's Triton plan); the answer is the same."""
    source = load_source(model, options)
    early: dict = {}

    def capture():
        return capture_graphs(source, options, on_progress=on_progress,
                              model=model if isinstance(model, str) and workers > 1 else None,
                              meanwhile=lambda label, graph: _analyze_early(early, label, graph, options))

    graphs = _cached_capture(model, source, options, capture, on_progress)
    return analyze_captured(graphs, options, on_progress=on_progress,
                            analysed={label: result for label, (graph, result) in early.items()
                                      if graphs.get(label) is graph})


def _analyze_early(early: dict, label: str, graph, options: AnalysisOptions) -> None:
    """Records in `early` the analysis of a policy's final graph, made while another process captures (a
    deeper cut of the policies still missing): `analyze_captured` then does not repeat it. An analysis that
    raises is left to `analyze_captured`, which raises the same error at its usual place."""
    from tracer.passes.analysis import analyze_step
    try:
        early[label] = (graph, analyze_step(graph, label, **_analysis_setups(options)))
    except Exception:          # noqa: BLE001 - made again, and raised, after the capture
        pass


def _cached_capture(model, source, options: AnalysisOptions, capture: Callable, on_progress) -> dict:
    """`capture()`'s graphs, from the content-addressed cache when an entry for this model, its code, the
    installed packages and these options exists (tracer/capture_cache.py); stored after a capture."""
    from tracer import capture_cache

    if not isinstance(model, str) or not capture_cache.cache_enabled():
        return capture()
    key = capture_cache.step_key(model, source.path, options.plain())
    graphs = capture_cache.load(key)
    if graphs is not None:
        (on_progress or (lambda message: None))(f"using the cached capture ({capture_cache.cache_dir()}, "
                                                 f"{key[:12]}; --no-cache to capture again) ...")
        return graphs
    graphs = capture()
    capture_cache.store(key, graphs)
    return graphs


def default_workers() -> int:
    """One capture process per CPU core this process may use."""
    from tracer.capture.triton_target import usable_cores
    return usable_cores()


def load_source(model, options: AnalysisOptions):
    """The ModelSource of `model` (a ModelSource is returned as it is)."""
    from tracer.capture import load_model_source
    if not isinstance(model, str):
        return model
    source = load_model_source(model, hf_config=tuple(options.hf_config), config_json=options.config_json,
                               hf_attn=options.hf_attn, hf_task=options.hf_task, model_args=tuple(options.model_args))
    if options.gradient_checkpointing is None:
        return source
    from tracer.capture.model_input import with_gradient_checkpointing
    return with_gradient_checkpointing(source, reentrant=options.gradient_checkpointing == "reentrant")


def capture_graphs(source, options: AnalysisOptions, *, on_progress: Callable[[str], None] | None = None,
                   model: str | None = None, meanwhile: Callable | None = None) -> dict:
    """One StepGraph per policy spec of `options`, from one capture (`capture_steps`); a deep model's
    synthesized from a few of its blocks (tracer/depth_capture.py) unless `full_capture`. `model`: the
    string `source` was loaded from, given when a second process may make the `CHECK_DEPTH`-block
    capture while this one makes the `BASE_DEPTH` one (`_cut_in_two_processes`; then a model of 8 to 10
    blocks is cut too where `_cut_beside_deeper_than` says it pays). `meanwhile(label, graph)` is called
    with each policy's final graph while this process waits for another to capture the policies still
    missing (`_retried`)."""
    specs = options.policy_specs(model_save_policy=source.save_policy)
    say = on_progress or (lambda message: None)
    capture = _policies_capture(options, specs, say)
    cut, probed, early = None, False, {}
    try:
        if model is not None and not options.full_capture:
            blocks, probed = block_list(source, options, deeper_than=_cut_beside_deeper_than(specs)), True
            if blocks is not None:
                cut = _cut_in_two_processes(model, source, options, blocks, capture, say, early=early)
        capture_full = None if model is None else (
            lambda indices: _compiled_apart(model, source, options, specs, indices, capture, say))
        cut_again = None if model is None else (lambda blocks, indices, group, meanwhile=None: _cut_in_two_processes(
            model, source, options, blocks, capture, say, indices=indices, group=group, meanwhile=meanwhile,
            early=early))
        graphs = _capture_by_depth(source, (options,) * len(specs), capture, say, cut=cut,
                                   has_blocks=cut is not None or not probed, capture_full=capture_full,
                                   cut_again=cut_again,
                                   meanwhile=meanwhile and (lambda i, graph: meanwhile(specs[i].label, graph)))
    finally:
        _abandon(early)
    return {spec.label: graph for spec, graph in zip(specs, graphs)}


def _abandon(early: dict) -> None:
    """Stops the captures started early (`_cut_in_two_processes`) whose answer nobody asked for."""
    for work in early.values():
        work.abandon()
    early.clear()


def _cut_beside_deeper_than(specs: tuple) -> int | None:
    """The depth above which `capture_graphs` cuts a model, its deeper cut in a forked child at once
    (`_processes_beside`): `CUT_BESIDE_DEEPER_THAN` blocks where a second core is free for it and no
    policy is compiled (Inductor plans a whole model of so few blocks: it needs the full capture anyway,
    which is the other policies' too); else None (`block_list`'s depth that pays for two cuts made one
    after the other)."""
    from tracer.capture.triton_target import forking_available, planning_cores
    from tracer.depth_capture import CUT_BESIDE_DEEPER_THAN

    if forking_available() and planning_cores() > 1 and not any(spec.policy.compiled_any for spec in specs):
        return CUT_BESIDE_DEEPER_THAN
    return None


def _compiled_apart(model: str, source, options: AnalysisOptions, specs: tuple, indices: tuple, capture: Callable,
                    say) -> tuple:
    """`capture(source, indices)`'s graphs, the compiled policies' (Inductor's plan is most of a capture's
    time) captured here while a spawned process captures the others, when there are both and the capture
    does not plan them in forked children itself (`compiled_planned_apart`); the same graphs (each capture
    is independent), made here when no process can start."""
    from concurrent.futures.process import BrokenProcessPool

    from tracer.capture import compiled_planned_apart
    from tracer.capture.model_input import running_user_code

    here = tuple(i for i in indices if specs[i].name == "compiled")
    apart = tuple(i for i in indices if i not in here)
    if not apart or not here or compiled_planned_apart(options.capture_options(), tuple(specs[i] for i in here)):
        with running_user_code(source.name):
            return capture(source, indices)
    say(f"capturing {', '.join(specs[i].label for i in apart)} in a second process ...")
    with capture_processes(1) as pool:
        future = pool.submit(_capture_in_worker, model, options, apart)
        with running_user_code(source.name):
            graphs = dict(zip(here, capture(source, here)))
        try:
            graphs.update(zip(apart, future.result()))
        except BrokenProcessPool:          # no process could start (a script without `if __name__ == "__main__":`)
            with running_user_code(source.name):
                graphs.update(zip(apart, capture(source, apart)))
    return tuple(graphs[i] for i in indices)


def results_side_by_side(pool, lanes: int, calls: list[tuple[Callable, tuple]]) -> list:
    """`fn(*args)` of each call, in order: at most `lanes` of them in `pool` at a time (`lanes`: its
    processes, so none waits there), and whenever a call has no free worker, the last one left runs in this
    process, which would otherwise wait: three lanes share two cores instead of the third call starting
    when a worker ends. Each call is independent of the others, so its result is the same wherever it
    runs; the first error raised (a worker's or this process's) is raised."""
    from concurrent.futures import FIRST_COMPLETED, wait

    left = list(range(len(calls)))
    running: dict = {}
    results: dict = {}
    while left or running:
        while left and len(running) < lanes:
            i = left.pop(0)
            running[i] = pool.submit(calls[i][0], *calls[i][1])
        if left:
            i = left.pop()
            results[i] = calls[i][0](*calls[i][1])
        else:
            wait(running.values(), return_when=FIRST_COMPLETED)
        for i in [i for i, future in running.items() if future.done()]:
            results[i] = running.pop(i).result()
    return [results[i] for i in range(len(calls))]


@contextlib.contextmanager
def capture_processes(count: int, *, forked: bool = False):
    """A pool of `count` processes that print what this one prints, entered as a context. Spawned by
    default (a spawned process starts with logging's and warnings' defaults, and takes this process's: the
    CLI quiets libraries' logging and Python warnings unless --verbose, cli/entry.py). `forked` (only where
    `forking_available()`): all `count` are forked from this process when the first job is submitted, so
    they inherit its imports and the model it has loaded by then instead of starting Python, importing
    torch and loading the model again (each runs its real ops on one thread, as `start_forked`'s children
    do). The pool's processes and this one share the cores while it is open (triton_target.cores_shared_by)."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    from tracer.capture.triton_target import cores_shared_by, intra_op_threads
    threads = intra_op_threads() if forked else None
    with ProcessPoolExecutor(count, mp_context=multiprocessing.get_context("fork" if forked else "spawn"),
                             initializer=_as_sibling, initargs=(_output_state(), count + 1, threads)) as pool, \
            cores_shared_by(count + 1):
        yield pool


def _as_sibling(state: tuple[int, int | None, bool], processes: int, forked_from_threads: int | None = None) -> None:
    """A pool process's start: it prints as its parent does, shares the cores with `processes` - 1 others,
    collects garbage as seldom as the tracer's own work does (`space_collections`) and ends without the
    interpreter's final collection (the pool's shutdown waits for it). `forked_from_threads`: it is a forked
    child of a process running that many intra-op threads (triton_target.one_intra_op_thread)."""
    import atexit

    from tracer.capture.triton_target import one_intra_op_thread, share_cores
    _print_as_parent(state)
    share_cores(processes)
    if forked_from_threads is not None:
        one_intra_op_thread(forked_from_threads)
    space_collections()                       # for the process's life: it only runs the tracer's jobs
    atexit.register(end_without_collecting)


def end_without_collecting() -> None:
    """Leaves every object made so far to the process's end: the interpreter's teardown would otherwise
    walk all reference cycles of the captured graphs once more (about a second on a model of 88M
    parameters) to free memory the operating system takes back anyway. Exit handlers still run."""
    import gc
    gc.freeze()


def _output_state() -> tuple[int, int | None, bool]:
    """What this process lets print: `logging.disable`'s level, the last-resort handler's level, and whether
    Python warnings are ignored."""
    import logging
    import warnings
    ignored = warnings.filters[:1] == [("ignore", None, Warning, None, 0)]      # warnings.simplefilter("ignore")
    return (logging.root.manager.disable, logging.lastResort.level if logging.lastResort is not None else None,
            ignored)


def _print_as_parent(state: tuple[int, int | None, bool]) -> None:
    import logging
    import warnings
    disable, last_resort_level, warnings_ignored = state
    logging.disable(disable)
    if logging.lastResort is not None and last_resort_level is not None:
        logging.lastResort.setLevel(last_resort_level)
    if warnings_ignored:
        warnings.simplefilter("ignore")


@contextlib.contextmanager
def _processes_beside(model: str, source, options: AnalysisOptions, early: dict | None = None):
    """Where `_cut_in_two_processes` makes its deeper cut, as `submit(indices, depth)` -> a handle with
    `result()` and `cancel()`: a forked child of this process per capture, which inherits the loaded model
    (no second start of Python, import of torch and load of the model before it can capture: llama-70b's
    eager command took 7.7 s with it against 10.3 s with a spawned process), or where this platform cannot
    fork, a spawned process that loads `model` by its name. Either shares the cores with this one while it
    runs (`cores_shared_by`); a forked child whose answer is not read (this process failed meanwhile) is
    stopped on the way out. It forks per capture (`start_forked` runs a closure over the loaded source)
    where `capture_processes(forked=True)` hands jobs to a pool by name, as the levers' many groups need.
    `early` (where it forks): (indices, depth) -> a capture started by an earlier use with `submit(indices,
    depth, early_start=True)`, which runs on past that use's exit (whoever holds `early` stops those never asked
    for: `_abandon`); `submit` hands such a capture out instead of starting it again."""
    from tracer.capture.triton_target import cores_shared_by, forking_available, start_forked

    if not forking_available():
        with capture_processes(1) as pool:
            yield lambda indices, depth: pool.submit(_capture_in_worker, model, options, indices, depth)
        return
    started = []

    def fork(indices, depth, early_start: bool = False):
        key = (tuple(indices), depth)
        if early is not None and key in early:
            started.append(early.pop(key))
            return started[-1]
        work = start_forked(lambda: _capture_source(source, options, indices, depth))
        if early_start and early is not None:
            early[key] = work
        else:
            started.append(work)
        return work

    try:
        with cores_shared_by(2):
            yield fork
    finally:
        for work in started:
            work.abandon()


def _capture_in_worker(model: str, options: AnalysisOptions, indices: tuple | None, depth: int | None = None) -> tuple:
    """A spawned process's job (`capture_processes`): the graphs of `model`'s policy specs at `indices` (None:
    all), of the model cut to `depth` blocks (None: in full)."""
    return _capture_source(load_source(model, options), options, indices, depth)


def _capture_source(source, options: AnalysisOptions, indices: tuple | None, depth: int | None = None) -> tuple:
    """The graphs of `source`'s policy specs at `indices` (None: all), of the model cut to `depth` blocks
    (None: in full), captured without progress lines (another process reports)."""
    from tracer.capture.model_input import running_user_code
    from tracer.depth_capture import cut_source

    specs = options.policy_specs(model_save_policy=source.save_policy)
    src = source if depth is None else cut_source(source, depth, {})
    with running_user_code(source.name):
        return _policies_capture(options, specs, lambda message: None)(
            src, tuple(range(len(specs))) if indices is None else indices)


def _policies_capture(options: AnalysisOptions, specs: tuple, say) -> Callable:
    """capture(src, indices): the graphs of `specs[i]` for each index, from one capture of `src`."""
    from tracer.capture import capture_steps

    def capture(src, indices) -> tuple:
        graphs = capture_steps(src, options.capture_options(), tuple(specs[i] for i in indices),
                               on_policy=lambda label: say(f"simulating {label} ..."), on_stage=say)
        return tuple(graphs[specs[i].label] for i in indices)

    return capture


def _cut_in_two_processes(model: str, source, options: AnalysisOptions, blocks, capture: Callable, say, *,
                          indices: tuple | None = None, group: int = 1, meanwhile: Callable[[], None] | None = None,
                          early: dict | None = None):
    """The two cut captures of `capture_cut` (tracer/depth_capture.py) of the policy specs at `indices`
    (None: all) in units of `group` blocks, the deeper one in a second process (`_processes_beside`) while
    this one makes the other: the same `CutSteps`, a TracerError of either kept as `capture_cut` keeps it.
    In units of one block, a compiled policy planned for a CUDA target is left out of both (`_cut_ahead`):
    Inductor's Triton plan hands buffers on across blocks, so its check in units of one block would only
    fail after two plans; its synthesis is refused with that reason and the caller cuts it in
    `HANDED_ON_UNITS` blocks at once (or captures it in full where such a cut does not pay): where `early` is
    given and this process can fork, the deeper of those cuts is started first, into `early`
    (`_processes_beside`), so that it runs beside these cuts instead of after them. `meanwhile()` runs here
    once this process has made its cut and prepared its synthesis, before it waits for the other."""
    from concurrent.futures.process import BrokenProcessPool

    from tracer.capture.model_input import running_user_code
    from tracer.capture.triton_target import TritonPlanError, forking_available
    from tracer.depth_capture import CutSteps, cut_depths, cut_pays, cut_source, prepare_synthesis
    from tracer.errors import TracerError

    specs = options.policy_specs(model_save_policy=source.save_policy)
    if indices is None:
        indices = tuple(range(len(specs)))
    base_depth, check_depth = cut_depths(blocks.depth, group)
    ahead = _cut_ahead(options, specs, indices) if group == 1 else {}
    cut = tuple(i for i in indices if i not in ahead)
    if cut:
        say(f"capturing {source.name} cut to {base_depth} and (in a second process) {check_depth} of its "
            f"{blocks.depth} blocks under fake tensors ...")
    deferred = {j: f"{specs[i].label}: not cut in units of 1 block: Inductor's Triton plan hands buffers on across "
                   + (f"blocks, so it is cut in units of {ahead[i]} blocks at once"
                      if cut_pays(blocks.depth, ahead[i]) else
                      f"blocks, and the deeper of its cuts in units of {ahead[i]} blocks "
                      f"({cut_depths(blocks.depth, ahead[i])[1]}) would capture more than half of the {blocks.depth}")
                for j, i in enumerate(indices) if i in ahead}
    ahead_at = {j: ahead[i] for j, i in enumerate(indices) if i in ahead}

    def in_order(graphs) -> tuple:
        made = iter(graphs)
        return tuple(None if i in ahead else next(made) for i in indices)

    starts_early = early is not None and forking_available()
    paying = tuple(i for i in indices if i in ahead and cut_pays(blocks.depth, ahead[i])) if starts_early else ()
    with _processes_beside(model, source, options, early if starts_early else None) as submit:
        for units in sorted({ahead[i] for i in paying}):        # the longest capture of all: started first
            submit(tuple(i for i in paying if ahead[i] == units), cut_depths(blocks.depth, units)[1], early_start=True)
        check = submit(cut, check_depth) if cut else None
        try:
            with running_user_code(source.name):
                base = in_order(capture(cut_source(source, base_depth, {}), cut) if cut else ())
        except TracerError as exc:
            if check is not None:
                check.cancel()
            _abandon(early or {})
            return CutSteps(blocks, None, None, exc, group=group)
        # the synthesized side of the check needs only `base`: made while the other process captures
        prepared = prepare_synthesis(base, lambda j, graph: analyze_one(graph, options), blocks.depth, group,
                                     deferred=deferred)
        if meanwhile is not None:
            meanwhile()
        try:
            return CutSteps(blocks, base, in_order(check.result() if check is not None else ()), prepared=prepared,
                            group=group, ahead=ahead_at)
        except TracerError as exc:
            _abandon(early or {})
            return CutSteps(blocks, base, None, exc, group=group)
        except (BrokenProcessPool, TritonPlanError):
            pass              # no process could start (a script without `if __name__ == "__main__":`), or it died
    say(f"capturing {source.name} cut to {check_depth} blocks in this process ...")
    try:
        with running_user_code(source.name):
            return CutSteps(blocks, base, in_order(capture(cut_source(source, check_depth, {}), cut)),
                            prepared=prepared, group=group, ahead=ahead_at)
    except TracerError as exc:
        return CutSteps(blocks, base, None, exc, group=group)


def _cut_ahead(options: AnalysisOptions, specs: tuple, indices: tuple) -> dict[int, int]:
    """Index -> the units of blocks each policy spec at `indices` is cut in at once (`cut_ahead_units`),
    for those not cut in units of one block (`_cut_in_two_processes`)."""
    units = {i: cut_ahead_units(options.capture_options(), specs[i]) for i in indices}
    return {i: group for i, group in units.items() if group is not None}


def cut_ahead_units(capture_options, spec) -> int | None:
    """The units of blocks (`HANDED_ON_UNITS`) a whole-model compiled policy planned for a CUDA target is cut
    in at once instead of one block, or None (cut in units of one): Inductor's Triton plan hands buffers on
    across blocks, so a check in units of one would only fail after two plans. Not the compiled-blocks
    policies: Inductor plans each block on its own there, so no buffer of its plan crosses a block and their
    cut in units of one checks (llama-7b's `compiled-blocks`). The one rule for `capture_graphs` and the
    levers' groups (tracer/levers.py)."""
    from tracer.capture import compiled_planned_apart
    from tracer.depth_capture import HANDED_ON_UNITS

    return HANDED_ON_UNITS if spec.policy.compiled and compiled_planned_apart(capture_options, (spec,)) else None


def capture_variants(source, variants: tuple[AnalysisOptions, ...], *,
                     on_progress: Callable[[str], None] | None = None, cut=None, cut_again=None) -> tuple:
    """The StepGraph of each variant's first policy, from one joint capture: the variants may differ only in
    their policies and in how the step around forward and backward runs (capture.STEP_FIELDS). `cut`: the
    variants' captures of the model cut to a few blocks (`block_list`, then `capture_cut_variants` per
    depth, as `tracer.depth_capture.CutSteps`), when already made; `cut_again(blocks, indices, group)`: how
    the cuts in larger units are made (`_capture_by_depth`), when not one after the other here."""
    say = on_progress or (lambda message: None)
    return _capture_by_depth(source, variants, _variant_capture(source, variants, say), say, cut=cut,
                             cut_again=cut_again)


def block_list(source, options: AnalysisOptions, *, deeper_than: int | None = None):
    """The block list `capture_graphs` and `capture_variants` synthesize the depth of (tracer/depth_capture.py),
    or None: captured in full. `deeper_than`: any repeated block list of more blocks than that (None: the
    depth that pays for two cut captures)."""
    from tracer.capture.context_parallel import ring_attention
    from tracer.capture.model_input import running_user_code
    from tracer.capture.process_group import rank_zero_of
    from tracer.depth_capture import find_block_list

    if options.full_capture:
        return None
    # the model is built as a rank builds it
    with running_user_code(source.name), rank_zero_of(max(options.ep, options.cp)), \
            ring_attention(options.cp, options.seq):
        return find_block_list(source, precision=options.precision, seq=options.capture_seq, deeper_than=deeper_than)


def capture_cut_variants(source, variants: tuple[AnalysisOptions, ...], depth: int, *,
                         on_progress: Callable[[str], None] | None = None) -> tuple:
    """`capture_variants`' graphs of `source` with its block list cut to `depth` blocks (one of the two cut
    captures of a deep model, made where the caller chooses)."""
    from tracer.capture.model_input import running_user_code
    from tracer.depth_capture import cut_source

    capture = _variant_capture(source, variants, on_progress or (lambda message: None))
    with running_user_code(source.name):
        return capture(cut_source(source, depth, {}), tuple(range(len(variants))))


def _variant_capture(source, variants: tuple[AnalysisOptions, ...], say) -> Callable:
    from tracer.capture import capture_step_requests

    # the variants' steps come from one joint capture, which their synthesis and its check compare op for
    # op: the graph's, never an eager-only variant's step run op by op
    requests = tuple((dataclasses.replace(v.capture_options(), op_by_op_first=False),
                      v.policy_specs(model_save_policy=source.save_policy)[0]) for v in variants)
    return lambda src, indices: capture_step_requests(
        src, tuple(requests[i] for i in indices), on_policy=lambda label: say(f"simulating {label} ..."),
        on_stage=say)


def _capture_by_depth(source, options: tuple[AnalysisOptions, ...], capture: Callable, say, cut=None,
                      has_blocks: bool = True, capture_full: Callable | None = None,
                      cut_again: Callable | None = None, meanwhile: Callable | None = None) -> tuple:
    """`capture(source, indices)`'s graphs (one per entry of `options`, analysed with it) at the model's
    depth: synthesized from the model cut to a few blocks where that is checked exact
    (tracer/depth_capture.py; `cut`: those cut captures, when already made), the others captured in full,
    with a note when the synthesis was refused. `has_blocks` False: the model has no block list to cut (already
    looked for). `capture_full(indices)`: how the full capture is made, when not by `capture(source, indices)`;
    `cut_again(blocks, indices, group)`: how the cuts in units of `group` blocks are made (a `CutSteps`), when
    not by `capture` here, one after the other; `meanwhile(i, graph)`: see `_retried`."""
    from tracer.capture.model_input import running_user_code
    from tracer.depth_capture import DeepCapture, capture_deep, with_note

    def analyze(i: int, graph):
        return analyze_one(graph, options[i])

    def captured(src, indices):
        with running_user_code(source.name):     # the model's print(), sys.exit() and KeyboardInterrupt
            return capture(src, indices)

    first, everything = options[0], tuple(range(len(options)))
    deep = DeepCapture((None,) * len(options), None)
    if has_blocks and not first.full_capture:
        with running_user_code(source.name):
            deep = capture_deep(source, lambda src: captured(src, everything), analyze, count=len(options),
                                precision=first.precision, seq=first.seq, say=say, cut=cut)
    missing = tuple(i for i, graph in enumerate(deep.graphs) if graph is None)
    if deep.retry is not None and missing:
        deep = _retried(source, deep, missing, captured, analyze, say, cut_again, meanwhile)
        missing = tuple(i for i, graph in enumerate(deep.graphs) if graph is None)
    if not missing:
        return deep.graphs
    say(f"capturing {source.name} (batch {first.batch}, seq {first.seq}) under fake tensors ...")
    full = dict(zip(missing, capture_full(missing) if capture_full else captured(source, missing)))
    return tuple(graph if graph is not None else with_note(full[i], deep.note) for i, graph in enumerate(deep.graphs))


def _retried(source, deep, missing: tuple, captured: Callable, analyze: Callable, say, cut_again=None,
             meanwhile=None):
    """`deep` with its `missing` graphs synthesized from a second cut in units of `deep.retry.group` blocks
    where that is checked exact (and from a third in larger units where that check asks for it); the note
    says why the others are still captured in full. `meanwhile(i, graph)` is called once with each graph
    already final, from `cut_again` while another process makes the deeper cut (the time this process
    would otherwise wait)."""
    from tracer.capture.model_input import running_user_code
    from tracer.depth_capture import DeepCapture, capture_cut, check_synthesis

    handed = set()

    def hand_on_final():
        for i, graph in enumerate(deep.graphs):
            if graph is not None and i not in handed:
                handed.add(i)
                meanwhile(i, graph)

    while deep.retry is not None and missing:
        if cut_again is not None:
            cut = cut_again(deep.retry.blocks, missing, deep.retry.group,
                            **({"meanwhile": hand_on_final} if meanwhile is not None else {}))
        else:
            with running_user_code(source.name):
                cut = capture_cut(source, deep.retry.blocks, lambda src, indices=missing: captured(src, indices),
                                  say, group=deep.retry.group)
        again = check_synthesis(cut, lambda j, graph, indices=missing: analyze(indices[j], graph),
                                count=len(missing))
        graphs = list(deep.graphs)
        for j, i in enumerate(missing):
            graphs[i] = again.graphs[j]
        deep = DeepCapture(tuple(graphs), again.note and f"{deep.note}; {again.note}", retry=again.retry)
        missing = tuple(i for i in missing if graphs[i] is None)
    return deep


def analyze_one(graph, options: AnalysisOptions):
    """The PolicyAnalysis of one captured graph with `options` (what the depth synthesis is checked on). A
    pipeline split is left out: the check compares cut steps, which have fewer blocks than the stages may
    need; the full-depth step is split where it is analysed."""
    if options.pp > 1:
        options = dataclasses.replace(options, pp=1, microbatches=None, pp_schedule=MODEL_DEFAULTS["pp_schedule"],
                                      pp_return_outputs=MODEL_DEFAULTS["pp_return_outputs"], pp_local_stages=None)
    return analyze_captured({"policy": graph}, options).policies["policy"]


def analyze_captured(graphs: dict, options: AnalysisOptions, *,
                     on_progress: Callable[[str], None] | None = None, analysed: dict | None = None):
    """The passes over captured graphs, with the device view, sharding and tensor parallelism of `options`
    (none of which changes the capture). `analysed`: label -> the analysis of that label's graph already
    made with `options` (`_analyze_early`)."""
    from tracer.passes.analysis import analyze_graphs

    (on_progress or (lambda message: None))("analysing ...")
    return analyze_graphs(graphs, settings=options.settings(), options=options.plain(), analysed=analysed,
                          **_analysis_setups(options))


def _analysis_setups(options: AnalysisOptions) -> dict:
    """The device, sharding, tensor-parallel and pipeline setups every policy of `options` is analysed with."""
    return dict(device=options.device_setup(), sharding=options.sharding_setup(),
                tensor_parallel=options.tensor_parallel_setup(), pipeline=options.pipeline_setup())


def _positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _check_save_ops(names) -> None:
    """Every --save-ops name must be an aten op ('mm', 'aten.mm', 'aten.mm.default')."""
    from tracer.errors import UsageError
    from tracer.policies import op_packet

    if isinstance(names, str) or not all(isinstance(n, str) for n in names):
        raise UsageError(f"save_ops={names!r} is not valid", hint="a tuple of aten op names, e.g. ('mm', 'bmm')")
    wanted = [n.strip() for n in names if n.strip()]
    if not wanted:
        return
    import difflib

    import torch
    unknown = [n for n in wanted if not hasattr(torch.ops.aten, op_packet(n))]
    if unknown:
        close = difflib.get_close_matches(op_packet(unknown[0]), dir(torch.ops.aten), n=3)
        raise UsageError(f"--save-ops: {unknown[0]!r} is not an aten op",
                         hint=("close names: " + ", ".join(close)) if close else
                         "name aten ops as in the report's per-line table, e.g. mm,bmm,_scaled_dot_product_flash_attention")


def options_from_keywords(*, memory_budget: float | None = None, **keywords) -> AnalysisOptions:
    """`tracer.analyze`'s keywords -> AnalysisOptions. Raises UsageError naming an unknown keyword."""
    from tracer.errors import UsageError

    keywords = _zero_grad_keyword(keywords)
    names = {f.name for f in dataclasses.fields(AnalysisOptions)} - {"memory_budgets"}
    unknown = sorted(set(keywords) - names)
    if unknown:
        valid = sorted(names - {"zero_grad_set_to_none"} | {"zero_grad"})
        raise UsageError(f"unknown option {unknown[0]!r}", hint=f"valid: memory_budget, {', '.join(valid)}")
    for name in ("policies", "save_ops", "hf_config", "lora_targets"):
        if name in keywords and not isinstance(keywords[name], str):
            keywords[name] = tuple(keywords[name])
    if isinstance(keywords.get("lora_targets"), str):
        from tracer.checks.options import comma_names
        keywords["lora_targets"] = comma_names(keywords["lora_targets"])
    if isinstance(keywords.get("policies"), str):
        keywords["policies"] = (keywords["policies"],)
    return AnalysisOptions(memory_budgets=(memory_budget,), **keywords)


def _zero_grad_keyword(keywords: dict) -> dict:
    """`zero_grad="none"|"zeros"`, spelled as `--zero-grad` and the marker's keyword, -> the field
    zero_grad_set_to_none (which callers inside tracer pass as it is)."""
    from tracer.errors import UsageError

    if "zero_grad" not in keywords:
        return keywords
    if "zero_grad_set_to_none" in keywords:
        raise UsageError("zero_grad and zero_grad_set_to_none both given", hint="give zero_grad='none' or 'zeros'")
    from tracer.checks.options import MODEL_OPTIONS, check_option_value, options_fields

    check_option_value(next(o for o in MODEL_OPTIONS if o.name == "zero_grad"), keywords["zero_grad"])
    return options_fields(keywords)
