"""GPU validation: predicted vs measured memory of real CUDA training steps over a matrix of zoo configs.

    python benchmarks/gpu_validate.py [--models llama-debug,gpt2-debug] [--cnns examples/resnet50.py,...]
                                      [--batch 2] [--seq 256] [--image 224] [--cudnn-workspace-cap SIZE] [--out DIR]
    python benchmarks/gpu_validate.py --smoke      # no GPU needed: prediction side and report on tiny configs

Matrix, per language model: {fp32, bf16 autocast} x {eager, torch.compile(model), block.compile() per
block} x {no checkpointing, every block checkpointed}, and fp16 autocast with torch.amp.GradScaler (eager,
with and without checkpointing; scaler.scale(loss).backward(), scaler.step, update); per CNN (ResNet-50
and VGG-16 model files in examples/, images of side --image): eager in fp32 and bf16. Checkpointed rows
exercise autocast's weight-cast cache (bf16, fp16), Inductor's partition of checkpointed blocks
(compiled: policy compiled+full) and torchtitan's checkpoint-then-compile order (blocks: each block in
checkpoint_wrapper, then compiled on its own; policy compiled-blocks+full). Each config is predicted with
`--target cuda` (the GPU found, mapped to tracer's table by compute capability), then run for real:
model, batch and foreach AdamW on the GPU, two warm-up steps, `reset_peak_memory_stats()`,
`_record_memory_history(max_entries=1_000_000)`, one step (forward + loss under autocast, backward,
optimizer step, zero_grad(set_to_none=True)), `_snapshot()` and `memory_stats()`. Blocks (the items of
every nn.ModuleList) are wrapped in non-reentrant `torch.utils.checkpoint` for the checkpointed rows.
CNN rows are predicted without cuDNN's workspaces (a lower bound) unless --cudnn-workspace-cap gives the
run's CUDNN_CONV_WSCAP_DBG (then also set it in the environment of the run: an upper bound). FSDP2 is not
in the matrix (it needs a process group; tests/accuracy/test_fsdp.py runs it on CPU with gloo). Per config it prints the peak
(requested bytes, from the snapshot), its phase, per-phase peaks, allocated peak
(`allocated_bytes.all.peak`, rounded blocks) and reserved peak (`reserved_bytes.all.peak`), predicted vs
measured; `--out DIR` keeps each snapshot pickle and a JSON of every comparison.

--smoke runs on CPU: every row's prediction, and as the "measured" side the prediction's own snapshot
(tracer.reports.memviz) read back by the snapshot reader, so every error must be 0; it also builds each
real model with its checkpoint wrappers and runs one eager step on CPU. It checks the script, not the GPU.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import pickle
import sys
import time

import torch


@dataclasses.dataclass(frozen=True)
class Config:
    model: str
    batch: int
    seq: int
    precision: str               # fp32 | bf16 | fp16 (autocast + GradScaler)
    mode: str                    # eager | compiled (torch.compile(model)) | blocks (block.compile() per block)
    checkpoint: bool

    @property
    def policy(self) -> str:
        return POLICY_OF[self.mode, self.checkpoint]

    @property
    def label(self) -> str:
        ckpt = " +ckpt" if self.checkpoint else ""
        name = os.path.splitext(os.path.basename(self.model))[0] if self.model.endswith(".py") else self.model
        return f"{name} b{self.batch} s{self.seq} {self.precision} {self.mode}{ckpt}"


POLICY_OF = {("eager", False): "eager", ("eager", True): "full", ("compiled", False): "compiled",
             ("compiled", True): "compiled+full", ("blocks", False): "compiled-blocks",
             ("blocks", True): "compiled-blocks+full"}


def matrix(models: list[str], batch: int, seq: int, cnns: list[str] = (), image: int = 224) -> list[Config]:
    return [Config(m, batch, seq, p, mode, ckpt) for m in models for p in ("fp32", "bf16")
            for mode in ("eager", "compiled", "blocks") for ckpt in (False, True)] + \
        [Config(m, batch, seq, "fp16", "eager", ckpt) for m in models for ckpt in (False, True)] + \
        [Config(m, batch, image, p, "eager", False) for m in cnns for p in ("fp32", "bf16")]


# ---------------------------------------------------------------------------------------------- prediction

def predict(configs: list[Config], gpu: str, *, device_extras: bool = True,
            cudnn_workspace_cap: int | None = None) -> dict[Config, tuple]:
    """Config -> (Analysis, PolicyAnalysis, DeviceMemory); one capture per (model, batch, seq, precision).
    `device_extras`: add the cuBLAS workspaces (off in smoke mode, whose "snapshot" is the graph's own);
    `cudnn_workspace_cap`: the run's cap on every cuDNN convolution workspace (None: left out)."""
    from tracer.capture import CaptureOptions, capture_steps, load_model_source
    from tracer.capture.target import device_allocations, parse_target
    from tracer.passes.analysis import analyze_graphs
    from tracer.passes.device import predict_device_memory
    from tracer.policies import PolicySpec

    target = parse_target("cuda", gpu)
    extra = [(a.name, a.nbytes) for a in device_allocations(target) for _ in range(a.count)] if device_extras else []
    out = {}
    groups: dict[tuple, list[Config]] = {}
    for cfg in configs:
        groups.setdefault((cfg.model, cfg.batch, cfg.seq, cfg.precision), []).append(cfg)
    for (model, batch, seq, precision), members in groups.items():
        specs = tuple(PolicySpec(name=name) for name in dict.fromkeys(c.policy for c in members))
        options = CaptureOptions(batch=batch, seq=seq, precision=precision, target=target.label)
        analysis = analyze_graphs(capture_steps(load_model_source(model), options, specs))
        for cfg in members:
            result = analysis.policies[cfg.policy]
            out[cfg] = (analysis, result, predict_device_memory(result, extra=extra,
                                                                conv_workspace_cap_bytes=cudnn_workspace_cap))
    return out


# ---------------------------------------------------------------------------------------------- real step

class Checkpointed(torch.nn.Module):
    def __init__(self, block: torch.nn.Module):
        super().__init__()
        self.block = block

    def forward(self, *args, **kwargs):
        from torch.utils.checkpoint import checkpoint
        return checkpoint(self.block, *args, use_reentrant=False, **kwargs)


def wrap_blocks(model: torch.nn.Module) -> int:
    """Wrap every item of every nn.ModuleList in non-reentrant checkpoint; returns how many."""
    count = 0
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for i, block in enumerate(module):
                module[i] = Checkpointed(block)
                count += 1
    return count


def compile_blocks(model: torch.nn.Module, *, checkpointed: bool) -> int:
    """block.compile() on every item of every nn.ModuleList, each first wrapped by checkpoint_wrapper when
    `checkpointed` (torchtitan's order); returns how many."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    count = 0
    for module in list(model.modules()):
        if isinstance(module, torch.nn.ModuleList):
            for i, block in enumerate(module):
                block = checkpoint_wrapper(block) if checkpointed else block
                block.compile(dynamic=False)
                module[i] = block
                count += 1
    return count


def build_real_step(cfg: Config, device: str):
    """(step function, model) for a real run of `cfg` on `device`."""
    from tracer.capture import load_model_source

    torch.manual_seed(0)
    source = load_model_source(cfg.model)
    model = source.build_model().to(device)
    batch = tuple(t.to(device) for t in source.example_batch(cfg.batch, cfg.seq))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    if cfg.mode == "blocks":
        if not compile_blocks(model, checkpointed=cfg.checkpoint):
            raise SystemExit(f"{cfg.model}: no nn.ModuleList of blocks to compile")
    elif cfg.checkpoint and not wrap_blocks(model):
        raise SystemExit(f"{cfg.model}: no nn.ModuleList of blocks to checkpoint")
    fn = torch.compile(model, dynamic=False) if cfg.mode == "compiled" else model
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision)
    autocast = (lambda: torch.autocast(device, dtype=dtype)) if dtype is not None else contextlib.nullcontext
    scaler = torch.amp.GradScaler(device) if cfg.precision == "fp16" else None

    def step():
        with autocast():
            loss = fn(*batch)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)

    return step, model


def measure_cuda(cfg: Config, warmup: int = 2) -> tuple[dict, dict]:
    """(snapshot dict, memory_stats) of one steady step of `cfg` on the current CUDA device."""
    step, model = build_real_step(cfg, "cuda")
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        stats = torch.cuda.memory_stats()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    del step, model
    torch.cuda.empty_cache()
    return snapshot, stats


def gpu_name_for_device() -> str:
    """The tracer GPU table entry with this device's compute capability (the closest lower one)."""
    from tracer.capture.target import GPUS
    sm = torch.cuda.get_device_capability()
    candidates = sorted((g.sm, name) for name, g in GPUS.items() if g.sm <= sm)
    return candidates[-1][1] if candidates else "a100"


# ---------------------------------------------------------------------------------------------- report

def compare_row(cfg: Config, result, device, snapshot: dict, stats: dict | None, top: int):
    from tracer.passes.compare import compare_with_snapshot, snapshot_allocated_peak
    from tracer.snapshots import summarize_snapshot

    reading = summarize_snapshot(snapshot, source=cfg.label, top=top)
    allocated = stats["allocated_bytes.all.peak"] if stats else snapshot_allocated_peak(snapshot)
    cmp = compare_with_snapshot(result, device, reading, measured_allocated_peak_bytes=allocated, top=top)
    reserved_peak = stats["reserved_bytes.all.peak"] if stats else reading.reserved_peak_bytes
    return cmp, reserved_peak


def format_row(cfg: Config, cmp, device, reserved_peak: int) -> str:
    from tracer.reports.units import format_bytes

    def pct(p, m):
        return f"{(p - m) / m * 100:+6.2f}%" if m else "   n/a"
    phase = cmp.predicted_peak_phase + ("" if cmp.same_peak_phase else f"/{cmp.measured_peak_phase}")
    phases = " ".join(f"{q.name[0]}{q.error_fraction * 100:+.2f}%" for q in cmp.phases)
    alloc = cmp.allocated
    return (f"{cfg.label:<40} {format_bytes(cmp.peak.predicted_bytes):>11} {format_bytes(cmp.peak.measured_bytes):>11} "
            f"{pct(cmp.peak.predicted_bytes, cmp.peak.measured_bytes)} {phase:<19} "
            f"{pct(alloc.predicted_bytes, alloc.measured_bytes) if alloc else '   n/a':>8} "
            f"{pct(device.reserved_peak_bytes, reserved_peak):>8}  {phases}")


HEADER = (f"{'config':<40} {'predicted':>11} {'measured':>11} {'error':>7} {'peak phase':<19} {'alloc':>8} "
          f"{'reserved':>8}  per-phase error (f/b/o)")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--smoke", action="store_true", help="CPU only: prediction side and report on a tiny config")
    p.add_argument("--models", default="llama-debug,gpt2-debug,llama-88m")
    p.add_argument("--cnns", default="examples/resnet50.py,examples/vgg16.py",
                   help="CNN model files, run eager at --image (comma-separated; empty for none)")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--image", type=int, default=224, help="image side of the CNN rows")
    p.add_argument("--cudnn-workspace-cap", metavar="SIZE", default=None,
                   help="the run's CUDNN_CONV_WSCAP_DBG (e.g. 64MiB): counted per convolution (an upper bound)")
    p.add_argument("--gpu", default=None, help="tracer GPU name (default: from the device's compute capability)")
    p.add_argument("--tolerance", type=float, default=0.02)
    p.add_argument("--top", type=int, default=5)
    p.add_argument("--out", metavar="DIR", help="keep snapshots and comparison JSON here")
    args = p.parse_args(argv)

    from tracer.reports.compare_text import comparison_json, render_comparison
    from tracer.reports.memviz import predicted_snapshot

    from tracer.reports.units import parse_bytes
    cap = parse_bytes(args.cudnn_workspace_cap) if args.cudnn_workspace_cap else None
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    cnns = [c if os.path.isabs(c) else os.path.join(here, c) for c in args.cnns.split(",") if c]
    image = args.image
    if args.smoke:
        models, batch, seq, gpu = ["llama-debug"], 2, 32, args.gpu or "a100"
        cnns, image = cnns[:1], 32
    else:
        if not torch.cuda.is_available():
            print("no CUDA device: run with --smoke on CPU", file=sys.stderr)
            return 2
        models, batch, seq = args.models.split(","), args.batch, args.seq
        gpu = args.gpu or gpu_name_for_device()
        print(f"device: {torch.cuda.get_device_name()} (sm{''.join(map(str, torch.cuda.get_device_capability()))}), "
              f"predicting as {gpu}; torch {torch.__version__}")
    configs = matrix(models, batch, seq, cnns, image)
    start = time.monotonic()
    predictions = predict(configs, gpu, device_extras=not args.smoke, cudnn_workspace_cap=cap)
    print(f"predicted {len(configs)} configs in {time.monotonic() - start:.0f} s"
          + ("; smoke: measured = the prediction's own snapshot" if args.smoke else ""))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(HEADER)
    failures, details = 0, []
    for cfg in configs:
        analysis, result, device = predictions[cfg]
        if args.smoke:
            snapshot, stats = predicted_snapshot(analysis, cfg.policy), None
            if cfg.mode == "eager":
                step, _ = build_real_step(cfg, "cpu")          # the real-step setup runs (one CPU step)
                step()
        else:
            try:
                snapshot, stats = measure_cuda(cfg)
            except Exception as exc:  # noqa: BLE001 - one config failing must not hide the others; reported
                print(f"{cfg.label:<40} FAILED to run: {type(exc).__name__}: {exc}")
                failures += 1
                continue
        cmp, reserved_peak = compare_row(cfg, result, device, snapshot, stats, args.top)
        print(format_row(cfg, cmp, device, reserved_peak))
        failures += not cmp.peak.within(args.tolerance)
        details.append((cfg, cmp))
        if args.out:
            name = cfg.label.replace(" ", "_").replace("+", "")
            with open(os.path.join(args.out, f"{name}.pickle"), "wb") as f:
                pickle.dump(snapshot, f)
            with open(os.path.join(args.out, f"{name}.json"), "w") as f:
                json.dump({"config": dataclasses.asdict(cfg), "reserved_peak_bytes": reserved_peak,
                           "comparison": comparison_json(cmp)}, f, indent=2)
    worst = max(details, key=lambda d: abs(d[1].peak.error_fraction), default=None)
    if worst is not None:
        print(f"\nlargest peak error: {worst[0].label}\n" + render_comparison(worst[1]))
    print(f"{failures} of {len(configs)} configs beyond {args.tolerance * 100:g}% at the peak")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
