"""Compiled step: the tracer's `compiled` prediction vs torch.profiler's measurement of a real
torch.compile (Inductor) training step on CPU, per model and compile style, in one run.

    python benchmarks/compiled_vs_profiler.py [--models llama-debug,gpt2-debug,...] [--batch 2] [--seq 256]
                                              [--styles whole,blocks] [--accumulate N]

Models: the zoo's llama-debug and gpt2-debug, small transformers Llama and BERT configs (`hf:llama`,
`hf:bert`, see HF_CONFIGS) and the hand-written MLP of examples/tiny_mlp_lm.py. Compile styles: `whole`
is `torch.compile(model)`; `blocks` is `block.compile()` on every repeated block (`layers.0`, `h.1`, ...),
the rest of the model eager (models without repeated blocks are skipped); `whole+full` and
`whole+selective` are `torch.compile(model)` with every repeated block's forward in
`torch.utils.checkpoint` (non-reentrant; selective: tracer's default save policy as torch's policy_fn);
`blocks+full` and `blocks+selective` checkpoint each block the same way and then `block.compile()` it, so
the checkpoint runs inside the compiled block (torchtitan's order). Predicted by the `compiled`,
`compiled-blocks`, `compiled+full`, `compiled+selective`, `compiled-blocks+full` and
`compiled-blocks+selective` policies.

The real step: forward+loss, backward, AdamW step (torch's CPU default, the per-parameter loop),
zero_grad, after two warm-up steps (compiled
code and optimizer state exist). The profiler's allocator events give bytes allocated since profiling
started; adding the bytes live before the step (parameters, optimizer state, inputs) gives the absolute
bytes, and record_function ranges split them into the three phases. Inductor's caches are off, so every
run compiles (the measured memory does not depend on them).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import time

import torch

PHASES = ("forward", "backward", "optimizer")
HF_CONFIGS = {
    "hf:bert": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                "vocab_size=512", "hidden_dropout_prob=0", "attention_probs_dropout_prob=0"),
    "hf:llama": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                 "num_key_value_heads=2", "vocab_size=512"),
}
MLP_FILE = os.path.join(os.path.dirname(__file__), "..", "examples", "tiny_mlp_lm.py")
DEFAULT_MODELS = ("llama-debug", "gpt2-debug", "hf:llama", "hf:bert", MLP_FILE)
STYLES = ("whole", "blocks", "whole+full", "whole+selective", "blocks+full", "blocks+selective")
CHECKPOINTED = {"whole+full": "full", "whole+selective": "selective",       # style -> how blocks are checkpointed
                "blocks+full": "full", "blocks+selective": "selective"}


def _selective_contexts():
    """torch's selective-checkpointing contexts asking tracer's default save predicate (fresh per region)."""
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    from tracer.policies import PolicySpec, save_predicate

    keep = save_predicate(PolicySpec(name="selective"))

    def policy(ctx, op, *args, **kwargs):
        return CheckpointPolicy.MUST_SAVE if keep(str(op)) else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


def checkpoint_blocks(model, how: str) -> bool:
    """Every repeated block's forward wrapped in non-reentrant torch.utils.checkpoint (`how`: full, or
    selective with tracer's default save predicate asked as torch's policy_fn); False without blocks."""
    import functools

    from torch.utils.checkpoint import checkpoint

    blocks = block_paths(model)
    for path in blocks:
        block = model.get_submodule(path)
        extra = {"context_fn": _selective_contexts} if how == "selective" else {}
        block.forward = functools.partial(checkpoint, block.forward, use_reentrant=False, **extra)
    return bool(blocks)


def compile_checkpointed_blocks(model, how: str) -> bool:
    """torchtitan's order: every repeated block wrapped by `checkpoint_wrapper` (non-reentrant; selective
    as in `checkpoint_blocks`), then the wrapper compiled on its own and put in the block's place; False
    without blocks. (A block whose forward is replaced by a partial of checkpoint is not traced by Dynamo
    when the block itself is compiled: the step would silently run eager.)"""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    blocks = block_paths(model)
    for path in blocks:
        parent, _, name = path.rpartition(".")
        extra = {"context_fn": _selective_contexts} if how == "selective" else {}
        wrapped = checkpoint_wrapper(model.get_submodule(path), **extra)
        wrapped.compile(dynamic=False)
        model.get_submodule(parent).register_module(name, wrapped)
    return bool(blocks)


def model_source(name: str):
    from tracer.capture import load_model_source
    return load_model_source(name, hf_config=HF_CONFIGS.get(name, ()))


def block_paths(model) -> list[str]:
    """The repeated blocks (`layers.0`, `layers.1`, ...), by tracer's rule (passes.blocks)."""
    from tracer.passes.blocks import most_frequent_blocks
    return most_frequent_blocks(name for name, _ in model.named_modules())


def phase_names(accumulate: int) -> tuple[str, ...]:
    """The step's phases as tracer names them: one forward and backward per micro-batch."""
    if accumulate == 1:
        return PHASES
    return tuple(f"{p} (micro-batch {i})" for i in range(1, accumulate + 1) for p in PHASES[:2]) + ("optimizer",)


