"""An optimizer that replaces its state tensors (`state["m"] = beta1 * m + ...`, the CS336 AdamW of
benchmarks/cs336_model.py) frees the previous step's moments inside step(): predicted vs a real CPU step.

Every phase matches to the byte (backward too: eager's GatherBackward0 keeps gather's whole input, the
(b, s, vocab) negative log-probs, until it runs, and the prediction keeps it as eager does)."""
import gc
import os

from test_eager_step import FIXTURES, predict_and_measure


def test_replaced_state_is_freed_in_the_step():
    result, measured = predict_and_measure(os.path.join(FIXTURES, "cs336_debug.py"), batch=2, seq=32)
    assert result.start_bytes == measured.start_bytes
    assert result.phases["optimizer"].peak_bytes == measured.phase_peaks["optimizer"]
    assert result.phases["forward"].peak_bytes == measured.phase_peaks["forward"]
    assert result.phases["backward"].peak_bytes == measured.phase_peaks["backward"]
    # every pre-step moment is freed in the step; the new ones (created in it) outlive it
    olds = [s for s in result.graph.storages if s.preexisting and s.role.value == "optimizer_state"]
    assert olds and all(result.liveness.intervals[s.storage_id].free_op is not None for s in olds)


def test_replaced_state_is_freed_when_it_is_replaced_not_when_the_collector_runs():
    """The command runs with garbage collections spaced out (pipeline.space_collections) and a collection
    may come at any op: the old moments are freed at their replacement, by reference counting, as in the
    real step, with the collector off as with it on. (A nested function of the optimizer's state reader that
    called itself was a reference cycle holding every state tensor it found: with collections spaced, the
    command's optimizer peak was the real one plus one set of moments.)"""
    gc.disable()
    try:
        result, measured = predict_and_measure(os.path.join(FIXTURES, "cs336_debug.py"), batch=2, seq=32)
    finally:
        gc.enable()
    assert result.phases["optimizer"].peak_bytes == measured.phase_peaks["optimizer"]
    assert result.end_bytes == measured.start_bytes + 4          # + the step's 0-dim loss, which it returns
