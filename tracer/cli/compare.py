"""Command-line flags for a CUDA target and for comparing with a real snapshot, for tracer.cli.analyze.

    add_target_arguments(parser)          --alloc-conf CONF (--target and --gpu: tracer.checks.options)
                                          --cublas-workspace-config CONF  --cudnn-workspace-cap SIZE
                                          --compare PATH  --tolerance T
                                          --compare-json PATH
    run_target_outputs(args, analysis, policy, write=sys.stdout.write) -> int
        with --compare: the comparison of the policy's device view (tracer.pipeline computes it for a CUDA
        target; a cpu prediction is compared without device extras) with the snapshot. Returns the exit code: ExitCode.BUDGET_EXCEEDED (1) when the
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
    parser = parser.add_argument_group("CUDA target and comparison with a real snapshot")
    parser.add_argument("--alloc-conf", metavar="CONF", default="",
                        help="PYTORCH_CUDA_ALLOC_CONF for the caching-allocator model, e.g. expandable_segments:True")
    parser.add_argument("--cublas-workspace-config", metavar="CONF", default=None,
                        help="CUBLAS_WORKSPACE_CONFIG of the run, e.g. :4096:8 (default: PyTorch's for the GPU)")
    parser.add_argument("--cudnn-workspace-cap", metavar="SIZE", default=None,
                        help="the run's cap on cuDNN convolution workspaces (CUDNN_CONV_WSCAP_DBG, e.g. 256MiB): "
                             "counted at every convolution call, an upper bound (default: not counted, noted)")
    parser.add_argument("--cuda-context", metavar="SIZE", default=None,
                        help="device memory the CUDA context takes before the step (default 512MiB; the step must "
                             "fit in the device's reported total, or --device-memory, less this)")
    parser.add_argument("--nccl-memory", metavar="SIZE", default=None,
                        help="device memory one NCCL communicator's buffers take, for each one a rank holds: one "
                             "under --shard over more than one rank, one more under --tp, one under --pp "
                             "(default: 1.06GB on H100, H200 and B200, 688MB on other GPUs, from published "
                             "measurements; the step must fit in what is left)")
    parser.add_argument("--compare", metavar="PATH",
                        help="compare the prediction with a real snapshot (torch.cuda.memory._dump_snapshot pickle); "
                             "exit 1 beyond --tolerance")
    parser.add_argument("--tolerance", default=None,
                        help="--compare: allowed error of the peak, phase peaks and bytes before the step, "
                             "as 2%% or 0.02 (default 2%%)")
    parser.add_argument("--compare-json", metavar="PATH", help="--compare: write the comparison as JSON")


def check_target_flags(args) -> None:
    """Before the analysis: --tolerance and --compare-json need --compare, and --tolerance must read."""
    from tracer.checks.baseline import parse_tolerance

    for flag, value in (("--tolerance", args.tolerance), ("--compare-json", args.compare_json)):
        if value is not None and not args.compare:
            raise UsageError(f"{flag} needs --compare", hint="--compare SNAPSHOT.pickle")
    try:
        parse_tolerance(_tolerance(args))
    except ValueError as exc:
        raise UsageError(f"--tolerance: {exc}") from exc
    if args.compare and not os.path.isfile(args.compare):
        raise UsageError(f"snapshot file not found: {args.compare}")


def _tolerance(args) -> str:
    return "2%" if args.tolerance is None else args.tolerance


def run_target_outputs(args, analysis, policy: str, write=sys.stdout.write) -> int:
    from tracer.checks.baseline import parse_tolerance
    from tracer.reports.compare_text import render_comparison
    from tracer.reports.policy_view import policy_result

    result = policy_result(analysis, policy)
    device = getattr(result, "device", None)
    if device is None and not args.compare:
        return int(ExitCode.OK)
    try:
        tolerance = parse_tolerance(_tolerance(args))
    except ValueError as exc:
        raise UsageError(f"--tolerance: {exc}") from exc
    if device is None:                    # a cpu prediction compared with a snapshot: no device extras
        from tracer.passes.device import predict_device_memory
        device = predict_device_memory(result)
    if not args.compare:
        return int(ExitCode.OK)           # the device view is part of the report (reports/text.py)
    comparison = compare(result, device, args.compare, tolerance=tolerance, top=getattr(args, "top", 10))
    write("\n" + render_comparison(comparison))
    if args.compare_json:
        from tracer.reports.compare_text import comparison_json
        from tracer.outputs import write_output
        write_output(args.compare_json, json.dumps(comparison_json(comparison), indent=2), what="--compare-json")
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
