"""Compiled step: the tracer's `compiled` prediction vs torch.profiler's measurement of a real
torch.compile (Inductor) training step on CPU, in the same run.

    python benchmarks/compiled_vs_profiler.py [--model llama-debug] [--batch 2] [--seq 256]

The real step: forward+loss, backward, foreach AdamW step, zero_grad, after two warm-up steps (compiled
code and optimizer state exist). The profiler's allocator events give bytes allocated since profiling
started; adding the bytes live before the step (parameters, optimizer state, inputs) gives the absolute
bytes, and record_function ranges split them into the three phases. Inductor fuses pointwise ops, which the prediction does not model, so the prediction is expected
to be an upper bound; the script prints the error.
"""
from __future__ import annotations

import argparse
import time

import torch


PHASES = ("forward", "backward", "optimizer")


def measured_compiled_peaks(model_name: str, batch: int, seq: int) -> dict[str, int]:
    """Peak bytes per phase of the real compiled step (record_function ranges name the phases)."""
    from torch.profiler import record_function

    from tracer.capture import load_model_source

    source = load_model_source(model_name)
    torch.manual_seed(0)
    model = source.build_model()
    tokens = source.example_batch(batch, seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    compiled = torch.compile(model, dynamic=False)
    for _ in range(2):
        loss = compiled(*tokens)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        del loss
    before = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
              for t in [*model.parameters(), *tokens,
                        *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        with record_function("phase:forward"):
            loss = compiled(*tokens)
        with record_function("phase:backward"):
            loss.backward()
        with record_function("phase:optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
    events = list(prof.profiler.kineto_results.events())
    ranges = {e.name().removeprefix("phase:"): (e.start_ns(), e.start_ns() + e.duration_ns())
              for e in events if e.name().startswith("phase:")}
    live, peaks = sum(before.values()), dict.fromkeys(PHASES, 0)
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        phase = next((name for name, (a, b) in ranges.items() if a <= start <= b), None)
        if phase is not None:
            peaks[phase] = max(peaks[phase], live)
    return peaks


def predicted_compiled_peaks(model_name: str, batch: int, seq: int) -> dict[str, int]:
    from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
    from tracer.passes.analysis import analyze_graphs

    graphs = capture_steps(load_model_source(model_name), CaptureOptions(batch=batch, seq=seq),
                           (PolicySpec(name="compiled"),))
    phases = analyze_graphs(graphs).policies["compiled"].phases
    return {name: phases[name].peak_bytes for name in PHASES}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llama-debug")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    t0 = time.perf_counter()
    predicted = predicted_compiled_peaks(args.model, args.batch, args.seq)
    t1 = time.perf_counter()
    measured = measured_compiled_peaks(args.model, args.batch, args.seq)
    t2 = time.perf_counter()
    print(f"{args.model} batch {args.batch} seq {args.seq}, compiled step (Inductor, CPU), foreach AdamW "
          f"(predicted in {t1 - t0:.1f} s, measured in {t2 - t1:.1f} s incl. compile)")
    print(f"  {'phase':<10} {'predicted B':>15} {'profiler B':>15} {'error':>8}")
    for name in (*PHASES, "step"):
        p = max(predicted.values()) if name == "step" else predicted[name]
        m = max(measured.values()) if name == "step" else measured[name]
        print(f"  {name:<10} {p:>15,} {m:>15,} {100.0 * (p - m) / m:+7.2f}%")

if __name__ == "__main__":
    main()
