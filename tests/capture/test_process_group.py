"""--ep N: the model is built and stepped as rank 0 of N ranks of a fake process group
(tracer/capture/process_group.py); what a collective decides follows symmetric ranks (capture/routing.py)."""
from __future__ import annotations

import os

import pytest
import torch.distributed as dist

import tracer
from tracer.capture.process_group import rank_zero_of
from tracer.errors import UsageError
from tracer.pipeline import AnalysisOptions

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "expert_parallel_moe.py")


def test_rank_zero_of_n_is_a_fake_group_that_ends_with_the_block():
    with rank_zero_of(4):
        assert (dist.get_backend(), dist.get_world_size(), dist.get_rank()) == ("fake", 4, 0)
        with rank_zero_of(4):              # re-entered: the same group
            assert dist.get_world_size() == 4
        assert dist.is_initialized()
    assert not dist.is_initialized()


def test_one_rank_makes_no_group():
    with rank_zero_of(1):
        assert not dist.is_initialized()


def _routing_note(result, op: str) -> str:
    return next(note for note in result.graph.config.notes if note.startswith(op))


def test_the_model_builds_its_share_of_the_experts_from_the_group():
    whole = tracer.analyze(FIXTURE, batch=2, seq=16, target="cpu")
    split = tracer.analyze(FIXTURE, batch=2, seq=16, target="cpu", ep=2)
    assert split.graph.parameter_count < whole.graph.parameter_count
    assert any(note.startswith("--ep 2: built and stepped as rank 0 of 2 ranks") and "all_to_all_single" in note
               for note in split.graph.config.notes)


def test_an_all_to_all_gives_rank_zero_what_every_rank_sends_it():
    """Under `worst` every token of every rank picks experts 0 and 1, which rank 0 holds: rank 0 receives
    32 token-choices for each from each of the 2 ranks (128 rows), not only its own (64)."""
    balanced = tracer.analyze(FIXTURE, batch=2, seq=16, target="cpu", ep=2)
    worst = tracer.analyze(FIXTURE, batch=2, seq=16, target="cpu", ep=2, moe_routing="worst")
    assert _routing_note(balanced, "aten.repeat_interleave.Tensor").endswith("(64)")
    assert _routing_note(worst, "aten.repeat_interleave.Tensor").endswith("(128)")


def test_a_model_without_collectives_is_refused_under_ep():
    with pytest.raises(UsageError, match="made no torch.distributed collective call"):
        tracer.analyze("llama-debug", batch=1, seq=16, target="cpu", ep=2)


@pytest.mark.parametrize("options", [dict(tp=2), dict(pp=2), dict(shard="fsdp", world_size=2),
                                     dict(policies=("compiled",))])
def test_ep_with_what_it_does_not_model_is_refused(options):
    with pytest.raises(UsageError, match="--ep with"):
        AnalysisOptions(ep=2, **options)
