"""Activation checkpointing as people write it in the model, predicted against a real CPU step run with the same
checkpointing code (tests/truth.py): transformers' gradient_checkpointing_enable() (functools.partial of each
layer's forward), a checkpointed plain function, use_reentrant=True, and a selective policy function of the
user's own (context_fn=partial(create_selective_checkpoint_contexts, policy_fn)). Every phase peak within 0.1%."""
import dataclasses
import os

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
from tracer.passes.flops import op_flops
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
HF_CONFIGS = {
    "hf:bert": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                "vocab_size=512", "hidden_dropout_prob=0", "attention_probs_dropout_prob=0"),
    "hf:llama": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                 "num_key_value_heads=2", "vocab_size=512"),
}
BATCH, SEQ = 2, 64


def _predict(source, spec=PolicySpec(name="eager"), batch=BATCH, seq=SEQ):
    graphs = capture_steps(source, CaptureOptions(batch=batch, seq=seq, target="cpu"), (spec,))
    return analyze_graphs(graphs).policies[spec.label]


def _measure(source, batch=BATCH, seq=SEQ):
    torch.manual_seed(0)
    model = source.build_model()
    return measure_step(model, source.example_batch(batch, seq),
                        torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))


def _assert_phases(predicted, measured, rel=0.001):
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert abs(p - m) <= rel * m, f"{phase}: predicted {p:,} measured {m:,}"


def _hf_source(name, attn, *, reentrant=None):
    """transformers' model from a tiny config; with `reentrant` set, gradient_checkpointing_enable() as
    Trainer(gradient_checkpointing=True) calls it."""
    source = load_model_source(name, hf_config=HF_CONFIGS[name], hf_attn=attn)
    if reentrant is None:
        return source

    def build():
        model = source.build_model()
        model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    return dataclasses.replace(source, build_model=build)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name, attn", [("hf:bert", "eager"), ("hf:llama", "sdpa")])
def test_transformers_gradient_checkpointing_enable(name, attn):
    """Each layer is checkpointed as functools.partial(Layer.forward, layer, **kwargs). Remainder on Llama:
    the partial holds position_ids ((1, seq) int64) until backward though no op of the layer reads it; the
    prediction frees it at its last use, so saved bytes and peaks are that much under."""
    source = _hf_source(name, attn, reentrant=False)
    predicted = _predict(source)
    measured = _measure(source)
    _assert_phases(predicted, measured)
    held_unread = 8 * SEQ if name == "hf:llama" else 0      # position_ids, (1, seq) int64
    assert predicted.saved.total_bytes == measured.saved_bytes - held_unread
    notes = [n for n in predicted.graph.config.notes if n.startswith("checkpointed region")]
    assert len(notes) == 2 and all("\n" not in n for n in notes)
    assert "functools.partial of" in notes[0] and "non-reentrant, full" in notes[0]


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_policy_full_on_bert_matches_gradient_checkpointing():
    """BERT's layers end in a LayerNorm (post-LN): the region's output op is recomputed for the layer's own
    backward (its mean and rstd are not kept from the forward), and the recomputation of one layer does not
    pull the previous layers' (it used to recompute every layer at once: +70% backward peak)."""
    predicted = _predict(_hf_source("hf:bert", "eager"), PolicySpec(name="full"), seq=128)
    measured = _measure(_hf_source("hf:bert", "eager", reentrant=False), seq=128)
    _assert_phases(predicted, measured)
    assert predicted.saved.total_bytes == measured.saved_bytes


def _counted_flops(model, batch) -> int:
    with FlopCounterMode(display=False) as counter:
        model(*batch).backward()
    return counter.get_total_flops()


def _matmul_flops(ops) -> int:
    return sum(op_flops(op) or 0 for op in ops if op.target.startswith(("aten.mm", "aten.addmm", "aten.bmm")))


@pytest.mark.parametrize("fixture, recomputed_matmuls", [("checkpoint_function.py", 2), ("checkpoint_reentrant.py", 4)])
def test_checkpointed_function_and_reentrant_checkpoint(fixture, recomputed_matmuls):
    """A plain function (`checkpoint(mlp, x, up, down)`) and use_reentrant=True (its region reruns whole in
    backward as a graph of its own: no early stop, so the down projection is recomputed too). Recompute
    FLOPs equal FlopCounterMode's difference between the checkpointed and the plain real step."""
    source = load_model_source(os.path.join(FIXTURES, fixture))
    predicted = _predict(source)
    measured = _measure(source)
    _assert_phases(predicted, measured)
    assert predicted.saved.total_bytes == measured.saved_bytes
    kind = "reentrant" if "reentrant" in fixture else "function mlp"
    assert any(kind in n for n in predicted.graph.config.notes)
    recomputed = [op for op in predicted.graph.ops if op.recomputed]
    assert sum(op.target == "aten.addmm.default" for op in recomputed) == recomputed_matmuls
    import torch.utils.checkpoint as ckpt
    batch = source.example_batch(BATCH, SEQ)
    torch.manual_seed(0)
    model = source.build_model()
    checkpointed = _counted_flops(model, batch)
    real = ckpt.checkpoint

    def plain(fn, *args, use_reentrant=None, **kwargs):
        return fn(*args, **kwargs)
    module = __import__(source.build_model.__module__)
    module.checkpoint = plain
    try:
        uncheckpointed = _counted_flops(model, batch)
    finally:
        module.checkpoint = real
    assert _matmul_flops(recomputed) == checkpointed - uncheckpointed > 0


def test_the_users_selective_policy_function_is_simulated():
    """The policy function is asked about every forward op of the region, as torch's selective-checkpointing
    dispatch mode asks it: here it saves every second matmul. (Saved bytes are not compared: the truth's
    saved-tensor hooks do not see the outputs torch's selective checkpointing caches.)"""
    source = load_model_source(os.path.join(FIXTURES, "checkpoint_selective.py"))
    predicted = _predict(source)
    measured = _measure(source)
    _assert_phases(predicted, measured)
    assert any("selective, policy save_every_second_matmul" in n for n in predicted.graph.config.notes)
    recomputed_matmuls = [op for op in predicted.graph.ops if op.recomputed and op.target == "aten.addmm.default"]
    assert 0 < len(recomputed_matmuls) < 6        # full checkpointing would rerun the blocks' six matmuls
