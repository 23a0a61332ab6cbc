from graph_builder import GraphBuilder

from tracer.passes.liveness import BEFORE_STEP, compute_liveness
from tracer.passes.saved import find_saved_tensors
from tracer.stepgraph import StorageRole


def _chain():
    """w (param) ; a = f(w) fwd ; b = g(a) fwd ; ga = h(b, a) bwd ; grad = k(ga) bwd."""
    g = GraphBuilder()
    w = g.storage(100, StorageRole.PARAMETER, preexisting=True, persistent=True)
    a = g.storage(10)
    b = g.storage(20)
    ga = g.storage(40)
    grad = g.storage(100, StorageRole.GRADIENT, persistent=True)
    g.op("forward", [w], [a])
    g.op("forward", [a], [b])
    g.op("backward", [b, a], [ga])
    g.op("backward", [ga], [grad])
    return g.build()


def test_outputs_allocated_while_inputs_live_and_freed_after_last_use():
    lv = compute_liveness(_chain())
    assert lv.start_bytes == 100
    assert lv.live_during == (110, 130, 170, 240)
    assert lv.live_after == (110, 130, 140, 200)
    assert lv.peak_bytes == 240 and lv.peak_op == 3
    assert lv.intervals[0].alloc_op == BEFORE_STEP and lv.intervals[0].free_op is None


def test_peak_is_at_least_every_live_set_and_events_balance():
    graph = _chain()
    lv = compute_liveness(graph)
    for i in range(len(graph.ops)):
        assert lv.peak_bytes >= sum(graph.storage(s).nbytes for s in lv.live_storages_at(i)) == lv.live_during[i]
    persistent = sum(s.nbytes for s in graph.storages if s.persistent)
    assert lv.live_after[-1] == persistent


def test_views_share_storage_and_extend_its_life():
    g = GraphBuilder()
    a = g.storage(8)
    g.op("forward", [], [a])
    g.op("forward", [a], [a])          # a view: no new allocation
    out = g.storage(4)
    g.op("forward", [], [out])
    g.op("forward", [a, out], [])      # last use of a's storage through the view
    lv = compute_liveness(g.build())
    assert lv.live_during == (8, 8, 12, 12)
    assert lv.intervals[a.storage_id].free_op == 3


def test_observed_release_overrides_last_use():
    g = GraphBuilder()
    t = g.storage(64, released_after_op=2)
    g.op("optimizer", [], [t])
    g.op("optimizer", [t], [])
    g.op("optimizer", [], [])
    g.op("optimizer", [], [])
    lv = compute_liveness(g.build())
    assert lv.live_after == (64, 64, 0, 0)


def test_autograd_node_frees_its_inputs_only_when_the_node_ends():
    g = GraphBuilder()
    saved = g.storage(50)
    grad_in = g.storage(5)
    g.op("forward", [], [saved])
    g.op("backward", [], [grad_in], autograd_node=1)
    out1 = g.storage(7)
    out2 = g.storage(3)
    g.op("backward", [saved, grad_in], [out1], autograd_node=2)
    g.op("backward", [out1], [out2], autograd_node=2)      # same node: `saved` is still held
    g.op("backward", [out2], [], autograd_node=3)
    lv = compute_liveness(g.build())
    assert lv.intervals[saved.storage_id].free_op == 3
    assert lv.live_during[3] == 50 + 5 + 7 + 3


def test_saved_tensors_are_made_before_backward_and_read_in_it():
    graph = _chain()
    lv = compute_liveness(graph)
    saved = find_saved_tensors(graph, lv)
    assert saved.storage_ids == {1, 2}
    assert saved.total_bytes == 30 and saved.activation_bytes == 30 and saved.input_bytes == 0
