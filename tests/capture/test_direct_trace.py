"""The direct trace (the joint graph traced from the module with tracer's own source metadata) gives the
same step as exporting first, op for op: same ops, modules, lines, storages and liveness."""
import dataclasses
import os

import pytest
import torch

import tracer.capture as capture
from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
from tracer.passes.liveness import compute_liveness
from tracer.stepgraph import StorageRole
from truth import measure_step

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")


def _capture(model, options, policies, *, direct):
    real = capture.export_joint

    def front_end(*args, direct=False, _use=direct, **kwargs):
        return real(*args, direct=_use, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(capture, "export_joint", front_end)
        return capture_steps(load_model_source(model), options, tuple(PolicySpec(name=p) for p in policies))


def _signature(graph):
    """Ops, storages and when each storage is allocated and freed, apart from how long the forward's Python
    code holds it (`held_until_op`): the direct trace sees the Python objects die, the exported one reads
    the source (capture/pylocals.py), and where the two differ the direct trace is the one a real step
    confirms (test_python_holds_observed_by_the_direct_trace_are_exact)."""
    ops = [(op.target, op.phase, op.module, op.recomputed, op.source and (op.source.file, op.source.line),
            tuple(getattr(v, "storage_id", None) for v in op.outputs)) for op in graph.ops]
    storages = [(s.nbytes, s.role, s.released_after_op, s.persistent, s.fused) for s in graph.storages]
    unheld = dataclasses.replace(graph, storages=tuple(dataclasses.replace(s, held_until_op=None)
                                                       for s in graph.storages))
    lifetimes = [(iv.alloc_op, iv.free_op) for iv in compute_liveness(unheld).intervals]
    return ops, storages, lifetimes


@pytest.mark.parametrize("model,precision", [
    ("llama-debug", "fp32"),                                    # tied embedding and head
    ("llama-debug", "bf16"),
    ("gpt2-debug", "fp32"),
    (os.path.join(FIXTURES, "batchnorm_shared_head.py"), "fp32"),
])
@pytest.mark.slow
def test_the_direct_trace_equals_the_exported_one(model, precision):
    options = CaptureOptions(batch=2, seq=32, precision=precision)
    policies = ("eager", "compiled") if "batchnorm" in model else ("eager", "compiled", "full")   # no blocks
    direct = _capture(model, options, policies, direct=True)
    exported = _capture(model, options, policies, direct=False)
    assert direct["eager"].config.capture_path == "aot-joint"
    assert exported["eager"].config.capture_path == "export-joint"
    for policy in policies:
        assert _signature(direct[policy]) == _signature(exported[policy]), policy


@pytest.mark.slow
def test_a_model_that_checkpoints_is_exported():
    """Export drops torch.utils.checkpoint, and tracer re-applies it from a fake run of the forward; the
    direct trace has no such run, so the model takes the export path, quietly (no note: nothing failed)."""
    graphs = capture_steps(load_model_source(os.path.join(FIXTURES, "user_checkpoint.py")),
                           CaptureOptions(batch=2, seq=16), (PolicySpec(name="eager"),))
    assert graphs["eager"].config.capture_path == "export-joint"
    assert not any("next capture path" in note for note in graphs["eager"].config.notes)


@pytest.mark.slow
def test_tensors_kept_on_module_attributes_keep_the_direct_trace():
    """The direct trace counts the tensors the forward stores on module attributes, and one plain fake run
    of the forward then says which and where: the model keeps the direct path, and its step is the
    exported one's, the kept tensors included."""
    model = os.path.join(FIXTURES, "attribute_cache.py")
    options = CaptureOptions(batch=2, seq=16)
    direct = _capture(model, options, ("eager",), direct=True)
    exported = _capture(model, options, ("eager",), direct=False)
    assert direct["eager"].config.capture_path == "aot-joint"
    assert _signature(direct["eager"]) == _signature(exported["eager"])
    kept = [note for note in direct["eager"].config.notes if "keeps a" in note and "past the step" in note]
    assert [note.split(" keeps")[0] for note in kept] == ["blocks.0.cache", "blocks.1.cache"]


def test_batchnorm_buffers_and_a_module_under_two_names():
    """The running stats come before the loss in the joint's outputs and are updated in place; the head
    reachable as `head` and `head2` is one set of parameters. Parameters, optimizer state and the
    optimizer phase equal a real step exactly. (Forward and backward are not compared: CPU eager
    batch norm on a transposed input holds 32 KiB more than the graph's functional batch norm.)"""
    model = os.path.join(FIXTURES, "batchnorm_shared_head.py")
    source = load_model_source(model)
    options = CaptureOptions(batch=4, seq=16)
    graph = capture_steps(source, options, (PolicySpec(name="eager"),))["eager"]
    predicted = analyze_graphs({"eager": graph}).policies["eager"]
    loss = graph.storages[graph.loss_storage_id]
    assert loss.nbytes == 4 and loss.shape == ()
    updated = [s for s in graph.storages if "updated in place" in s.name]
    assert sorted(s.name for s in updated) == ["bn.num_batches_tracked (updated in place)",
                                               "bn.running_mean (updated in place)",
                                               "bn.running_var (updated in place)"]
    assert all(s.fused for s in updated)
    params = [s for s in graph.storages if s.role is StorageRole.PARAMETER]
    assert len(params) == 6 and graph.parameter_count == 64 * 128 + 128 + 2 * 128 + 128 * 10 + 10
    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step(real, source.example_batch(4, 16), torch.optim.AdamW(real.parameters(), lr=1e-3))
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.phases["optimizer"].peak_bytes == measured.phase_peaks["optimizer"]


@pytest.mark.slow
def test_python_holds_observed_by_the_direct_trace_are_exact():
    """Under bf16 autocast the RMSNorm output passed to `self.attn(self.attn_norm(x), ...)` is an fp32
    tensor that Attention.forward's `x` holds until it returns; the direct trace sees that object die
    there (capture/python_lifetimes.py) and the step equals a real one."""
    from tracer.capture.build import StepModule
    source = load_model_source("llama-debug")
    options = CaptureOptions(batch=2, seq=32, precision="bf16", target="cpu")
    graphs = capture_steps(source, options, (PolicySpec(name="eager"),))
    assert graphs["eager"].config.capture_path == "aot-joint"
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(StepModule(model, loss_fn=source.loss_fn, loss_index=source.loss_index),
                            source.example_batch(2, 32), torch.optim.AdamW(model.parameters(), lr=1e-3),
                            precision="bf16")
    for phase in ("forward", "backward", "optimizer"):
        assert abs(predicted.phases[phase].peak_bytes - measured.phase_peaks[phase]) <= 8, phase   # a 0-dim scalar


def test_value_reads_of_constants_stay_on_the_direct_trace_and_are_exact():
    """`if mask.sum() == mask.numel()` on `torch.ones(b, s)` and `0 in tokens[:, [-1, 0]]` (a constant index
    list): the direct trace answers both as eager does (capture/routing.py's shadows: a float factory of
    determined values, a constant lifted into the trace, the random batch's own draw), keeps the model on
    `aot-joint` and takes eager's branch (is_causal SDPA, nothing explicit saved)."""
    from tracer.capture.build import StepModule
    source = load_model_source(os.path.join(FIXTURES, "constant_value_reads.py"))
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=16, target="cpu"), (PolicySpec(name="eager"),))
    graph = graphs["eager"]
    assert graph.config.capture_path == "aot-joint"
    notes = " ".join(graph.config.notes)
    assert "made from constants" in notes and "constant_value_reads.py:26" in notes and "exactly" in notes
    assert "constant_value_reads.py:21" in notes and "tracer's own draw" in notes
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(StepModule(model, loss_fn=source.loss_fn, loss_index=source.loss_index),
                            source.example_batch(2, 16), torch.optim.AdamW(model.parameters(), lr=1e-3))
    for phase in ("forward", "backward", "optimizer"):
        assert predicted.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert predicted.saved.total_bytes == measured.saved_bytes


def test_a_branch_on_random_floats_is_not_answered():
    """A value read of activations (random weights times a random input) is never taken as known: the
    direct trace stops and the ladder goes on (tests/fixtures/data_dependent.py, export names the line)."""
    with pytest.raises(capture.CaptureError, match="data_dependent.py:13"):
        capture_steps(load_model_source(os.path.join(FIXTURES, "data_dependent.py")),
                      CaptureOptions(batch=2, seq=4, target="cpu", capture="export"), (PolicySpec(name="eager"),))
