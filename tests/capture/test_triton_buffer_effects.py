"""A Triton plan's kernels whose bookkeeping is replayed instead of generated (tracer.capture.
triton_buffer_effects) leave the plan exactly as generating every kernel does: the same step to the last
field, on models whose kernels load masked and indirect, draw random numbers, mutate buffers and reduce
in loops (the kernels the replay leaves to Inductor), and most kernels are replayed."""
import dataclasses
import os

import pytest

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture import triton_buffer_effects, triton_target

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
HF_LLAMA = ("num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
            "intermediate_size=128", "vocab_size=128")
POLICIES = tuple(PolicySpec(name=p) for p in ("compiled", "compiled+selective", "compiled-blocks+full"))
WHOLE_MODEL_POLICIES = POLICIES[:2]                # a model without repeated blocks has no per-block compile

_START_FORKED = triton_target.start_forked

pytestmark = pytest.mark.skipif(triton_target.triton_unavailable() is not None,
                                reason=f"no Triton plan here: {triton_target.triton_unavailable()}")


def _planned(model, *, generated: bool, counts: list, monkeypatch, policies, hf_config=(), **options) -> dict:
    """The compiled policies' steps, each kernel generated or (where it can be) replayed; `counts` gets the
    planning child's kernel counts (one planning child at a time: the forward is planned in it too)."""
    def counted(work):
        handle = _START_FORKED(lambda: (work(), triton_buffer_effects.kernel_counts()))

        class Counted:
            def result(self):
                value, seen = handle.result()
                counts.append(seen)
                return value

            def abandon(self):
                handle.abandon()
        return Counted()

    monkeypatch.setattr(triton_target, "start_forked", counted)
    monkeypatch.setattr(triton_target, "usable_cores", lambda: 1)
    source = load_model_source(model, hf_config=hf_config)
    with triton_buffer_effects.kernel_code_generated(generated):
        return capture_steps(source, CaptureOptions(target="cuda:h100", **options), policies)


def _numbered_alike(graph):
    """`graph` without its autograd node ids, which a process numbers on from one capture to the next."""
    return dataclasses.replace(graph, ops=tuple(dataclasses.replace(op, autograd_node=None) for op in graph.ops))


@pytest.mark.parametrize("model,policies,options", [
    pytest.param("gpt2-debug", POLICIES, {"seq": 128}, id="gpt2"),                 # masked loads (causal mask)
    pytest.param("llama-debug", POLICIES, {"seq": 128}, id="llama", marks=pytest.mark.slow),   # rotary halves
    pytest.param("hf:llama", POLICIES, {"seq": 64, "precision": "bf16", "hf_config": HF_LLAMA},
                 id="hf-llama-bf16", marks=pytest.mark.slow),                       # autocast's casts
    pytest.param(os.path.join(FIXTURES, "dropout_train.py"), WHOLE_MODEL_POLICIES, {"seq": 64},
                 id="dropout", marks=pytest.mark.slow),                             # random seeds
    pytest.param(os.path.join(FIXTURES, "batchnorm_shared_head.py"), WHOLE_MODEL_POLICIES, {"seq": 64},
                 id="batchnorm", marks=pytest.mark.slow),                           # running stats mutated
])
def test_replayed_kernels_leave_the_plan_as_generated_kernels_do(model, policies, options, monkeypatch):
    generated_counts, replayed_counts = [], []
    generated = _planned(model, generated=True, counts=generated_counts, monkeypatch=monkeypatch,
                         policies=policies, **options)
    replayed = _planned(model, generated=False, counts=replayed_counts, monkeypatch=monkeypatch,
                        policies=policies, **options)
    for spec in policies:
        assert _numbered_alike(replayed[spec.label]) == _numbered_alike(generated[spec.label]), spec.label
    assert generated_counts and all(c["replayed"] == 0 for c in generated_counts)
    replayed_total = sum(c["replayed"] for c in replayed_counts)
    left_to_inductor = sum(c["generated"] for c in replayed_counts)
    # every one of these models has a kernel the replay leaves to Inductor (an embedding's indirect load at
    # least), and most kernels are replayed
    assert replayed_total > left_to_inductor > 0
