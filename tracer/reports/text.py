"""The terminal report of one analysis: peak, phase, bill, per-phase peaks, top lines, layers."""
from __future__ import annotations

import re

from tracer.passes.analysis import Analysis, PolicyAnalysis
from tracer.passes.attribution import CATEGORIES, LayerBytes, frozen_parameter_bytes
from tracer.policies import parse_policy_label, policy_named
from tracer.reports.line_table import model_dir, short_label
from tracer.reports.units import format_bytes, format_flops


def render_text(analysis: Analysis, *, policy: str | None = None, top: int = 10) -> str:
    """The policy table when several policies were simulated and `policy` is None; else one policy in full."""
    if policy is None:
        if len(analysis.policies) > 1:
            return render_policy_table(analysis)
        policy = next(iter(analysis.policies))
    result = analysis.policies[policy]
    graph = result.graph
    cfg = graph.config
    lines = [
        f"tracer: {cfg.model}  on {cfg.target}  batch {cfg.batch}{_micro_batches(cfg)}  {cfg.size_words}  {cfg.precision}  optimizer "
        f"{cfg.optimizer}  {cfg.step} step  (capture: {cfg.capture_path}, policy: {policy})",
        f"parameters: {graph.parameter_count:,}" + (f" (frozen {graph.frozen_parameter_count:,}, trainable "
                                                     f"{graph.parameter_count - graph.frozen_parameter_count:,})"
                                                     if graph.frozen_parameter_count else ""),
        *(f"note: {note}" for note in cfg.notes),
        "",
        f"peak: {format_bytes(result.peak_bytes)} ({result.peak_bytes:,} B) in {result.peak_phase}, "
        f"at {result.peak_op.target} {_where(result.peak_op.source, model_dir(cfg.model))}",
        "per phase: " + "  |  ".join(f"{name} {format_bytes(p.peak_bytes)}" for name, p in result.phases.items()),
        f"live before the step: {format_bytes(result.start_bytes)}   after: {format_bytes(result.end_bytes)}",
        f"saved for backward: {format_bytes(result.saved.activation_bytes)} of activations"
        + (f" (+ {format_bytes(result.saved.input_bytes)} of inputs)" if result.saved.input_bytes else "")
        + (f", {format_bytes(result.host.saved_bytes)} of them copies in host memory (offloaded)"
           if result.host is not None and result.host.saved_bytes else ""),
        *_device_lines(result, cfg.target),
        "",
        "bill at the peak:",
    ]
    for cat in CATEGORIES:
        nbytes = result.at_peak.by_category[cat]
        share = 100.0 * nbytes / result.peak_bytes if result.peak_bytes else 0.0
        lines.append(f"  {cat:<16} {format_bytes(nbytes):>14}  {share:5.1f}%" + _bill_detail(result, cat))
    lines += _host_lines(result)
    lines += ["", f"top {top} lines at the peak:", f"  {'at peak':>12} {'saved':>12}  line"]
    for row in result.at_peak.lines[:top]:
        code = f"  {row.source.code}" if row.source and row.source.code else ""
        label = short_label(row.label, model_dir(cfg.model))
        lines.append(f"  {format_bytes(row.bytes_at_peak):>12} {format_bytes(row.saved_bytes):>12}  {label}{code}")
    lines += ["", "layers at the peak (identical layers grouped):", f"  {'at peak':>12} {'saved':>12}  layer"]
    for label, row in group_layers(result.at_peak.layers):
        lines.append(f"  {format_bytes(row.bytes_at_peak):>12} {format_bytes(row.saved_bytes):>12}  {label}")
    lines += ["", f"FLOPs: step {format_flops(result.step_flops)}, recomputed {format_flops(result.recompute_flops)}"
              + _unknown_note(result)]
    lines += ["", "not modelled: " + policy_named(parse_policy_label(policy)[0]).not_modelled]
    return "\n".join(lines) + "\n"


def _bill_detail(result: PolicyAnalysis, category: str) -> str:
    """What a bill line holds that the reader must know: the frozen part of the parameters."""
    if category == "parameter":
        frozen = frozen_parameter_bytes(result.graph)
        return f"  (frozen {format_bytes(frozen)})" if frozen else ""
    return ""


def _table_notes(analysis: Analysis) -> list[str]:
    """The capture's notes once, then each policy's own notes under its label."""
    common = analysis.graph.config.notes
    lines = [f"note: {n}" for n in common]
    for label, result in analysis.policies.items():
        lines += [f"note ({label}): {n}" for n in result.graph.config.notes if n not in common]
    return lines


