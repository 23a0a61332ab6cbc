"""Patterns from real-world models (the benchmarks/wild.py sweep) where the prediction was off, each as a small
model file in tests/fixtures, predicted vs a real eager CPU step (tests/truth.py): every phase peak and the
saved bytes exact."""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.dispatch import CAPTURE_PATH
from tracer.passes.analysis import analyze_graphs
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _assert_exact(fixture: str, capture_path: str | None = None, capture: str = "auto"):
    source = load_model_source(os.path.join(FIXTURES, fixture))
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=32, target="cpu", capture=capture),
                           (PolicySpec(name="eager"),))
    if capture_path is not None:
        assert graphs["eager"].config.capture_path == capture_path
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(2, 32),
                            torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert predicted.start_bytes == measured.start_bytes
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert predicted.saved.total_bytes == measured.saved_bytes
    return predicted


def test_a_local_stays_held_through_a_call_written_over_two_lines():
    """qwen2_audio, granite_speech: `loss = loss_fct(\\n shift_logits.view(...), ...)`; the logits local was let
    go when the line went back from the arguments' line to the call's, 30,728 B under the forward peak."""
    _assert_exact("multiline_loss_call.py")


def test_layer_norm_grad_input_is_contiguous_as_eager_allocates_it():
    """pvt_v2, segformer: the traced LayerNorm backward gave grad_input the transposed gradient's strides, so
    the Linear's backward reshape was traced as a copy: 150,528 B over the backward peak."""
    _assert_exact("transposed_layer_norm.py")


def test_layer_norm_grad_input_is_contiguous_in_the_op_by_op_run_too():
    """The op-by-op rung's fake LayerNorm backward gave grad_input the transposed gradient's strides too: the
    Linear's backward reshape copied, 262,144 B over the backward peak."""
    _assert_exact("transposed_layer_norm.py", CAPTURE_PATH, capture="dispatch")


def test_a_local_bound_in_a_loop_is_held_until_the_next_iteration_binds_it():
    """pvt_v2: `layer_output = layer(...)` in the loop over stages held the stage's LayerNorm output while the
    next stage ran; the prediction let it go at the end of its own iteration, 149,744 B under the forward peak."""
    _assert_exact("stage_loop_locals.py")


def test_gather_keeps_its_source_for_backward_as_eager_autograd_does():
    """inkling_text, inkling2_text, inkling2_loop_text: GatherBackward0 saves the gathered-from logits
    (b, heads, q, rel_extent) although the traced backward reads only their shape: 6.3 to 12.6 MB under the
    saved bytes and every phase peak."""
    _assert_exact("gathered_relative_bias.py")


def test_a_rebinding_in_a_branch_that_never_ran_lets_nothing_go():
    """inkling_text: `query_states = ...` under `if not self.is_sliding and ... log_scaling_n_floor is not
    None:` (off in the config) was taken as passed, releasing the queries before the attention call:
    1.3 MB under the forward peak."""
    _assert_exact("untaken_rebinding.py")


def test_the_math_attention_kernel_holds_its_repeated_keys_until_it_returns():
    """sarvam_mla, youtu, axk2, hy_v4, inkling_text (CPU runs their attention with the math kernel): the
    GQA-repeated keys are a C++ local of `_scaled_dot_product_attention_math`, freed when it returns; the
    graph freed them after their scaling, 131,072 B under this fixture's forward peak."""
    _assert_exact("math_attention_gqa.py")


def test_a_torch_call_holds_its_temporary_argument_until_it_returns():
    """`F.cross_entropy(self.head(x).flatten(0, 1), y)`: the caller holds the logits argument until the call
    returns, so they are live when nll_loss allocates its outputs (8 B over the peak the graph's last use
    gives, at that op)."""
    _assert_exact("loss_of_a_temporary.py")


def test_names_bound_from_a_helper_returning_a_tuple_hold_what_the_helper_returned():
    """sarvam_mla (and the DeepSeek-V3-style MLA models): `key_states, value_states = self.expand_kv(...)`
    bound nothing (the helper ends with in-place copies, and its split gives two views of one storage), so
    the key and value storages were let go after the attention call: 1.05 MB under the forward peak."""
    _assert_exact("tuple_from_a_helper.py")


