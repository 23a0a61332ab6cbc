"""An optimizer that replaces its state tensors (`state["m"] = beta1 * m + ...`, the CS336 AdamW of
benchmarks/cs336_model.py) frees the previous step's moments inside step(): predicted vs a real CPU step.

Every phase matches to the byte (backward too: eager's GatherBackward0 keeps gather's whole input, the
(b, s, vocab) negative log-probs, until it runs, and the prediction keeps it as eager does)."""
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
