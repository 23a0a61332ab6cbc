"""`--pp N` against real torch.distributed.pipelining steps: N CPU processes over gloo, each a stage of
tests/fixtures/pipeline_lm.py split as torchtitan splits a model (its blocks evenly, the embedding on the
first stage, the final norm and head on the last), stepped by Schedule1F1B or ScheduleGPipe with the loss on
the last stage (`step(..., return_outputs=...)` both ways), then AdamW over the stage's parameters. Every allocation of each process is seen by the CPU
allocator's profiler from before the model is built, so a stage's bytes before the step (parameters,
optimizer state, the receive buffers the runtime keeps) and its peak are absolute; the third step is
measured."""
import os
import socket

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.liveness import compute_liveness
from tracer.passes.pipeline_parallel import PipelineSetup, pipeline_stage_graph

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "pipeline_lm.py")
SEQ = 32


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stage_module(model, stage: int, stages: int):
    """The model with only stage `stage`'s blocks (and the embedding or the norm and head where they belong)."""
    import copy
    part = copy.deepcopy(model)
    names = list(part.layers.keys())
    keep = {name for i, name in enumerate(names) if i * stages // len(names) == stage}
    for name in names:
        if name not in keep:
            del part.layers[name]
    if stage != 0:
        part.embed = None
    if stage != stages - 1:
        part.norm = part.head = None
    return part


def _run_stage(rank: int, stages: int, schedule: str, batch: int, microbatches: int, return_outputs: bool, port: int,
               out: str, per_rank: int = 1):
    """One rank: stages `rank`, `rank + stages`, ... of `stages * per_rank` (more than one: interleaved)."""
    import sys

    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from torch.profiler import ProfilerActivity, profile, record_function

    sys.path.insert(0, os.path.dirname(FIXTURE))
    import pipeline_lm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=stages)
    profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
    profiler.__enter__()                                 # before any tensor of the model exists
    torch.manual_seed(0)
    model = pipeline_lm.build_model()
    total = stages * per_rank
    indices = [rank + k * stages for k in range(per_rank)]
    parts = [_stage_module(model, index, total) for index in indices]
    del model
    pipeline_stages = [PipelineStage(part, index, total, torch.device("cpu")) for part, index in zip(parts, indices)]
    if schedule == "interleaved-1f1b":
        steps = ScheduleInterleaved1F1B(pipeline_stages, microbatches, loss_fn=pipeline_lm.loss_fn)
    else:
        kind = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe}[schedule]
        steps = kind(pipeline_stages[0], microbatches, loss_fn=pipeline_lm.loss_fn)
    optimizer = pipeline_lm.make_optimizer([p for part in parts for p in part.parameters()])
    tokens, targets = pipeline_lm.example_batch(batch, SEQ)
    tokens = tokens if rank == 0 else None
    targets = targets if rank == stages - 1 else None

    def step():
        if rank == 0:
            steps.step(tokens, return_outputs=return_outputs)
        elif rank == stages - 1:
            steps.step(target=targets, losses=[], return_outputs=return_outputs)      # the output is dropped
        else:
            steps.step(return_outputs=return_outputs)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    step()
    with record_function("phase:step"):
        step()
    profiler.__exit__(None, None, None)
    events = list(profiler.profiler.kineto_results.events())
    (begin, end), = [(e.start_ns(), e.start_ns() + e.duration_ns()) for e in events if e.name() == "phase:step"]
    now, start, peak = 0, None, None
    for at, nbytes in sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]"):
        if at > end:
            break
        if at >= begin and start is None:
            start = peak = now
        now += nbytes
        if at >= begin:
            peak = max(peak, now)
    with open(os.path.join(out, f"rank{rank}"), "w") as f:
        f.write(f"{start} {peak}")
    dist.destroy_process_group()


def _measured(tmp_path, stages, schedule, batch, microbatches, return_outputs, per_rank=1) -> list[tuple[int, int]]:
    import torch.multiprocessing as mp
    mp.spawn(_run_stage, args=(stages, schedule, batch, microbatches, return_outputs, _free_port(), str(tmp_path),
                               per_rank), nprocs=stages)
    return [tuple(int(v) for v in (tmp_path / f"rank{rank}").read_text().split()) for rank in range(stages)]


def _predicted(stages, schedule, batch, microbatches, return_outputs, per_rank=1) -> list[tuple[int, int]]:
    source = load_model_source(FIXTURE)
    graph = capture_step(source, CaptureOptions(batch=batch // microbatches, seq=SEQ, target="cpu",
                                                accumulate=microbatches))
    setup = PipelineSetup(stages, microbatches, schedule, return_outputs, stages_per_rank=per_rank)
    out = []
    for rank in range(stages):
        liveness = compute_liveness(pipeline_stage_graph(graph, setup, rank))
        out.append((liveness.start_bytes, liveness.peak_bytes))
    return out


@pytest.mark.parametrize("stages, schedule, batch, microbatches, return_outputs", [
    (2, "1f1b", 8, 4, False), (2, "gpipe", 8, 4, False), (4, "1f1b", 16, 8, False), (4, "gpipe", 8, 2, False),
    (2, "1f1b", 8, 4, True), (4, "1f1b", 16, 8, True)])
def test_every_stage_is_exact_against_a_real_pipeline_step(tmp_path, stages, schedule, batch, microbatches,
                                                           return_outputs):
    """return_outputs=True (torch's default) keeps the last stage's outputs until the next step and
    concatenates them after the last backward; False lets each go after its backward."""
    measured = _measured(tmp_path, stages, schedule, batch, microbatches, return_outputs)
    predicted = _predicted(stages, schedule, batch, microbatches, return_outputs)
    # the schedule keeps each micro-batch's 0-dim loss on the last stage until the step ends (not modelled)
    losses = 8 * microbatches
    for stage, ((start, peak), (real_start, real_peak)) in enumerate(zip(predicted, measured)):
        slack = losses if stage == stages - 1 else 0
        assert abs(start - real_start) <= slack and abs(peak - real_peak) <= slack, (stage, predicted, measured)


@pytest.mark.parametrize("stages, per_rank, batch, microbatches, return_outputs", [
    (2, 2, 8, 4, False), (2, 2, 8, 4, True), (2, 2, 8, 2, False), (2, 2, 12, 6, False)])
def test_every_rank_of_an_interleaved_pipeline_is_exact(tmp_path, stages, per_rank, batch, microbatches,
                                                        return_outputs):
    """ScheduleInterleaved1F1B with two stages on each rank (the model cut into four): torch's runtime for
    several stages per rank keeps every send until its loop ends."""
    measured = _measured(tmp_path, stages, "interleaved-1f1b", batch, microbatches, return_outputs, per_rank)
    predicted = _predicted(stages, "interleaved-1f1b", batch, microbatches, return_outputs, per_rank)
    losses = 8 * microbatches
    for rank, ((start, peak), (real_start, real_peak)) in enumerate(zip(predicted, measured)):
        slack = losses if rank == stages - 1 else 0
        assert abs(start - real_start) <= slack and abs(peak - real_peak) <= slack, (rank, predicted, measured)
