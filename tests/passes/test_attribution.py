"""Attribution (tracer.passes.attribution) on a hand-built step: the bill category of each storage, and who
holds the bytes live at one op - by source line (backward ops carry their forward line) and by layer.

    w (param, blocks.0.lin.weight, 64 B), m (optimizer state, 64 B), x (input, 32 B)
    op 0 forward  blocks.0.lin  model.py:10   h = x @ w            -> h (32 B, saved: read in backward)
    op 1 forward  blocks.0      model.py:11   t = act(h)           -> t (16 B, saved), loss (4 B, saved)
    op 2 backward blocks.0.lin  model.py:10   g = grad of w        -> g (gradient, 64 B)
    op 3 backward (no module or source)        engine sum of g, t  -> e (8 B, temporary)
    op 4 optimizer              train.py:30   m += g
x is last read by op 0 and freed after it; at op 2 live are w, m, h, t, loss and g: 244 B.
"""
from graph_builder import GraphBuilder
from tracer.passes.attribution import CATEGORIES, attribute, categorize, layer_of
from tracer.passes.liveness import compute_liveness
from tracer.passes.saved import find_saved_tensors
from tracer.stepgraph import SourceLoc, StorageRole

MATMUL = SourceLoc("model.py", 10, "forward", "h = x @ w")
ACT = SourceLoc("model.py", 11, "forward", "t = act(h)")
STEP = SourceLoc("train.py", 30, "step", "optimizer.step()")


def _step():
    b = GraphBuilder()
    w = b.storage(64, StorageRole.PARAMETER, preexisting=True, persistent=True, name="blocks.0.lin.weight")
    m = b.storage(64, StorageRole.OPTIMIZER_STATE, preexisting=True, persistent=True,
                  name="blocks.0.lin.weight.momentum_buffer")
    x = b.storage(32, StorageRole.INPUT, preexisting=True, name="input 0")
    h, t, loss = b.storage(32), b.storage(16), b.storage(4, persistent=True)
    g = b.storage(64, StorageRole.GRADIENT, persistent=True, name="blocks.0.lin.weight.grad")
    e = b.storage(8)
    b.op("forward", [x, w], [h], module="blocks.0.lin", source=MATMUL)
    b.op("forward", [h], [t, loss], module="blocks.0", source=ACT)
    b.op("backward", [h, loss], [g], module="blocks.0.lin", source=MATMUL)
    b.op("backward", [g, t], [e])
    b.op("optimizer", [m, g, e], [m], source=STEP)
    return b.build()


def _passes(graph):
    liveness = compute_liveness(graph)
    saved = find_saved_tensors(graph, liveness)
    return liveness, saved, categorize(graph, liveness, saved)


def test_each_storage_has_the_category_of_its_role_or_use():
    graph = _step()
    _, _, categories = _passes(graph)
    assert categories == ("parameter", "optimizer_state", "input", "activation", "activation", "activation",
                          "gradient", "temporary")
    assert set(categories) <= set(CATEGORIES)


def test_the_bytes_at_an_op_are_split_by_line_and_by_layer():
    graph = _step()
    liveness, saved, categories = _passes(graph)
    at = attribute(graph, liveness, saved, categories, op_index=2)       # the gradient of w is made
    assert at.by_category == {"parameter": 64, "gradient": 64, "optimizer_state": 64, "activation": 32 + 16 + 4,
                              "temporary": 0, "input": 0, "caller_held": 0}
    assert [(row.label, row.bytes_at_peak) for row in at.lines] == [
        ("model.py:10", 32 + 64),                    # h (forward) and g (its backward): the forward line
        ("(optimizer state)", 64), ("(parameters)", 64), ("model.py:11", 16 + 4)]
    assert [(row.layer, row.bytes_at_peak) for row in at.layers] == [("blocks.0", 244)]   # the names' layer too


def test_saved_bytes_are_counted_on_the_line_that_made_them():
    graph = _step()
    liveness, saved, categories = _passes(graph)
    at = attribute(graph, liveness, saved, categories, op_index=0)
    saved_by_line = {row.label: row.saved_bytes for row in at.lines}
    assert saved_by_line["model.py:10"] == 32 and saved_by_line["model.py:11"] == 16 + 4


def test_ops_without_a_source_are_labelled_by_what_ran_them():
    graph = _step()
    liveness, saved, categories = _passes(graph)
    at = attribute(graph, liveness, saved, categories, op_index=3)
    assert ("(autograd engine)", 8) in [(row.label, row.bytes_at_peak) for row in at.lines]
    assert ("(root)", 8) in [(row.layer, row.bytes_at_peak) for row in at.layers]
    at_start = attribute(graph, liveness, saved, categories, op_index=0)
    assert ("(inputs)", 32) in [(row.label, row.bytes_at_peak) for row in at_start.lines]
    assert ("(input)", 32) in [(row.layer, row.bytes_at_peak) for row in at_start.layers]


def test_layer_of_cuts_after_the_first_index():
    assert layer_of("blocks.3.attn.wq") == "blocks.3"
    assert layer_of("model.layers.12") == "model.layers.12"
    assert layer_of("lm_head") == "lm_head"
    assert layer_of("encoder.norm") == "encoder"
    assert layer_of("") == ""


def test_layers_are_listed_in_the_order_the_step_first_runs_them_whatever_the_storage_ids():
    """A layer's place is its first op's (forward first: the model's order); layers no op runs in follow by
    name. Storages numbered in another order (a graph's and the op-by-op run's differ) list the same."""
    def step(numbered_late_first: bool):
        b = GraphBuilder()
        ids = {}
        for name in (("head", "inp") if numbered_late_first else ("inp", "head")):
            ids[name] = b.storage(32)
        x = b.storage(16, StorageRole.INPUT, preexisting=True, name="input 0")
        loss = b.storage(4, persistent=True)
        b.op("forward", [x], [ids["inp"]], module="inp.proj", source=MATMUL)
        b.op("forward", [ids["inp"]], [ids["head"], loss], module="head", source=ACT)
        b.op("backward", [ids["inp"], ids["head"], loss], [b.storage(8)], module="inp.proj", source=MATMUL)
        return b.build()
    for late_first in (False, True):
        graph = step(late_first)
        liveness, saved, categories = _passes(graph)
        at = attribute(graph, liveness, saved, categories, op_index=2)
        at_start = attribute(graph, liveness, saved, categories, op_index=0)
        assert [row.layer for row in at.layers] == ["inp", "head"]
        assert [row.layer for row in at_start.layers] == ["inp", "head", "(input)"]   # head: its saved bytes
