"""The analysis pipeline: a straight list of pure passes over one `StepGraph` per simulated policy.

`analyze_graphs({label: graph})` returns an `Analysis` with one `PolicyAnalysis` per policy (eager,
compiled, selective, full, compiled@budget ...), each with its liveness, peak, bill, attribution and
FLOPs: `step_flops` counts every op of the step that has a formula (forward, backward, recompute,
optimizer), `recompute_flops` the forward ops re-run in backward; ops without a formula are listed in
`flops.unknown_ops`, never counted as zero.
"""
from __future__ import annotations

import dataclasses

from tracer.passes.attribution import Attribution, attribute, categorize, layer_of
from tracer.passes.device import DeviceMemory, DeviceSetup, predict_device_memory, sharded_device_memory
from tracer.passes.host import HostMemory, host_memory
from tracer.passes.flops import FlopSummary, op_flops, summarize_flops
from tracer.passes.liveness import Liveness, compute_liveness
from tracer.passes.saved import SavedTensors, find_saved_tensors
from tracer.passes.sharding import ShardedMemory, shard_memory
from tracer.passes.pipeline_parallel import PipelineSetup, busiest_stage_graph
from tracer.passes.tensor_parallel import TensorParallelSetup, tensor_parallel_graph
from tracer.stepgraph import OpNode, Phase, StepGraph


@dataclasses.dataclass(frozen=True)
class PhasePeak:
    phase: str
    peak_bytes: int
    op_index: int


@dataclasses.dataclass(frozen=True)
class PolicyAnalysis:
    policy: str
    peak_bytes: int
    peak_op: OpNode
    phases: dict[str, PhasePeak]
    start_bytes: int
    end_bytes: int
    saved: SavedTensors
    at_peak: Attribution
    liveness: Liveness
    categories: tuple[str, ...]           # bill category per storage id
    graph: StepGraph
    flops: FlopSummary
    recompute_flops: int
    recompute_flops_by_line: dict[str, int]   # "file:line" -> FLOPs of recomputed ops from that line
    flops_by_layer: dict[str, int]            # layer (attribution.layer_of) -> FLOPs of its ops, all phases
    device: "DeviceMemory | None" = None      # the CUDA device view (allocated/reserved), for a CUDA target
    sharded: "ShardedMemory | None" = None    # per rank under --shard (passes/sharding.py)
    rank_device: "DeviceMemory | None" = None # rank 0's device view under --shard, for a CUDA target
    host: "HostMemory | None" = None          # host memory under --offload (passes/host.py)

    @property
    def peak_phase(self) -> str:
        return self.peak_op.phase_name

    @property
    def step_flops(self) -> int:
        return self.flops.total_flops


@dataclasses.dataclass(frozen=True)
class Analysis:
    policies: dict[str, PolicyAnalysis]
    settings: dict = dataclasses.field(default_factory=dict)   # every setting that changes the answer
    options: dict = dataclasses.field(default_factory=dict)    # the options that made it, as plain values: a
                                                               # baseline records them and `tracer check` replays them
    @property
    def graph(self) -> StepGraph:
        """The eager step graph (or the first policy's, when eager was not simulated)."""
        return (self.policies.get("eager") or next(iter(self.policies.values()))).graph


def analyze_graph(graph: StepGraph) -> Analysis:
    return analyze_graphs({graph.config.policy: graph})


def analyze_graphs(graphs: dict[str, StepGraph], device: DeviceSetup | None = None, *,
                   sharding: ShardingSetup | None = None, settings: dict | None = None,
                   tensor_parallel: "TensorParallelSetup | None" = None, options: dict | None = None,
                   pipeline: "PipelineSetup | None" = None, analysed: dict | None = None) -> Analysis:
    """One PolicyAnalysis per graph (`analyze_step`); `analysed`: label -> the PolicyAnalysis already made
    by `analyze_step` of that label's graph with these same arguments (its work is not repeated)."""
    made = analysed or {}
    policies = {label: made[label] if label in made else
                analyze_step(graph, label, device, sharding=sharding, tensor_parallel=tensor_parallel,
                             pipeline=pipeline)
                for label, graph in graphs.items()}
    return Analysis(policies=policies, settings=dict(settings or {}), options=dict(options or {}))


