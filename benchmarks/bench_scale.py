"""Benchmark: end-to-end analysis of a large shape vs torch.export alone, in the same run.

    python benchmarks/bench_scale.py [--model llama-7b] [--seq 4096] [--batch 1]

Each measurement runs in a fresh subprocess so its peak RSS is its own. Prints wall seconds, peak RSS and
the ratio tracer / export. Goal for llama-7b at seq 4096: under 90 s and under 2 GiB RSS on 2 cores.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

_CHILD = r"""
import json, resource, sys, time
mode, model, batch, seq = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
import torch
t0 = time.perf_counter()
if mode == "tracer":
    import tracer
    analysis = tracer.analyze(model, batch=batch, seq=seq)
    extra = {"peak_bytes": analysis.policies["eager"].peak_bytes, "ops": len(analysis.graph.ops)}
else:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from tracer.capture.model_input import load_model_source
    source = load_model_source(model)
    with FakeTensorMode():
        m = source.build_model()
        args = source.example_batch(batch, seq)
    torch.export.export(m, args, strict=False)
    extra = {}
wall = time.perf_counter() - t0
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"wall_s": wall, "rss_bytes": rss, **extra}))
"""


def run(mode: str, model: str, batch: int, seq: int) -> dict:
    proc = subprocess.run([sys.executable, "-c", _CHILD, mode, model, str(batch), str(seq)],
                          capture_output=True, text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--batch", type=int, default=1)
    args = p.parse_args()
    export = run("export", args.model, args.batch, args.seq)
    full = run("tracer", args.model, args.batch, args.seq)
    gib = 2**30
    print(f"{args.model} batch {args.batch} seq {args.seq}")
    print(f"  torch.export alone : {export['wall_s']:7.1f} s   peak RSS {export['rss_bytes'] / gib:5.2f} GiB")
    print(f"  tracer end to end  : {full['wall_s']:7.1f} s   peak RSS {full['rss_bytes'] / gib:5.2f} GiB"
          f"   ({full['ops']} ops, predicted peak {full['peak_bytes'] / gib:.2f} GiB)")
    print(f"  ratio tracer/export: {full['wall_s'] / export['wall_s']:.2f}x time, "
          f"{full['rss_bytes'] / export['rss_bytes']:.2f}x RSS")


if __name__ == "__main__":
    main()
