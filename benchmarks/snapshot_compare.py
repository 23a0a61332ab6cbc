"""Predict the two shared CUDA snapshot workloads with benchmarks/cs336_model.py and compare.

    python benchmarks/snapshot_compare.py [--snapshots ../shared/snapshots] [--gpu a100] [--top 12]

Workloads (shared/snapshots/README.md): CS336 "medium", batch 4, steady step with the course AdamW;
context 128 fp32, and context 512 with bf16 autocast around forward + loss. Both are predicted with
`--target cuda`. The GPU model was not recorded; its two cuBLAS workspaces are 8,519,680 B each, PyTorch's
default below sm90, so an sm80 part (a100) is assumed: the SDPA rules do not matter here (the model
writes attention out by hand).

Lines: the snapshots' frames name the original repository's files (model.py, nn_utils.py, optimizer.py);
our rewrite has other line numbers, so each of our lines is mapped to the original line it re-implements
(`ORIGINAL_LINES`, read off the snapshots' frames: same op sequence and sizes). Prints, per workload,
predicted vs measured (peak, phase peaks, bytes before the step, allocated and reserved peaks, bytes by
the phase that allocated them, the lines that differ most), then a summary. Exit 1 if a peak is beyond 2%.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
MODEL = os.path.join(HERE, "cs336_model.py")
WORKLOADS = (("cs336-medium-ctx128-fp32-train-step.pickle", 128, "fp32"),
             ("cs336-medium-ctx512-bf16-train-step.pickle", 512, "bf16"))

# a fragment of one of our lines -> the original line (file:line) it re-implements
ORIGINAL_LINES = {
    'return torch.einsum("...i,oi->...o"': "model.py:39",
    "return self.weight[token_ids]": "model.py:54",
    "inv_rms = torch.rsqrt(": "model.py:101",
    "x = x * inv_rms": "model.py:102",
    "x = x * self.weight": "model.py:104",
    "return x.to(in_dtype)": "model.py:104",
    "out_even = x_even * cos": "model.py:147",
    "out_odd = x_even * sin": "model.py:148",
    "return torch.stack((out_even, out_odd)": "model.py:150",
    "scores = torch.einsum(": "model.py:427",
    "scores = torch.where(": "model.py:430",
    'return torch.einsum("...qk,...kd->...qd"': "model.py:434",
    "positions = torch.arange(": "model.py:513",
    "causal = positions[": "model.py:516",
    "out = out.transpose(1, 2).reshape(": "model.py:524",
    "return x * torch.sigmoid(x)": "model.py:532",
    "return self.w2(silu(": "model.py:399",
    "x = x + attn_out": "model.py:383",
    "return x + ffn_out": "model.py:387",
    "x = x - x.max(dim=dim": "nn_utils.py:5",
    "e = torch.exp(x)": "nn_utils.py:6",
    "return e / e.sum(": "nn_utils.py:7",
    "m = x.max(dim=dim": "nn_utils.py:11",
    "x = x - m": "nn_utils.py:12",
    "return x - torch.log(": "nn_utils.py:13",
    "neg_log_probs = -log_softmax(": "nn_utils.py:17",
    "return torch.gather(": "nn_utils.py:18",
    "p.data -= lr * weight_decay": "optimizer.py:71",
    'm = state.get("m"': "optimizer.py:73",
    'v = state.get("v"': "optimizer.py:74",
    'state["m"] = beta1': "optimizer.py:76",
    'state["v"] = beta2': "optimizer.py:77",
    'p.data -= lr_t *': "optimizer.py:80",
}


def line_aliases(model_path: str = MODEL) -> dict[str, str]:
    """"cs336_model.py:<n>" -> the original "file:line", found by the fragments in ORIGINAL_LINES."""
    base = os.path.basename(model_path)
    out = {}
    with open(model_path) as f:
        for number, text in enumerate(f, start=1):
            for fragment, original in ORIGINAL_LINES.items():
                if fragment in text:
                    out[f"{base}:{number}"] = original
    missing = set(ORIGINAL_LINES.values()) - set(out.values())
    if missing:
        raise SystemExit(f"{model_path}: no line re-implements {sorted(missing)}; update ORIGINAL_LINES")
    return out


def predict(seq: int, precision: str, gpu: str):
    from tracer.capture import CaptureOptions, capture_steps, load_model_source
    from tracer.capture.target import device_allocations, parse_target
    from tracer.passes.analysis import analyze_graphs
    from tracer.passes.device import predict_device_memory
    from tracer.policies import PolicySpec

    target = parse_target("cuda", gpu)
    options = CaptureOptions(batch=4, seq=seq, precision=precision, target=target.label)
    graphs = capture_steps(load_model_source(MODEL), options, (PolicySpec(name="eager"),))
    result = analyze_graphs(graphs).policies["eager"]
    extra = [(a.name, a.nbytes) for a in device_allocations(target) for _ in range(a.count)]
    return result, predict_device_memory(result, extra=extra)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--snapshots", default=os.path.join(HERE, "..", "..", "shared", "snapshots"))
    p.add_argument("--gpu", default="a100")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--tolerance", type=float, default=0.02)
    args = p.parse_args(argv)

    from tracer.reports.compare_text import render_comparison
    from tracer.reports.units import format_bytes
    from tracer.cli.compare import compare

    aliases = line_aliases()
    summary = []
    for name, seq, precision in WORKLOADS:
        path = os.path.join(args.snapshots, name)
        if not os.path.isfile(path):
            print(f"skipped {name}: not found under {args.snapshots}")
            continue
        start = time.monotonic()
        result, device = predict(seq, precision, args.gpu)
        cmp = compare(result, device, path, tolerance=args.tolerance, top=args.top, line_aliases=aliases)
        print(f"=== context {seq}, {precision}: predicted in {time.monotonic() - start:.0f} s")
        print(render_comparison(cmp))
        summary.append((f"ctx{seq} {precision}", cmp))
    print("summary (error = predicted - measured, % of measured)")
    print(f"  {'workload':<14} {'peak':>22} {'phase':>20} {'phases (f/b/o)':>26} {'allocated':>9} {'reserved':>9}")
    for label, c in summary:
        phases = "/".join(f"{q.error_fraction * 100:+.2f}" for q in c.phases)
        alloc = f"{c.allocated.error_fraction * 100:+.2f}%" if c.allocated else "n/a"
        phase = c.predicted_peak_phase + ("" if c.same_peak_phase else f" (measured {c.measured_peak_phase})")
        print(f"  {label:<14} {format_bytes(c.peak.predicted_bytes):>10} {c.peak.error_fraction * 100:+.2f}%   "
              f"{phase:>18} "
              f"{phases:>26} {alloc:>9} {c.reserved.error_fraction * 100:+.2f}%")
    return 0 if all(c.peak.within(args.tolerance) for _, c in summary) else 1


if __name__ == "__main__":
    sys.exit(main())