def test_rows_picked_by_a_mask_from_a_floating_point_constant_are_sized_from_it():
    """xmod: `lang_ids = id * torch.ones(b)` then `hidden[lang_ids == i]`: the boolean index's size follows
    from a float constant, which had no shadow values (only int/bool factories had): a RoutingError."""
    _assert_exact("constant_selected_rows.py")


def test_in_place_dropout_makes_its_noise_in_place_and_writes_into_its_input():
    """torchvision's mobilenet_v3 and mnasnet: aten.dropout_ has no Python kernel, so the trace recorded its
    noise's bernoulli_ and div_ as new tensors; the forward peak was 60,408 B over."""
    predicted = _assert_exact("inplace_dropout_head.py")
    dropout = [op for op in predicted.graph.ops if op.target in ("aten.bernoulli.p", "aten.div.Scalar")]
    assert len({v.storage_id for op in dropout for v in op.outputs}) == 1


def test_a_gather_from_a_table_that_requires_no_grad_saves_nothing():
    """funnel: `torch.gather(pos_embed, 0, rel_pos)` from a sinusoid table the forward builds: eager makes no
    autograd node, but the traced gather shared the previous LayerNorm's seq_nr, so the table was kept for
    that LayerNorm's backward as GatherBackward0's saved input: 524,288 B over the saved bytes and the
    backward peak."""
    _assert_exact("gathered_constant_table.py")


def test_an_in_place_op_of_a_backward_formula_writes_into_the_result_it_returns():
    """xglm: `torch.max(attn_weights, torch.full((), min))`; MaximumBackward0 ends in `masked_fill_` on its
    `where` result, which the functionalized graph traced as a new tensor: one scores-sized gradient (32,768
    B) over the backward peak; its full expression holds `self == other` and `grad / 2` until that write."""
    _assert_exact("clamped_scores_maximum.py")


def test_a_multi_statement_backward_formula_frees_a_statements_temporaries_at_its_end():
    """olmo_hybrid: `linalg_solve_triangular_backward` computes `gA_tmp = -gB_tmp.matmul(X.mH());` then
    `tril(gA_tmp)`; the matmul's result dies at the statement's end, but the one-expression rule held it
    until `tril` made the matrix's gradient: one matrix-sized tensor (2,048 B here, 983,040 B in the sweep's
    model) over the backward peak."""
    predicted = _assert_exact("unit_triangular_solve.py")
    assert predicted.phases["backward"].peak_bytes > predicted.phases["forward"].peak_bytes


@pytest.mark.filterwarnings("ignore:torch.triangular_solve is deprecated")
def test_the_older_triangular_solve_frees_its_statements_temporaries_alike(tmp_path):
    """`triangular_solve_backward`: `grad_a = -grad_b.matmul(x.mH());` then `grad_a = grad_a.tril(-1)`, the
    same statements as linalg's (2,048 B over the backward peak under the one-expression rule)."""
    with open(os.path.join(FIXTURES, "unit_triangular_solve.py")) as fixture:
        text = fixture.read()
    linalg_call = "torch.linalg.solve_triangular(system, value, upper=False, unitriangular=True)"
    assert linalg_call in text
    model = tmp_path / "older_triangular_solve.py"
    model.write_text(text.replace(linalg_call, "torch.triangular_solve(value, system, upper=False, "
                                               "unitriangular=True).solution"))
    _assert_exact(str(model))


def test_a_buffer_rebound_in_forward_is_released_and_its_address_not_taken_for_it():
    """ibert: QuantAct rebinds its running-range buffers in forward (`self.x_max = self.x_max * m + ...`), behind
    a branch on their values (dispatch rung). The old buffers' releases went unseen, so their keys stayed in the
    storage table and new storages at those addresses were taken for the dead buffers: 74,064 to 98,644 B under
    the saved bytes and up to 117 KB under every phase peak, varying from run to run with the addresses reused."""
    _assert_exact("replaced_running_range.py", capture_path=CAPTURE_PATH)
