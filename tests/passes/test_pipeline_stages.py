"""Pipeline parallelism as a pass over the captured step (tracer/passes/pipeline_parallel.py): the order a
stage runs its micro-batches in, which stage each op belongs to, and what --pp refuses. The exactness of
the stages' memory against real torch.distributed.pipelining steps is tests/accuracy/test_pipeline_parallel.py."""
import pytest

import tracer
from tracer.errors import UsageError
from tracer.passes.pipeline_parallel import PipelineSetup, interleaved_actions, op_stages, rank_actions, schedule_actions
from tracer.pipeline import AnalysisOptions
from tracer.stepgraph import Phase

F, B = Phase.FORWARD, Phase.BACKWARD


def test_1f1b_warms_up_with_as_many_forwards_as_stages_left_then_alternates():
    # torch's Schedule1F1B: min(microbatches, stages - stage) forwards first
    assert schedule_actions("1f1b", 0, 2, 4) == ((F, 1), (F, 2), (B, 1), (F, 3), (B, 2), (F, 4), (B, 3), (B, 4))
    assert schedule_actions("1f1b", 1, 2, 4) == ((F, 1), (B, 1), (F, 2), (B, 2), (F, 3), (B, 3), (F, 4), (B, 4))
    assert schedule_actions("1f1b", 0, 4, 2) == ((F, 1), (F, 2), (B, 1), (B, 2))


def test_gpipe_runs_every_forward_then_every_backward():
    assert schedule_actions("gpipe", 1, 4, 3) == ((F, 1), (F, 2), (F, 3), (B, 1), (B, 2), (B, 3))
    with pytest.raises(UsageError, match="unknown pipeline schedule"):
        schedule_actions("zero-bubble", 0, 2, 2)


def _torch_interleaved_order(rank, ranks, per_rank, microbatches):
    """torch's own order for one rank of ScheduleInterleaved1F1B, computed without a process group."""
    from torch.distributed.pipelining.schedules import ScheduleInterleaved1F1B
    schedule = object.__new__(ScheduleInterleaved1F1B)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = ranks, per_rank, microbatches
    schedule.microbatches_per_round = microbatches // max(1, microbatches // ranks)
    phases = {"FORWARD": F, "FULL_BACKWARD": B}
    return tuple((a.stage_index, phases[a.computation_type.name], a.microbatch_index + 1)
                 for a in schedule._calculate_single_rank_operations(rank) if a is not None)


@pytest.mark.parametrize("ranks, per_rank, microbatches", [(2, 2, 4), (2, 2, 2), (2, 3, 6), (4, 2, 8), (4, 2, 3),
                                                           (3, 2, 6), (4, 4, 16)])
def test_the_interleaved_order_is_torchs(ranks, per_rank, microbatches):
    for rank in range(ranks):
        assert interleaved_actions(rank, ranks, per_rank, microbatches) == _torch_interleaved_order(
            rank, ranks, per_rank, microbatches)


def test_an_interleaved_rank_holds_every_ranks_th_stage_and_refuses_partial_rounds():
    setup = PipelineSetup(stages=2, microbatches=4, schedule="interleaved-1f1b", stages_per_rank=3)
    assert setup.rank_stages(1) == (1, 3, 5) and setup.stage_count == 6
    assert {stage for stage, _, _ in rank_actions(setup, 1)} == {1, 3, 5}
    with pytest.raises(UsageError, match="not a multiple of the schedule's 2 rounds"):
        interleaved_actions(0, 4, 2, 10 - 1)
    with pytest.raises(UsageError, match="runs one stage per rank"):
        rank_actions(PipelineSetup(stages=2, microbatches=4, schedule="1f1b", stages_per_rank=2), 0)


def _graph(**options):
    return tracer.analyze("llama-debug", batch=4, seq=16, target="cpu", accumulate=2, **options).policies["eager"].graph


def test_the_embedding_goes_to_the_first_stage_and_the_head_and_loss_to_the_last():
    graph = _graph()
    stages = op_stages(graph, 2)
    by_module = {}
    for op, stage in zip(graph.ops, stages):
        if op.phase is not Phase.OPTIMIZER:
            by_module.setdefault(op.module.split(".")[0] or "(root)", set()).add(stage)
    assert by_module["embed"] == {0}
    assert by_module["lm_head"] == by_module["norm"] == {1}
    assert by_module["blocks"] == {0, 1}
    assert all(stage is None for op, stage in zip(graph.ops, stages) if op.phase is Phase.OPTIMIZER)


def test_pp_refuses_what_it_does_not_model_and_a_batch_it_cannot_split():
    with pytest.raises(UsageError, match="does not split into 3 micro-batches"):
        AnalysisOptions(batch=4, seq=16, pp=2, microbatches=3).capture_options()
    with pytest.raises(UsageError, match="--shard"):
        AnalysisOptions(batch=4, seq=16, pp=2, shard="fsdp", world_size=2)
    with pytest.raises(UsageError, match="--policy full"):
        AnalysisOptions(batch=4, seq=16, pp=2, policies=("eager", "full"))
    with pytest.raises(UsageError, match="need --pp"):
        AnalysisOptions(batch=4, seq=16, microbatches=2)
    with pytest.raises(UsageError, match="holds one stage on each rank"):
        AnalysisOptions(batch=4, seq=16, pp=2, pp_local_stages=2)
    interleaved = AnalysisOptions(batch=8, seq=16, pp=2, pp_schedule="interleaved-1f1b").pipeline_setup()
    assert (interleaved.stages_per_rank, interleaved.stage_count) == (2, 4)     # two stages a rank by default
    options = AnalysisOptions(batch=8, seq=16, pp=4)
    assert options.pipeline_setup().microbatches == 4            # as many micro-batches as stages by default
    captured = options.capture_options()
    assert (captured.batch, captured.accumulate) == (2, 4)


def test_more_stages_than_blocks_is_refused():
    with pytest.raises(UsageError, match="repeated blocks"):
        tracer.analyze("llama-debug", batch=4, seq=16, target="cpu", pp=8, microbatches=2)


def test_the_report_describes_the_busiest_stage_and_names_every_stages_peak():
    analysis = tracer.analyze("llama-debug", batch=4, seq=16, target="cpu", pp=2, microbatches=2)
    notes = analysis.policies["eager"].graph.config.notes
    assert any(n.startswith("pipeline stages' peaks: stage 1") for n in notes)
    assert any("the rank of stage" in n for n in notes)


@pytest.mark.slow
def test_fit_searches_batches_the_micro_batches_split():
    from tracer.planning import fit_budget
    budget = tracer.analyze("llama-debug", batch=8, seq=16, target="cpu", pp=2,
                            microbatches=4).policies["eager"].peak_bytes
    report = fit_budget("llama-debug", budget, seq=16, policies=("eager",), target="cpu", pp=2, microbatches=4)
    result = report.results["eager"]
    assert result.largest == 8 and result.next_size == 12
