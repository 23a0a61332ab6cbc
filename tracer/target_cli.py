"""Command-line flags for a CUDA target and for comparing with a real snapshot, for `tracer.cli` to wire in.

    add_target_arguments(parser)          --target cpu|cuda  --gpu NAME  --alloc-conf CONF
                                          --cublas-workspace-config CONF  --compare PATH  --tolerance T
                                          --compare-json PATH
    capture_target(args) -> str           the `CaptureOptions.target` value ("cpu" or "cuda:<gpu>")
    run_target_outputs(args, analysis, policy, write=sys.stdout.write) -> int
        with --target cuda: the device view (requested, allocated and reserved peaks, the cuBLAS workspaces,
        an out-of-memory report against --device-memory or the GPU's memory); with --compare: the
        comparison with the snapshot. Returns the exit code: ExitCode.BUDGET_EXCEEDED (1) when the
        comparison is beyond --tolerance, else ExitCode.OK.
Library code does not see argparse: this module only turns flags into calls of tracer.passes and
tracer.reports. Raises UsageError (exit 2) for a bad flag value or a missing snapshot file.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from tracer.errors import ExitCode, UsageError


def add_target_arguments(parser: argparse.ArgumentParser) -> None:
    from tracer.capture.target import DEFAULT_GPU, GPUS

    parser.add_argument("--target", choices=("cpu", "cuda"), default="cpu",
                        help="device the step runs on: cpu, or cuda (traced on CPU fake tensors with the CUDA SDPA "
                             "kernels and autocast lists; adds the cuBLAS workspaces; default cpu)")
    parser.add_argument("--gpu", choices=sorted(GPUS), default=None,
                        help=f"GPU for --target cuda: picks the SDPA backend rules, the cuBLAS workspace size and "
                             f"the device memory (default {DEFAULT_GPU})")
    parser.add_argument("--alloc-conf", metavar="CONF", default="",
                        help="PYTORCH_CUDA_ALLOC_CONF for the caching-allocator model, e.g. expandable_segments:True")
    parser.add_argument("--cublas-workspace-config", metavar="CONF", default=None,
                        help="CUBLAS_WORKSPACE_CONFIG of the run, e.g. :4096:8 (default: PyTorch's for the GPU)")
    parser.add_argument("--compare", metavar="PATH",
                        help="compare the prediction with a real snapshot (torch.cuda.memory._dump_snapshot pickle); "
                             "exit 1 beyond --tolerance")
    parser.add_argument("--tolerance", default="2%",
                        help="--compare: allowed error of the peak, phase peaks and bytes before the step, "
                             "as 2%% or 0.02 (default 2%%)")
    parser.add_argument("--compare-json", metavar="PATH", help="--compare: write the comparison as JSON")


def capture_target(args) -> str:
    """The CaptureOptions.target value for these flags. Raises UsageError (--gpu without --target cuda)."""
    from tracer.capture.target import parse_target
    return parse_target(args.target, getattr(args, "gpu", None)).label


def run_target_outputs(args, analysis, policy: str, write=sys.stdout.write) -> int:
    from tracer.capture.target import device_allocations, parse_target
    from tracer.checks.baseline import parse_tolerance
    from tracer.passes.allocator import parse_alloc_conf
    from tracer.passes.device import predict_device_memory
    from tracer.reports.compare_text import render_comparison, render_device_memory
    from tracer.reports.policy_view import policy_result

    target = parse_target(args.target, getattr(args, "gpu", None))
    if not target.is_cuda and not args.compare:
        return int(ExitCode.OK)
    try:
        tolerance = parse_tolerance(args.tolerance)
    except ValueError as exc:
        raise UsageError(f"--tolerance: {exc}") from exc
    config = parse_alloc_conf(args.alloc_conf)
    capacity = _capacity(args, target)
    extra = [(a.name, a.nbytes) for a in device_allocations(target, cublas_config=args.cublas_workspace_config)
             for _ in range(a.count)]
    result = policy_result(analysis, policy)
    device = predict_device_memory(result, extra=extra, config=config, capacity_bytes=capacity)
    write("\n" + render_device_memory(device, target=target.label))
    if not args.compare:
        return int(ExitCode.OK)
    comparison = compare(result, device, args.compare, tolerance=tolerance, top=getattr(args, "top", 10))
    write("\n" + render_comparison(comparison))
    if args.compare_json:
        from tracer.reports.compare_text import comparison_json
        try:
            with open(args.compare_json, "w") as f:
                json.dump(comparison_json(comparison), f, indent=2)
        except OSError as exc:
            raise UsageError(f"cannot write --compare-json {args.compare_json}: {exc.strerror}") from exc
    return int(ExitCode.OK if comparison.ok else ExitCode.BUDGET_EXCEEDED)


def compare(result, device, path: str, *, tolerance: float, top: int = 10, line_aliases=None):
    """Read the snapshot at `path` and compare; the measured allocated peak is its own stream replayed."""
    from tracer.passes.compare import compare_with_snapshot, snapshot_allocated_peak
    from tracer.snapshots import load_snapshot_dict, summarize_snapshot

    if not os.path.isfile(path):
        raise UsageError(f"snapshot file not found: {path}")
    data = load_snapshot_dict(path)
    reading = summarize_snapshot(data, source=path, top=top)
    return compare_with_snapshot(result, device, reading, measured_allocated_peak_bytes=snapshot_allocated_peak(data),
                                 tolerance=tolerance, top=top, line_aliases=line_aliases)


def _capacity(args, target) -> int | None:
    text = getattr(args, "device_memory", None)
    if text:
        from tracer.reports.units import parse_bytes
        try:
            return parse_bytes(text)
        except ValueError as exc:
            raise UsageError(f"--device-memory: {exc}") from exc
    return target.gpu.memory_bytes if target.is_cuda and getattr(args, "gpu", None) else None
