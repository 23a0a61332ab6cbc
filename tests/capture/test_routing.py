"""The routing assumption's counts and expert assignment (tracer/capture/routing.py), without a model."""
import json

import pytest
import torch

from tracer.capture.routing import RoutingAssumption, assign_experts, parse_routing
from tracer.errors import UsageError


@pytest.mark.parametrize("kind, expected", [("balanced", (6, 5, 5)), ("worst", (8, 8, 0))])
def test_counts_sum_to_token_choices_and_never_exceed_the_tokens(kind, expected):
    counts = RoutingAssumption(kind=kind).expert_counts(tokens=8, experts=3, top_k=2)
    assert counts == expected


@pytest.mark.parametrize("counts, tokens, top_k", [((6, 5, 5), 8, 2), ((8, 8, 0), 8, 2), ((3, 0, 2, 1), 6, 1),
                                                   ((4, 4, 4, 4), 8, 2)])
def test_assignment_gives_each_expert_its_count_and_no_token_an_expert_twice(counts, tokens, top_k):
    chosen = assign_experts(counts, tokens, top_k)
    assert chosen.shape == (tokens, top_k)
    assert torch.bincount(chosen.flatten(), minlength=len(counts)).tolist() == list(counts)
    assert all(len(set(row)) == top_k for row in chosen.tolist())


def test_a_counts_file_must_fit_the_router(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"counts": [5, 3]}))
    assumption = parse_routing(str(path))
    with pytest.raises(ValueError, match="each expert at most 4"):
        assumption.expert_counts(tokens=4, experts=2, top_k=2)
    assert assumption.expert_counts(tokens=8, experts=2, top_k=1) == (5, 3)


@pytest.mark.parametrize("text", ["skewed", "[1, -2]", "{}"])
def test_a_bad_routing_value_is_a_usage_error(tmp_path, text):
    value = text
    if text != "skewed":
        value = str(tmp_path / "r.json")
        (tmp_path / "r.json").write_text(text)
    with pytest.raises(UsageError, match="--moe-routing"):
        parse_routing(value)


def test_the_option_reaches_the_marker_and_check_keywords():
    from tracer.checks.options import analyze_kwargs
    assert analyze_kwargs({"moe_routing": "worst"})["moe_routing"] == "worst"
    assert analyze_kwargs({})["moe_routing"] == "balanced"
    with pytest.raises(UsageError, match="--moe-routing"):
        analyze_kwargs({"moe_routing": "skewed"})


def _pytree_tensors(args, kwargs):
    from torch.utils._pytree import tree_flatten
    return [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]


@pytest.mark.parametrize("args, kwargs", [
    ((torch.ones(2), 3, 1.5), {}),
    (([torch.ones(1), None, torch.zeros(2)], [0, 1]), {"dim": 0, "dtype": torch.float16}),
    ((torch.Size([2, 3]), (torch.ones(1), torch.ones(2))), {"out": torch.ones(3), "device": torch.device("cpu")}),
    ((), {"layout": torch.strided, "memory_format": torch.contiguous_format, "names": "x"}),
])
def test_the_tensor_arguments_of_an_op_are_pytrees_tensor_leaves_in_order(args, kwargs):
    from tracer.capture.routing import _tensor_arguments
    found = _tensor_arguments(args, kwargs)
    expected = _pytree_tensors(args, kwargs)
    assert len(found) == len(expected) and all(a is b for a, b in zip(found, expected))


@pytest.mark.parametrize("args", [([[torch.ones(1)]],), ({"nested": torch.ones(1)},), (object(),)])
def test_arguments_nested_deeper_or_of_another_kind_are_left_to_pytree(args):
    from tracer.capture.routing import _tensor_arguments
    assert _tensor_arguments(args, {}) is None
