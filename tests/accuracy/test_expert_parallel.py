"""Expert parallelism (--ep): rank 0 of a real 2-rank step, predicted to the byte.

tests/fixtures/expert_parallel_moe.py splits its experts over torch.distributed's ranks in the two styles
people train with: `dropless` exchanges exactly the routed tokens with all-to-all, its split sizes read from
an all-to-all of the per-expert counts (torchtitan's MoE); `capacity` (`build_model(moe="capacity")`) gives
each expert a fixed capacity and exchanges a dense (experts, capacity, dim) buffer through an autograd
Function around the in-place all_to_all_single (DeepSpeed-MoE's, GShard's gating);
expert_parallel_transformers.py is transformers' Mixtral with transformers' own expert parallelism
(DistributedConfig: DTensor expert weights, AllToAllEP). Two gloo processes run one
real training step of each (a warm-up step first), measured at storage level (tests/truth.py), with every
router choosing as tracer's routing assumption: balanced, and worst (every token of every rank picks
experts 0 and 1, which rank 0 holds, so rank 0's experts receive both ranks' tokens, up to their capacity);
and once with every block checkpointed (tracer's `full` policy). tracer captures the same file as rank 0 of
a fake 2-rank group (`--ep 2`). The one-process step of the same file (no group: every expert local) is the
control.
"""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch

import tracer
import truth
from gloo import run_ranks

_FIXTURE_DIR = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
# style -> (model file, build_model's keywords)
FIXTURES = {"dropless": (os.path.join(_FIXTURE_DIR, "expert_parallel_moe.py"), {}),
            "capacity": (os.path.join(_FIXTURE_DIR, "expert_parallel_moe.py"), {"moe": "capacity"}),
            "transformers": (os.path.join(_FIXTURE_DIR, "expert_parallel_transformers.py"), {})}
CHECKPOINTED = ("dropless", "capacity")            # styles whose blocks the test wraps in checkpoint
BATCH, SEQ, RANKS = 2, 16, 2
ROUTINGS = ("balanced", "worst")


def _load(style: str):
    spec = importlib.util.spec_from_file_location(f"expert_parallel_{style}", FIXTURES[style][0])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _step(model, model_file) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    measured = truth.measure_step(model, model_file.example_batch(BATCH, SEQ), optimizer)
    return {"phases": measured.phase_peaks, "saved": measured.saved_bytes, "start": measured.start_bytes}


def _measure(style: str, routing: str) -> dict:
    model_file = _load(style)
    torch.manual_seed(0)
    model = model_file.build_model(**FIXTURES[style][1])
    with (truth.WorstTopk() if routing == "worst" else truth.BalancedTopk()):
        return _step(model, model_file)


def _measure_checkpointed(style: str) -> dict:
    """Every block under non-reentrant torch.utils.checkpoint (tracer's `full` policy): the recompute runs the
    all-to-alls again; the routers route as `balanced` through their weights, so the recompute routes alike."""
    model_file = _load(style)
    torch.manual_seed(0)
    model = model_file.build_model(**FIXTURES[style][1])
    model.blocks = torch.nn.ModuleList(truth.Checkpointed(block) for block in model.blocks)
    for block in model.blocks:
        router = next(m for m in block.block.moe.children() if isinstance(m, torch.nn.Linear))
        truth.route_as_balanced(router, model_file.EXPERTS, model_file.TOP_K)
    return _step(model, model_file)


HF_MIXTRAL = ("num_hidden_layers=2", "hidden_size=32", "intermediate_size=64", "num_attention_heads=4",
              "num_key_value_heads=2", "num_local_experts=4", "vocab_size=128")


def _measure_hf(routing: str) -> dict:
    """`hf:mixtral` as tracer builds it, in a process of the 2-rank group: transformers' expert-parallel
    plan applied (tracer/models/hf.py)."""
    from tracer.capture import load_model_source
    source = load_model_source("hf:mixtral", hf_config=HF_MIXTRAL)
    torch.manual_seed(0)
    model = source.build_model()
    with (truth.WorstTopk() if routing == "worst" else truth.BalancedTopk()):
        return _step(model, source)


