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
    "hf:gpt2": ("n_layer=2", "n_embd=64", "n_head=4", "vocab_size=512", "resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0"),
    "hf:t5": ("num_layers=2", "num_decoder_layers=2", "d_model=64", "d_ff=128", "num_heads=4", "d_kv=16",
              "vocab_size=512", "dropout_rate=0"),
}
BATCH, SEQ = 2, 64


def _predict(source, spec=PolicySpec(name="eager"), batch=BATCH, seq=SEQ, capture="auto"):
    graphs = capture_steps(source, CaptureOptions(batch=batch, seq=seq, target="cpu", capture=capture), (spec,))
    return analyze_graphs(graphs).policies[spec.label]


def _measure(source, batch=BATCH, seq=SEQ):
    torch.manual_seed(0)
    model = source.build_model()
    return measure_step(model, source.example_batch(batch, seq),
                        torch.optim.AdamW(model.parameters(), lr=1e-3))


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
@pytest.mark.parametrize("name, attn", [("hf:bert", "eager"), ("hf:llama", "sdpa"),
                                        ("hf:gpt2", "sdpa"),
                                        ("hf:t5", "sdpa")])
def test_transformers_gradient_checkpointing_enable(name, attn):
    """Each layer is checkpointed as functools.partial(Layer.forward, layer, **kwargs). On Llama the partial
    holds position_ids ((1, seq) int64) until the layer's backward though no op of the layer reads it. Every
    phase peak and the saved bytes are exact."""
    source = _hf_source(name, attn, reentrant=False)
    predicted = _predict(source)
    notes = [n for n in predicted.graph.config.notes if n.startswith("checkpointed region")]
    assert len(notes) == (4 if name == "hf:t5" else 2) and all("\n" not in n for n in notes)   # one per layer
    assert "functools.partial of" in notes[0] and "non-reentrant, full" in notes[0]
    measured = _measure(source)
    _assert_phases(predicted, measured, rel=0)
    assert predicted.saved.total_bytes == measured.saved_bytes


def test_a_non_reentrant_frame_holds_what_its_partial_binds_until_the_regions_backward():
    """tests/fixtures/checkpoint_unread_partial.py: each block's partial binds an int64 `positions` it never
    reads and a `scale` it reads; the checkpoint frames hold both until the first block's backward has run.
    Was backward 1,280 B and saved 1,024 B under."""
    source = load_model_source(os.path.join(FIXTURES, "checkpoint_unread_partial.py"))
    predicted, measured = _predict(source), _measure(source)
    _assert_phases(predicted, measured, rel=0)
    assert predicted.saved.total_bytes == measured.saved_bytes


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name, attn", [("hf:llama", "sdpa"), ("hf:bert", "eager"), ("hf:gpt2", "sdpa"), ("hf:t5", "sdpa")])
def test_transformers_gradient_checkpointing_enable_reentrant(name, attn):
    """gradient_checkpointing_enable(use_reentrant=True), as older transformers versions and many
    codebases run it: CheckpointFunction keeps the functools.partial (with Llama's rotary cos/sin and
    position ids) on its autograd node, so the tensors it binds live until the graph dies; its backward holds
    the gradients it was called with and the rerun's outputs (BERT's LayerNorm output, one result of three)
    until the region's backward has run. (Saved bytes are not compared: the truth's saved-tensor hooks do
    not see what CheckpointFunction holds.)"""
    source = _hf_source(name, attn, reentrant=True)
    predicted = _predict(source)
    notes = [n for n in predicted.graph.config.notes if n.startswith("checkpointed region")]
    assert len(notes) == (4 if name == "hf:t5" else 2)                     # one per layer
    assert all("reentrant" in n and "non-reentrant" not in n for n in notes)
    _assert_phases(predicted, _measure(source))


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



def _flop_counted(ops) -> int:
    """FLOPs of the ops FlopCounterMode has a formula for (its registry; torch 2.13 has none for the CPU
    flash-attention kernel), by the tracer's own formulas."""
    from torch.utils.flop_counter import flop_registry
    counted = {str(packet) for packet in flop_registry}
    return sum(op_flops(op) or 0 for op in ops if op.target.rsplit(".", 1)[0] in counted)