def render_policy_table(analysis: Analysis) -> str:
    eager = analysis.policies.get("eager")
    cfg = analysis.graph.config
    device = all(r.device is not None for r in analysis.policies.values())
    rank = all(r.rank_device is not None for r in analysis.policies.values())
    lines = [f"tracer: {cfg.model}  on {cfg.target}  batch {cfg.batch}{_micro_batches(cfg)}  {cfg.size_words}  {cfg.precision}  optimizer "
             f"{cfg.optimizer}  {cfg.step} step  (capture: {cfg.capture_path})", *_table_notes(analysis), "",
             f"  {'policy':<16} {'peak':>12} {'phase':<9} {'saved act.':>12} {'vs eager':>9} "
             f"{'recompute':>11} {'step':>11} {'overhead':>8}"
             + (f" {'allocated':>12} {'reserved':>12}" if device else "")
             + (" (rank 0)" if device and rank else "")]
    for label, result in analysis.policies.items():
        saving = (f"{100.0 * (result.peak_bytes - eager.peak_bytes) / eager.peak_bytes:+8.1f}%"
                  if eager is not None else f"{'':>9}")
        base = result.step_flops - result.recompute_flops
        overhead = 100.0 * result.recompute_flops / base if base else 0.0
        lines.append(f"  {label:<16} {format_bytes(result.peak_bytes):>12} {result.peak_phase:<9} "
                     f"{format_bytes(result.saved.activation_bytes):>12} {saving} "
                     f"{format_flops(result.recompute_flops):>11} {format_flops(result.step_flops):>11} "
                     f"{overhead:7.1f}%" + (_device_columns(result.rank_device if rank else result.device)
                                            if device else ""))
    unknown = {t for r in analysis.policies.values() for t, _ in r.flops.unknown_ops}
    if unknown:
        lines.append(f"\nops without a FLOP formula (not counted): {', '.join(sorted(unknown))}")
    names = dict.fromkeys(parse_policy_label(label)[0] for label in analysis.policies)
    lines += ["", "not modelled:"] + [f"  {name}: {policy_named(name).not_modelled}" for name in names]
    return "\n".join(lines) + "\n"


def _device_lines(result: PolicyAnalysis, target: str) -> list[str]:
    """The device view of a CUDA step: requested, allocated and reserved peaks and what fits; under
    sharding rank 0's view first (the one checked against the device memory), then the whole model's."""
    from tracer.reports.compare_text import render_device_memory
    views = [v for v in (result.rank_device, result.device) if v is not None]
    lines = []
    for view in views:
        lines += ["", *render_device_memory(view, target=target).rstrip("\n").split("\n")]
    if result.sharded is not None and result.rank_device is None:
        s = result.sharded
        lines += ["", f"per rank ({s.strategy}, rank 0 of {s.world_size}): peak {format_bytes(s.peak_bytes)} "
                      f"({s.peak_bytes:,} B) in {s.peak_phase}"]
    return lines


def _device_columns(device) -> str:
    mark = " OOM" if device.oom is not None else ""
    return f" {format_bytes(device.allocated_peak_bytes):>12} {format_bytes(device.reserved_peak_bytes):>12}{mark}"


def _unknown_note(result: PolicyAnalysis) -> str:
    if not result.flops.unknown_ops:
        return ""
    return f"; {result.flops.unknown_op_count} ops without a formula (not counted): " + ", ".join(
        f"{t} x{n}" for t, n in result.flops.unknown_ops)


def group_layers(layers: tuple[LayerBytes, ...]) -> list[tuple[str, LayerBytes]]:
    """Consecutive `prefix.N` layers with identical bytes become one row `prefix.A-B x n` (bytes per layer)."""
    out: list[tuple[str, LayerBytes]] = []
    i = 0
    rows = list(layers)
    while i < len(rows):
        match = re.fullmatch(r"(.*)\.(\d+)", rows[i].layer)
        j = i + 1
        if match:
            prefix, first = match.group(1), int(match.group(2))
            while j < len(rows):
                m = re.fullmatch(r"(.*)\.(\d+)", rows[j].layer)
                same = (rows[j].bytes_at_peak, rows[j].saved_bytes) == (rows[i].bytes_at_peak, rows[i].saved_bytes)
                if not (m and m.group(1) == prefix and int(m.group(2)) == first + (j - i) and same):
                    break
                j += 1
        if j - i > 1:
            out.append((f"{prefix}.{first}-{first + j - i - 1} x{j - i} (each)", rows[i]))
        else:
            out.append((rows[i].layer, rows[i]))
        i = j
    return out


def _host_lines(result: PolicyAnalysis) -> list[str]:
    """--offload: what the host holds (not in the device bill above)."""
    host = result.host
    if host is None:
        return []
    held = [f"{kind} {format_bytes(nbytes)}" for kind, nbytes in host.resident_bytes.items() if nbytes]
    if host.saved_bytes:
        held.append(f"saved tensors {format_bytes(host.saved_bytes)} in all (each from its save until its node "
                    "runs in backward)")
    temporaries = " with the optimizer step's temporaries" if any(host.resident_bytes.values()) else ""
    return [f"  in host memory (offloaded, not counted above): {', '.join(held)}; host peak "
            f"{format_bytes(host.peak_bytes)}{temporaries}"]


def _micro_batches(cfg) -> str:
    return f" x {cfg.accumulate} micro-batches" if cfg.accumulate > 1 else ""


def _where(source, here: str | None = None) -> str:
    return f"({short_label(f'{source.file}:{source.line}', here)}: {source.code})" if source else ""