def _measure_every_case(rank: int) -> dict:
    return {**{style: {**{routing: _measure(style, routing) for routing in ROUTINGS},
                       **({"full": _measure_checkpointed(style)} if style in CHECKPOINTED else {})}
               for style in FIXTURES},
            "hf:mixtral": {routing: _measure_hf(routing) for routing in ROUTINGS}}


@pytest.fixture(scope="module")
def rank0(tmp_path_factory) -> dict:
    """Rank 0's measurement per model file and case."""
    return run_ranks(_measure_every_case, RANKS, str(tmp_path_factory.mktemp("ep")))[0]


def _predicted(style: str, routing: str, ep: int, capture: str = "auto", policy: str = "eager") -> dict:
    path, keywords = FIXTURES[style]
    result = tracer.analyze(path, batch=BATCH, seq=SEQ, target="cpu", moe_routing=routing, ep=ep, capture=capture,
                            policies=(policy,), model_args=tuple(f"{k}={v}" for k, v in keywords.items())
                            ).policies[policy]
    return {"phases": {name: peak.peak_bytes for name, peak in result.phases.items()},
            "saved": result.saved.total_bytes, "start": result.start_bytes}


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["auto", "dispatch"])
@pytest.mark.parametrize("routing", ROUTINGS)
@pytest.mark.parametrize("style", FIXTURES)
def test_rank_zero_of_an_expert_parallel_step_is_predicted_to_the_byte(rank0, style, routing, capture):
    """Every phase's peak, the saved bytes and the bytes before the step, on the joint-graph rung and
    op by op."""
    assert _predicted(style, routing, RANKS, capture) == rank0[style][routing]


@pytest.mark.slow
@pytest.mark.parametrize("routing", ROUTINGS)
def test_a_transformers_moe_named_hf_is_split_as_transformers_splits_it(rank0, routing):
    """`hf:mixtral --ep 2`: tracer builds the model with transformers' own expert-parallel plan
    (DistributedConfig(ep_size=2, tp_size=2, tp_plan={})), exact against the same build in a real group."""
    result = tracer.analyze("hf:mixtral", hf_config=HF_MIXTRAL, batch=BATCH, seq=SEQ, target="cpu",
                            moe_routing=routing, ep=RANKS).policies["eager"]
    predicted = {"phases": {name: peak.peak_bytes for name, peak in result.phases.items()},
                 "saved": result.saved.total_bytes, "start": result.start_bytes}
    assert predicted == rank0["hf:mixtral"][routing]


@pytest.mark.slow
@pytest.mark.parametrize("style", CHECKPOINTED)
def test_full_checkpointing_recomputes_rank_zeros_exchange_as_a_real_step_does(rank0, style):
    """The checkpointed blocks' forward runs again in backward, the all-to-alls with it."""
    assert _predicted(style, "balanced", RANKS, policy="full") == rank0[style]["full"]


@pytest.mark.slow
def test_worst_routing_sends_every_ranks_tokens_to_rank_zeros_experts(rank0):
    """The all-to-all's received sizes follow symmetric ranks: under `worst` rank 0 receives both ranks'
    tokens for its two experts, so its forward holds more than under `balanced`."""
    measured = rank0["dropless"]
    assert measured["worst"]["phases"]["forward"] > measured["balanced"]["phases"]["forward"]
    assert _predicted("dropless", "worst", RANKS)["phases"]["forward"] == measured["worst"]["phases"]["forward"]


@pytest.mark.slow
@pytest.mark.parametrize("style", FIXTURES)
def test_the_same_file_in_one_process_holds_every_expert(style):
    predicted = _predicted(style, "balanced", 1)
    assert predicted == _measure(style, "balanced")
    assert predicted["start"] > _predicted(style, "balanced", RANKS)["start"]   # twice the experts' weights and state