@pytest.mark.filterwarnings("ignore::FutureWarning")
@pytest.mark.parametrize("name, attn", [("hf:llama", "sdpa"), ("hf:bert", "eager"), ("hf:gpt2", "sdpa"), ("hf:t5", "sdpa")])
@pytest.mark.parametrize("capture", ["auto", "dispatch"])
def test_transformers_recompute_flops_match_flop_counter(name, attn, capture):
    """The recomputed ops' FLOPs equal FlopCounterMode's difference between the real step with
    gradient_checkpointing_enable() and the same step with its checkpoint function a plain call (the ops it
    counts). The baseline keeps checkpointing's other effects on the model: T5's attention flags its zero
    bias as a leaf that requires grad, so SDPA takes the math kernel, whose matmuls FlopCounterMode counts
    (it has no formula for the CPU flash kernel a plain T5 step takes). On both rungs: the op-by-op run marks
    what checkpoint re-runs inside backward as recomputed."""
    source = _hf_source(name, attn, reentrant=False)
    recomputed = [op for op in _predict(source, capture=capture).graph.ops if op.recomputed]
    batch = source.example_batch(BATCH, SEQ)
    torch.manual_seed(0)
    checkpointed = _counted_flops(source.build_model(), batch)
    torch.manual_seed(0)
    plain = _counted_flops(_without_recompute(source.build_model()), batch)
    assert _flop_counted(recomputed) == checkpointed - plain > 0


def _without_recompute(model):
    """gradient_checkpointing_enable()'s model with every layer's checkpoint function a plain call."""
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = lambda function, *args, **kwargs: function(*args, **kwargs)
    return model


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


def test_a_recompute_reruns_the_region_in_forward_order_with_its_unread_ops():
    """tests/fixtures/checkpoint_position_bias.py: the first block's recompute makes its int64 distance
    indices before the attention (the partitioner made them last, just before the embedding's backward that
    reads them) and runs the embedding again though no backward node reads its output, which the block's
    frame holds (the bias it returns) until the recompute stops; the recompute's relu is the backward's
    peak. Was backward 136,384 B (5.4%) under."""
    source = load_model_source(os.path.join(FIXTURES, "checkpoint_position_bias.py"))
    predicted = _predict(source)
    _assert_phases(predicted, _measure(source), rel=0)
    ops = predicted.graph.ops
    assert [op.recomputed for op in ops if op.target == "aten.embedding.default"] == [False, True]
    rerun = [op.target for op in ops if op.recomputed and op.module.startswith("blocks.0")]
    assert rerun.index("aten.clamp.default") < rerun.index("aten.embedding.default") < rerun.index("aten.bmm.default")
    peak = ops[predicted.phases["backward"].op_index]
    assert peak.recomputed and peak.target == "aten.relu.default"


def test_reentrant_rerun_locals_hold_as_in_forward():
    """use_reentrant=True reruns the block's Python code inside backward: its locals hold the rerun's values
    (no autograd sequence number: each rerun op is matched to the forward op it copies) as they held the
    forward's, so the rerun of tests/fixtures/checkpoint_reentrant_locals.py is the backward's peak (5.3%
    under when the rerun's values died at their last use)."""
    source = load_model_source(os.path.join(FIXTURES, "checkpoint_reentrant_locals.py"))
    predicted = _predict(source)
    _assert_phases(predicted, _measure(source), rel=0)
    assert predicted.graph.ops[predicted.phases["backward"].op_index].recomputed


