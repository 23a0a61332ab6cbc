"""The corpus sweep's generic shrink rules (benchmarks/wild.py `tiny_overrides`) on plain config dicts: each
rule keeps a constraint between keys that transformers checks, for any config that has those keys."""
from wild_sweep_module import wild_sweep


def test_a_layer_count_that_counts_stages_keeps_every_per_stage_list_whole():
    config = {"depths": [2, 2, 6, 2], "num_layers": 4, "num_heads": [3, 6, 12, 24],
              "pretrained_window_sizes": [0, 0, 0, 0], "embed_dim": 96}
    out = wild_sweep().tiny_overrides(config)
    assert out["depths"] == [1, 1, 1, 1] and out["num_heads"] == [2, 2, 2, 2]
    assert "num_layers" not in out and "pretrained_window_sizes" not in out


def test_per_layer_lists_are_still_cut_where_the_layer_count_is_not_a_stage_count():
    out = wild_sweep().tiny_overrides({"num_hidden_layers": 4, "layer_types": ["a", "b", "a", "b"]})
    assert out == {"num_hidden_layers": 2, "layer_types": ["a", "b"]}


def test_the_proportional_shrink_keeps_heads_times_head_width_a_multiple_of_the_hidden_size():
    sweep = wild_sweep()
    config = {"hidden_size": 4096, "num_heads": 128, "head_dim": 64, "n_groups": 8, "expand": 2}
    assert sweep.tiny_overrides(config)["head_dim"] == 16                       # 4 x 16 = 64: the plain shrink
    out = sweep.tiny_overrides(config, sweep.PROPORTIONAL)
    assert (out["hidden_size"], out["num_heads"], out["head_dim"]) == (64, 4, 32)    # 4 x 32 = 2 x 64
    assert out["n_groups"] == 4                                                  # groups still divide the heads


def test_the_proportional_shrink_leaves_a_head_width_that_is_no_whole_multiple():
    sweep = wild_sweep()
    config = {"hidden_size": 3072, "num_attention_heads": 16, "head_dim": 256}   # 4096 / 3072: 16 x 256 / 3072
    assert sweep.tiny_overrides(config, sweep.PROPORTIONAL)["head_dim"] == 16


def test_a_top_k_left_unset_beside_routed_experts_gets_the_tiny_top_k():
    sweep = wild_sweep()
    out = sweep.tiny_overrides({"n_routed_experts": 64, "num_experts_per_tok": None, "hidden_size": 4096})
    assert out["num_experts_per_tok"] == 2 and out["n_routed_experts"] == 4
    assert "num_experts_per_tok" not in sweep.tiny_overrides({"n_routed_experts": None, "num_experts_per_tok": None})


def test_the_proportional_shrink_keeps_a_count_of_some_layers_below_the_new_depth():
    sweep = wild_sweep()
    config = {"num_hidden_layers": 35, "num_kv_shared_layers": 15, "layer_types": ["sliding"] * 35}
    assert "num_kv_shared_layers" not in sweep.tiny_overrides(config)
    out = sweep.tiny_overrides(config, sweep.PROPORTIONAL)
    assert (out["num_hidden_layers"], out["num_kv_shared_layers"]) == (2, 1)    # one layer reuses, one makes


def test_sizes_summing_to_a_shrunk_width_are_rescaled_to_sum_to_the_new_width():
    """Reformer's axial position embeddings are concatenated into the width: 64 + 192 = hidden_size 256."""
    out = wild_sweep().tiny_overrides({"hidden_size": 256, "axial_pos_embds_dim": [64, 192], "other": [3, 5]})
    assert out["hidden_size"] == 64 and out["axial_pos_embds_dim"] == [16, 48] and "other" not in out


def test_a_position_grid_is_made_to_multiply_to_the_sweeps_sequence_length():
    """Axial positions (64 x 64 = max_position_embeddings 4096) train only on sequences that fill the grid."""
    sweep = wild_sweep()
    out = sweep.tiny_overrides({"max_position_embeddings": 4096, "axial_pos_shape": [64, 64], "sizes": [64, 32]})
    assert out["axial_pos_shape"] == [4, 4] and 4 * 4 == sweep.SEQ and "sizes" not in out
    assert "axial_pos_shape" not in sweep.tiny_overrides({"axial_pos_shape": [64, 64]})


def test_the_summary_counts_each_kind_of_skip_apart_from_the_models_tried():
    """wild_vision.py passes its own skips (no kernel here, over the size limit) beside the default-config
    one; a skipped row is not a model tried, and the summary names how many of each."""
    wild = wild_sweep()

    class NoKernel(wild.DefaultConfigBroken):
        status, why = "skipped (no kernel here)", "no kernel"

    rows = [wild.Row("a", status="exact"), wild.Row("b", status="off"), wild.Row("c", status="fail"),
            wild.Row("d", status=NoKernel.status), wild.Row("e", status=wild.DefaultConfigBroken.status)]
    line = wild.summary(rows, (wild.DefaultConfigBroken, NoKernel))
    assert line.startswith("3 models tried: 1 exact (33%), 1 off, 1 fail; ")
    assert "1 skipped (transformers' default config does not build); 1 skipped (no kernel)" in line