def measured_compiled_peaks(name: str, batch: int, seq: int, style: str, accumulate: int = 1) -> dict[str, int] | None:
    """Peak bytes per phase of the real compiled step (record_function ranges name the phases), with
    `accumulate` micro-batches (each `loss = run(*batch)` then `loss.backward()`, the loss rebound by the
    next one, as a training loop writes it); None when the style does not apply (no repeated blocks)."""
    from torch.profiler import record_function

    source = model_source(name)
    torch.manual_seed(0)
    model = source.build_model()
    batches = [source.example_batch(batch, seq) for _ in range(accumulate)]
    tokens = batches[0]
    # the model file's optimizer, else AdamW at torch's CPU default (the loop), as --target cpu predicts
    opt = (source.make_optimizer(model.parameters()) if source.make_optimizer is not None
           else torch.optim.AdamW(model.parameters(), lr=1e-3))
    torch._dynamo.reset()
    if style.startswith("whole+") and not checkpoint_blocks(model, CHECKPOINTED[style]):
        return None
    if style.startswith("whole"):
        run = torch.compile(model, dynamic=False)
    elif style.startswith("blocks+"):
        if not compile_checkpointed_blocks(model, CHECKPOINTED[style]):
            return None
        run = model
    else:
        blocks = block_paths(model)
        if not blocks:
            return None
        for path in blocks:
            model.get_submodule(path).compile(dynamic=False)
        run = model
    names = phase_names(accumulate)

    def step(ranged):
        loss = None
        for i, micro_batch in enumerate(batches):
            with (record_function(f"phase:{names[2 * i]}") if ranged else contextlib.nullcontext()):
                loss = run(*micro_batch)
            with (record_function(f"phase:{names[2 * i + 1]}") if ranged else contextlib.nullcontext()):
                loss.backward()
        with (record_function("phase:optimizer") if ranged else contextlib.nullcontext()):
            opt.step()
            opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step(ranged=False)
    before = {t.untyped_storage()._cdata: t.untyped_storage().nbytes()
              for t in [*model.parameters(), *model.buffers(), *(t for b in batches for t in b),
                        *(v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor))]}
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step(ranged=True)
    events = list(prof.profiler.kineto_results.events())
    ranges = {e.name().removeprefix("phase:"): (e.start_ns(), e.start_ns() + e.duration_ns())
              for e in events if e.name().startswith("phase:")}
    live, peaks = sum(before.values()), dict.fromkeys(names, 0)
    for start, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        live += nbytes
        phase = next((name for name, (a, b) in ranges.items() if a <= start <= b), None)
        if phase is not None:
            peaks[phase] = max(peaks[phase], live)
    torch._dynamo.reset()
    return peaks


def predicted_compiled_peaks(name: str, batch: int, seq: int, style: str, accumulate: int = 1) -> dict[str, int] | None:
    """The peak per phase of the policy that predicts the style: `compiled` (whole), `compiled-blocks`
    (blocks), `compiled+full` / `compiled+selective`; None for a model without repeated blocks (blocks)."""
    from tracer.capture import CaptureOptions, PolicySpec, capture_steps
    from tracer.passes.analysis import analyze_graphs

    if style.startswith("blocks"):
        torch.manual_seed(0)
        if not block_paths(model_source(name).build_model()):
            return None
    policy = {"whole": "compiled", "blocks": "compiled-blocks"}.get(style) or \
        f"{'compiled' if style.startswith('whole') else 'compiled-blocks'}+{CHECKPOINTED[style]}"
    graphs = capture_steps(model_source(name), CaptureOptions(batch=batch, seq=seq, target="cpu",
                                                              accumulate=accumulate), (PolicySpec(name=policy),))
    phases = analyze_graphs(graphs).policies[policy].phases
    return {phase: phases[phase].peak_bytes for phase in phase_names(accumulate)}


def print_comparison(name: str, style: str, predicted, measured, seconds: tuple[float, float]) -> float | None:
    """Prints one table; returns the worst |error| in percent over the phases and the step (None: no prediction)."""
    label = os.path.basename(name) if name.endswith(".py") else name
    print(f"{label}, {style} compile (predicted in {seconds[0]:.1f} s, measured in {seconds[1]:.1f} s incl. compile)")
    print(f"  {'phase':<26} {'predicted B':>15} {'profiler B':>15} {'error':>8}")
    worst = None
    for phase in (*measured, "step"):
        m = max(measured.values()) if phase == "step" else measured[phase]
        if predicted is None:
            print(f"  {phase:<26} {'not predicted':>15} {m:>15,}")
            continue
        p = max(predicted.values()) if phase == "step" else predicted[phase]
        error = 100.0 * (p - m) / m
        worst = max(worst or 0.0, abs(error))
        print(f"  {phase:<26} {p:>15,} {m:>15,} {error:+7.2f}%")
    return worst


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default=",".join(DEFAULT_MODELS))
    p.add_argument("--styles", default=",".join(STYLES))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--accumulate", type=int, default=1, help="micro-batches per optimizer step (default 1)")
    args = p.parse_args()
    # Inductor's caches off for the run, put back after by torch's own config.patch
    with torch._inductor.config.patch(fx_graph_cache=False), \
            torch._functorch.config.patch(enable_autograd_cache=False):
        compare_all(args)


def compare_all(args) -> None:
    worst: list[tuple[float, str]] = []
    for name in args.models.split(","):
        for style in args.styles.split(","):
            t0 = time.perf_counter()
            predicted = predicted_compiled_peaks(name, args.batch, args.seq, style, args.accumulate)
            t1 = time.perf_counter()
            measured = measured_compiled_peaks(name, args.batch, args.seq, style, args.accumulate)
            t2 = time.perf_counter()
            if measured is None:
                print(f"{name}, {style} compile: no repeated blocks, skipped")
                continue
            error = print_comparison(name, style, predicted, measured, (t1 - t0, t2 - t1))
            if error is not None:
                worst.append((error, style, f"{name} {style}"))
    for style in args.styles.split(","):
        errors = [(error, where) for error, s, where in worst if s == style]
        if errors:
            error, where = max(errors)
            print(f"worst |error| over predicted phases, {style} compile: {error:.4f}% ({where})")


if __name__ == "__main__":
    main()