def analyze_step(graph: StepGraph, label: str, device: DeviceSetup | None = None, *,
                 sharding: "ShardingSetup | None" = None, tensor_parallel: "TensorParallelSetup | None" = None,
                 pipeline: "PipelineSetup | None" = None) -> PolicyAnalysis:
    """The PolicyAnalysis of one policy's graph; with `device`, it carries its device view (passes/device.py);
    with `sharding`, its per-rank memory and (with `device`) rank 0's device view, which alone is checked
    against the device's memory. With `tensor_parallel`, the graph is first replaced by the step of one
    tensor-parallel rank (passes/tensor_parallel.py), so everything above describes that rank; with
    `pipeline`, by the step of the pipeline stage with the largest peak (passes/pipeline_parallel.py).
    Policies do not depend on each other: each is analysed alone."""
    if tensor_parallel is not None:
        graph = tensor_parallel_graph(graph, tensor_parallel)
    if pipeline is not None:
        graph = busiest_stage_graph(graph, pipeline)
    result = analyze_policy(graph, label)
    if device is not None:
        result = with_device_view(result, device if sharding is None else
                                  dataclasses.replace(device, capacity_bytes=None))
    if sharding is not None:
        result = with_sharding(result, sharding, device)
    return result


@dataclasses.dataclass(frozen=True)
class ShardingSetup:
    strategy: str                  # passes.sharding.STRATEGIES
    world_size: int
    reshard_after_forward: bool = True
    fp32_master: bool = False      # FSDP2 mixed precision: bf16 compute, fp32 sharded state (passes/sharding.py)


def with_sharding(result: PolicyAnalysis, sharding: ShardingSetup, device: DeviceSetup | None) -> PolicyAnalysis:
    sharded = shard_memory(result, sharding.strategy, sharding.world_size,
                           reshard_after_forward=sharding.reshard_after_forward, fp32_master=sharding.fp32_master)
    rank_device = None if device is None else sharded_device_memory(sharded, device, policy=result.policy,
                                                                     graph=result.graph)
    return dataclasses.replace(result, sharded=sharded, rank_device=rank_device)


def with_device_view(result: PolicyAnalysis, device: DeviceSetup) -> PolicyAnalysis:
    """On unified memory (`system_bytes` > 0) what the step holds "on the host" (--offload) comes out of the
    same memory: the device view's capacity is less the host peak."""
    capacity = device.capacity_bytes
    if device.system_bytes and capacity is not None and result.host is not None:
        capacity = max(capacity - result.host.peak_bytes, 0)
    view = predict_device_memory(result, extra=device.extra_for(result.graph), config=device.config,
                                 capacity_bytes=capacity,
                                 conv_workspace_cap_bytes=device.conv_workspace_cap_bytes)
    return dataclasses.replace(result, device=dataclasses.replace(view, context_bytes=device.context_bytes,
                                                                  system_bytes=device.system_bytes,
                                                                  nccl_bytes=device.nccl_bytes,
                                                                  nccl_communicators=device.nccl_communicators))


def analyze_policy(graph: StepGraph, policy: str) -> PolicyAnalysis:
    liveness = compute_liveness(graph)
    saved = find_saved_tensors(graph, liveness)
    categories = categorize(graph, liveness, saved)
    at_peak = attribute(graph, liveness, saved, categories, liveness.peak_op)
    return PolicyAnalysis(
        policy=policy,
        peak_bytes=liveness.peak_bytes,
        peak_op=graph.ops[liveness.peak_op],
        phases=phase_peaks(graph, liveness),
        start_bytes=liveness.start_bytes,
        end_bytes=liveness.live_after[-1] if liveness.live_after else liveness.start_bytes,
        saved=saved,
        at_peak=at_peak,
        liveness=liveness,
        categories=categories,
        graph=graph,
        flops=summarize_flops(graph.ops),
        recompute_flops=sum(op_flops(op) or 0 for op in graph.ops if op.recomputed),
        recompute_flops_by_line=_recompute_flops_by_line(graph),
        flops_by_layer=_flops_by_layer(graph),
        host=host_memory(graph),
    )


def _flops_by_layer(graph: StepGraph) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in graph.ops:
        flops = op_flops(op)
        if flops:
            layer = "(optimizer step)" if op.phase is Phase.OPTIMIZER else (layer_of(op.module) or "(root)")
            out[layer] = out.get(layer, 0) + flops
    return out


def _recompute_flops_by_line(graph: StepGraph) -> dict[str, int]:
    out: dict[str, int] = {}
    for op in graph.ops:
        if op.recomputed and op.source is not None:
            label = f"{op.source.file}:{op.source.line}"
            out[label] = out.get(label, 0) + (op_flops(op) or 0)
    return out


def phase_peaks(graph: StepGraph, liveness: Liveness) -> dict[str, PhasePeak]:
    """The peak of each phase, in step order (under gradient accumulation, one forward and one backward per
    micro-batch: "forward (micro-batch 2)")."""
    peaks: dict[str, PhasePeak] = {}
    for op in graph.ops:
        bytes_now = liveness.live_during[op.index]
        name = op.phase_name
        best = peaks.get(name)
        if best is None or bytes_now > best.peak_bytes:
            peaks[name] = PhasePeak(name, bytes_now, op.index)
    return peaks
