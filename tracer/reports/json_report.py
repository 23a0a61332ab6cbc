"""The versioned JSON report (schema documented in docs/guides/reports.md, "JSON schema").

Version 1: {schema_version, tracer_version, torch_version, config, capture_notes, parameter_count,
frozen_parameter_count, policies: {<name>: {peak_bytes, peak_phase, peak_op, phases: {<phase>: {peak_bytes}},
start_bytes, end_bytes, saved_bytes, saved_activation_bytes, by_category_at_peak, frozen_parameter_bytes, top_lines, layers, recompute_flops,
step_flops, flops_by_phase, flops_by_layer, unknown_flop_ops, device (CUDA target only: requested_peak_bytes,
allocated_peak_bytes, reserved_peak_bytes, peak_phase, phases_requested_bytes, before_bytes, extra,
segment_count, capacity_bytes, out_of_memory), host (--offload only: peak_bytes, start_bytes, saved_bytes,
resident_bytes {optimizer_state, parameter, gradient})}}}.
"""
from __future__ import annotations

import dataclasses

from tracer.passes.analysis import Analysis, PolicyAnalysis
from tracer.passes.attribution import frozen_parameter_bytes

SCHEMA_VERSION = 1


def report_json(analysis: Analysis, *, top: int = 10, versions: dict[str, str] | None = None) -> dict:
    graph = analysis.graph
    return {
        "schema_version": SCHEMA_VERSION,
        **(versions or {}),
        "config": {**{k: v for k, v in dataclasses.asdict(graph.config).items() if k not in ("policy", "notes")},
                   **analysis.settings},
        "capture_notes": list(graph.config.notes),
        "parameter_count": graph.parameter_count,
        "frozen_parameter_count": graph.frozen_parameter_count,
        "policies": {name: policy_json(p, top=top) for name, p in analysis.policies.items()},
    }


def policy_json(result: PolicyAnalysis, *, top: int) -> dict:
    op = result.peak_op
    return {
        "peak_bytes": result.peak_bytes,
        "peak_phase": result.peak_phase,
        "peak_op": {"name": op.name, "target": op.target, **_source(op.source)},
        "phases": {name: {"peak_bytes": p.peak_bytes} for name, p in result.phases.items()},
        "start_bytes": result.start_bytes,
        "end_bytes": result.end_bytes,
        "saved_bytes": result.saved.total_bytes,
        "saved_activation_bytes": result.saved.activation_bytes,
        "by_category_at_peak": dict(result.at_peak.by_category),
        "frozen_parameter_bytes": frozen_parameter_bytes(result.graph),
        "top_lines": [{**_source(row.source), "label": row.label, "bytes_at_peak": row.bytes_at_peak,
                       "saved_bytes": row.saved_bytes} for row in result.at_peak.lines[:top]],
        "layers": [{"layer": row.layer, "bytes_at_peak": row.bytes_at_peak, "saved_bytes": row.saved_bytes}
                   for row in result.at_peak.layers],
        "recompute_flops": result.recompute_flops,
        "step_flops": result.step_flops,
        "flops_by_phase": dict(result.flops.flops_by_phase),
        "flops_by_layer": dict(result.flops_by_layer),
        "unknown_flop_ops": [{"target": t, "count": n} for t, n in result.flops.unknown_ops],
        **({"device": device_json(result.device)} if result.device is not None else {}),
        **({"per_rank": per_rank_json(result)} if result.sharded is not None else {}),
        **({"host": {"peak_bytes": result.host.peak_bytes, "start_bytes": result.host.start_bytes,
                     "resident_bytes": dict(result.host.resident_bytes),
                     "saved_bytes": result.host.saved_bytes}} if result.host is not None else {}),
    }


def per_rank_json(result: PolicyAnalysis) -> dict:
    """Rank 0 under --shard: its peak, phases, model state and bill, and its device view (CUDA target)."""
    s = result.sharded
    return {"strategy": s.strategy, "world_size": s.world_size, "peak_bytes": s.peak_bytes, "peak_phase": s.peak_phase,
            "phases": dict(s.phases), "start_bytes": s.start_bytes, "model_state_bytes": dict(s.model_state_bytes),
            "by_category_at_peak": dict(s.by_category_at_peak),
            **({"device": device_json(result.rank_device)} if result.rank_device is not None else {})}


def device_json(device) -> dict:
    """The CUDA device view: requested (a snapshot's bytes), allocated and reserved peaks, extras, OOM."""
    return {
        "requested_peak_bytes": device.peak_bytes,
        "allocated_peak_bytes": device.allocated_peak_bytes,
        "reserved_peak_bytes": device.reserved_peak_bytes,
        "peak_phase": device.peak_phase,
        "phases_requested_bytes": dict(device.phases),
        "before_bytes": device.before_bytes,
        "extra": [{"name": name, "bytes": nbytes} for name, nbytes in device.extra],
        "segment_count": device.segment_count,
        "capacity_bytes": device.capacity_bytes,
        "cuda_context_bytes": device.context_bytes,
        "nccl_bytes": device.nccl_bytes,
        "out_of_memory": device.oom is not None,
        **({"cudnn_convolution_calls": device.conv_calls,
            "cudnn_workspace_cap_bytes": device.conv_workspace_cap_bytes} if device.conv_calls else {}),
    }


def _source(source) -> dict:
    if source is None:
        return {"file": None, "line": None, "code": None}
    return {"file": source.file, "line": source.line, "code": source.code}
