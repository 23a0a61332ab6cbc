"""Repeated blocks (tracer.passes.blocks) on hand-built steps: the most frequent `prefix.N` in forward, in
forward order; nothing when no prefix repeats; `block_of` finds a module's block at any depth."""
from graph_builder import GraphBuilder
from tracer.passes.blocks import block_of, repeated_blocks


def _forward_through(*modules: str, backward: tuple[str, ...] = ()):
    b = GraphBuilder()
    for module in modules:
        b.op("forward", module=module)
    for module in backward:
        b.op("backward", module=module)
    return b.build()


def test_blocks_are_the_most_frequent_prefix_in_forward_order():
    graph = _forward_through("embed", "model.layers.1.attn", "model.layers.0.mlp", "model.layers.1.mlp",
                             "model.layers.2", "encoder.0", "head")
    assert repeated_blocks(graph) == ["model.layers.1", "model.layers.0", "model.layers.2"]


def test_nested_indices_cut_at_the_first_one():
    graph = _forward_through("blocks.0.moe.experts.3", "blocks.0.moe.experts.4", "blocks.1.moe.experts.0")
    assert repeated_blocks(graph) == ["blocks.0", "blocks.1"]


def test_a_single_indexed_module_is_not_a_repetition():
    assert repeated_blocks(_forward_through("embed", "blocks.0.lin", "blocks.0.act", "head")) == []
    assert repeated_blocks(_forward_through("embed", "head")) == []


def test_only_forward_ops_define_the_blocks():
    graph = _forward_through("blocks.0", backward=("blocks.1", "blocks.2"))
    assert repeated_blocks(graph) == []


def test_block_of_a_module():
    blocks = ["model.layers.0", "model.layers.1"]
    assert block_of("model.layers.1.self_attn.q_proj", blocks) == "model.layers.1"
    assert block_of("model.layers.1", blocks) == "model.layers.1"
    assert block_of("model.layers.10.mlp", blocks) == ""            # an index outside the blocks
    assert block_of("lm_head", blocks) == ""
    assert block_of("", blocks) == ""