@pytest.mark.parametrize("checkpointed", [False, True])
def test_a_leaf_made_in_forward_has_a_gradient_and_lives_with_the_graph(checkpointed):
    """tests/fixtures/forward_made_leaf.py makes an attention bias in forward and flags it requires_grad (as
    T5Attention does under gradient checkpointing): SDPA takes the math kernel as in eager, the leaf's .grad
    sums both blocks' gradients, and the leaf and its .grad live until the step ends; checkpointed, the
    first block's recompute makes the leaf again. Was (plain) backward 65,536 B and optimizer 131,072 B under;
    (checkpointed) forward 22% and backward 24% under, with the flash kernel."""
    source = load_model_source(os.path.join(FIXTURES, "forward_made_leaf.py"))
    module = __import__("sys").modules[source.build_model.__module__]
    module.checkpointed = checkpointed
    try:
        predicted = _predict(source)
        measured = _measure(source)
    finally:
        module.checkpointed = False
    _assert_phases(predicted, measured, rel=0)
    assert predicted.saved.total_bytes == measured.saved_bytes
    targets = {op.target for op in predicted.graph.ops}
    assert "aten._safe_softmax.default" in targets and not any("flash" in t for t in targets)
    assert sum(s.name.startswith("leaf made in forward at forward_made_leaf.py") for s in predicted.graph.storages) \
        == (3 if checkpointed else 2)      # the leaf, its .grad (and the recompute's fresh leaf)


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


def _save_policy_file(*, in_model: bool):
    """tests/fixtures/save_policy_file.py, its blocks plain (the policy given as `save_policy`) or checkpointing
    themselves with the same policy (context_fn=partial(create_selective_checkpoint_contexts, save_policy))."""
    source = load_model_source(os.path.join(FIXTURES, "save_policy_file.py"))
    module = __import__("sys").modules[source.build_model.__module__]

    def build():
        module.checkpoint_in_model = in_model
        return source.build_model()
    return dataclasses.replace(source, build_model=build), module


def test_a_save_policy_in_the_model_file_is_the_policy_written_in_the_model():
    """`save_policy` defined in the model file and --policy selective predicts exactly what the same policy
    passed to checkpoint(..., context_fn=...) inside the model predicts: same phase peaks, same recomputed ops."""
    from tracer.pipeline import AnalysisOptions, run_analysis

    options = dict(batch=BATCH, seq=SEQ, target="cpu")
    file_source, module = _save_policy_file(in_model=False)
    try:
        as_file = run_analysis(file_source, AnalysisOptions(policies=("selective",), **options)).policies["selective"]
        in_model = run_analysis(_save_policy_file(in_model=True)[0],
                                AnalysisOptions(policies=("eager",), **options)).policies["eager"]
        named = run_analysis(file_source, AnalysisOptions(policies=("selective",), save_policy="matmul",
                                                          **options)).policies["selective"]
    finally:
        module.checkpoint_in_model = False
    assert "save policy: the policy function save_policy" in as_file.graph.config.notes
    assert sum("selective, policy save_policy" in n for n in in_model.graph.config.notes) == 3
    for phase in ("forward", "backward", "optimizer"):
        assert as_file.phases[phase].peak_bytes == in_model.phases[phase].peak_bytes, phase
    assert as_file.start_bytes == in_model.start_bytes
    assert [o.target for o in as_file.graph.ops if o.recomputed] == [o.target for o in in_model.graph.ops if o.recomputed]
    # the up projection and gelu are saved: each block reruns its middle matmul for tanh's backward (the down
    # projection's output feeds only the residual add, whose backward reads nothing)
    assert sum(o.recomputed and o.target == "aten.addmm.default" for o in as_file.graph.ops) == 3
    assert any("--save-policy matmul (given explicitly: the model file's save_policy() is not used)" in n
               for n in named.graph.config.notes)


def test_a_save_policy_in_the_model_file_matches_the_real_step():
    """The model file's save_policy under --policy selective predicts the real step in which the blocks
    checkpoint themselves with that policy: the recompute runs when the region's first backward node unpacks
    a saved tensor, and a MUST_SAVE output the recompute stops before stays cached until the region's
    backward ends."""
    source, module = _save_policy_file(in_model=False)
    try:
        from tracer.pipeline import AnalysisOptions, run_analysis
        predicted = run_analysis(source, AnalysisOptions(batch=BATCH, seq=SEQ, target="cpu",
                                                         policies=("selective",))).policies["selective"]
        measured = _measure(_save_policy_file(in_model=True)[0])
    finally:
        module.checkpoint_in_model = False
    _assert_phases(predicted, measured)
