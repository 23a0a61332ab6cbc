"""Python locals keep tensors alive past their last use (tracer/capture/pylocals.py), also across a loop
inside one function: a recurrent scan written in Python (Mamba's slow path) holds its loop inputs, its
state and its list of per-step outputs until the function returns."""
import os

from test_eager_step import assert_step_matches, predict_and_measure

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "recurrent_scan.py")


def test_a_python_loop_over_the_sequence_keeps_its_locals_until_the_function_returns():
    result, measured = predict_and_measure(FIXTURE, batch=2, seq=32, optimizer="none")
    assert_step_matches(result, measured, peak_phase=measured.peak_phase, phases=("forward", "backward"))
    assert result.phases["forward"].peak_bytes == measured.phase_peaks["forward"]


CHUNKED = os.path.join(os.path.dirname(__file__), "..", "fixtures", "chunked_state_scan.py")


def test_a_chunked_scan_writes_in_place_and_computes_a_state_nothing_reads():
    """Eager writes each chunk's output into the preallocated tensor (forward copy_ through a view, backward
    CopySlices), computes the last state update that the traced graph drops as dead code, and holds the
    padded inputs a tuple target binds."""
    result, measured = predict_and_measure(CHUNKED, batch=2, seq=30, optimizer="none")
    assert_step_matches(result, measured, peak_phase=measured.peak_phase, phases=("forward", "backward"))
    assert result.phases["forward"].peak_bytes == measured.phase_peaks["forward"]
    assert result.phases["backward"].peak_bytes == measured.phase_peaks["backward"]


TUPLE_RETURN = os.path.join(os.path.dirname(__file__), "..", "fixtures", "tuple_return_locals.py")


def test_a_tuple_unpacked_from_a_call_holds_the_local_the_callee_returns():
    """`h, mask, ids = self.embed(x)` with `return embeddings, None, None`: h holds the embeddings until
    forward returns (two of the three names receive no tensor, so the statement's values alone bind none)."""
    result, measured = predict_and_measure(TUPLE_RETURN, batch=2, seq=64, optimizer="none")
    assert_step_matches(result, measured, peak_phase=measured.peak_phase, phases=("forward", "backward"))
    assert result.phases["forward"].peak_bytes == measured.phase_peaks["forward"]


RESIDUAL_WRAPPED = os.path.join(os.path.dirname(__file__), "..", "fixtures", "residual_wrapped_modules.py")


def test_two_modules_forward_in_one_file_under_one_caller_line_are_two_calls():
    """`x + self.module(x)` runs Mix.forward then Mlp.forward from one caller line: Mix's `wide` is let go
    when Mix returns, not held through Mlp's peak as if both were one call of `forward`."""
    result, measured = predict_and_measure(RESIDUAL_WRAPPED, batch=2, seq=64, optimizer="none")
    assert_step_matches(result, measured, peak_phase=measured.peak_phase, phases=("forward", "backward"))
    assert result.phases["forward"].peak_bytes == measured.phase_peaks["forward"]


LAYER_LOOP = os.path.join(os.path.dirname(__file__), "..", "fixtures", "layer_loop_locals.py")


def test_a_one_statement_layer_loop_rebinds_its_local_at_each_call():
    """`for layer in self.layers: h = layer(h)`: the ops of all iterations run on one statement line, one
    after the other; each new call of the layer's forward ends the previous iteration, so the stem's output
    is let go when the first layer returns."""
    result, measured = predict_and_measure(LAYER_LOOP, batch=2, seq=64, optimizer="none")
    assert_step_matches(result, measured, peak_phase=measured.peak_phase, phases=("forward", "backward"))
    assert result.phases["forward"].peak_bytes == measured.phase_peaks["forward"]


RETURNED_TUPLE = os.path.join(os.path.dirname(__file__), "..", "fixtures", "returned_tuple_locals.py")


def test_a_local_bound_to_a_call_holds_the_tuple_the_callee_built_without_ops():
    """`layer_output = stage(x)` with `outputs = (normed,)` ... `return outputs, height, width`: the local holds
    the stage's normed output (not the last op's) until the next iteration's call returns."""
    result, measured = predict_and_measure(RETURNED_TUPLE, batch=2, seq=32, optimizer="none")
    assert_step_matches(result, measured, peak_phase=measured.peak_phase, phases=("forward", "backward"))
    assert result.phases["forward"].peak_bytes == measured.phase_peaks["forward"]


HELD_CONTAINERS = os.path.join(os.path.dirname(__file__), "..", "fixtures", "python_held_containers.py")


def test_the_direct_trace_sees_the_forwards_python_objects_die():
    """A tuple element that is an expression (`return out.view(shape), aux`, bound by `y, aux = ...`), a dict
    and a plain object's attribute holding intermediates, and `scores += bias` through a permuted view:
    no source rule follows these (the source-read holds were 8,192 B under in forward); the direct trace
    watches each object die (capture/python_lifetimes.py) and the step is exact."""
    result, measured = predict_and_measure(HELD_CONTAINERS, batch=2, seq=32)
    assert result.graph.config.capture_path == "aot-joint"
    for phase in ("forward", "backward", "optimizer"):
        assert result.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert result.saved.total_bytes == measured.saved_bytes
