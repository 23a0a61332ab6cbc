"""A step at another size built from the same step at a few sizes (tracer/passes/size_graph.py): hand-made
graphs for the interpolation, llama-debug's captured steps for the claim that the result is the step the
capture makes at that size."""
import dataclasses

import pytest

import tracer
from tests.graph_builder import GraphBuilder
from tracer.passes.size_graph import SizedSteps, SizeError
from tracer.stepgraph import StorageRole


def _scores_step(seq: int, *, autograd_node: int = 7, heads: int = 2):
    """A step whose storages grow as seq (activations) and seq^2 (attention scores)."""
    b = GraphBuilder()
    w = b.storage((8, 8), StorageRole.PARAMETER, preexisting=True)
    x = b.storage((seq, 8))
    scores = b.storage((heads, seq, seq))
    b.op("forward", [x, w], [scores], autograd_node=autograd_node)
    b.op("backward", [scores], [b.storage((seq, 8))], autograd_node=autograd_node)
    return b.build(model="scores", seq=seq, parameter_count=64)


def test_integers_that_grow_with_the_size_are_interpolated_exactly():
    sized = SizedSteps({seq: _scores_step(seq) for seq in (4, 8, 16)})
    assert sized.at(100) == _scores_step(100)           # 2 x 100 x 100 floats: degree 2, exact
    assert sized.at(8) == _scores_step(8)


def test_labels_that_the_capture_numbers_are_kept_as_the_first_sample_numbers_them():
    """Autograd node ids count on through a process's captures: each sample labels its ops differently, and
    the result keeps the first sample's labels (the passes read them only as groups)."""
    sized = SizedSteps({4: _scores_step(4, autograd_node=7), 8: _scores_step(8, autograd_node=90),
                        16: _scores_step(16, autograd_node=3)})
    assert sized.at(32) == _scores_step(32, autograd_node=7)


def test_samples_that_differ_in_more_than_integers_are_refused():
    with pytest.raises(SizeError, match="differs"):
        SizedSteps({4: _scores_step(4), 8: dataclasses.replace(_scores_step(8), storages=tuple(
            dataclasses.replace(s, dtype="bfloat16") for s in _scores_step(8).storages))})
    with pytest.raises(SizeError, match="entries"):
        SizedSteps({4: _scores_step(4), 8: dataclasses.replace(_scores_step(8), ops=_scores_step(8).ops[:1])})


def test_a_size_where_an_integer_is_no_count_is_refused():
    """A buffer padded to a multiple of 32 rows grows like the size only on those multiples: between them
    the interpolation gives no whole number, and the step at that size cannot be built."""
    def padded(seq):
        b = GraphBuilder()
        b.op("forward", [], [b.storage(4 * 32 * -(-seq // 32))])
        return b.build(model="padded", seq=seq)

    sized = SizedSteps({seq: padded(seq) for seq in (16, 32, 64)})
    with pytest.raises(SizeError, match="not a count"):
        sized.at(50)


def _relabelled(graph):
    """`graph` with its autograd node ids renumbered in order of first use (two captures number them apart)."""
    ids: dict = {}
    ops = tuple(dataclasses.replace(op, autograd_node=ids.setdefault(op.autograd_node, len(ids)))
                if op.autograd_node is not None else op for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)


def _step(batch: int, seq: int, **options):
    return tracer.analyze("llama-debug", batch=batch, seq=seq, **options).policies["eager"].graph


def test_llama_debugs_step_at_another_batch_is_the_one_captured_there():
    sized = SizedSteps({batch: _step(batch, 64, target="cuda") for batch in (1, 2, 3)})
    assert _relabelled(sized.at(7)) == _relabelled(_step(7, 64, target="cuda"))


@pytest.mark.slow
def test_llama_debugs_step_at_another_sequence_length_is_the_one_captured_there():
    sized = SizedSteps({seq: _step(2, seq, target="cpu") for seq in (16, 32, 64)})
    assert _relabelled(sized.at(48)) == _relabelled(_step(2, 48, target="cpu"))
