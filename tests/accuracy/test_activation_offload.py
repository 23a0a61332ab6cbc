"""Activation offloading (save_on_cpu) against real CPU steps measured at the allocator
(tests/truth.py `measure_step_at_allocator`).

On a CPU target, save_on_cpu(pin_memory=True) copies every saved tensor as autograd saves it (on a machine
without CUDA the "pinned" copy is a plain CPU tensor) and backward reads the copy: a real CPU step measures
which tensors are saved, how many copies there are (one per save: a tensor two nodes save is copied twice),
when each is made and when autograd lets go of it. pin_memory=False copies nothing on a CPU target
(`tensor.cpu()` is the tensor itself). The CUDA device view (no saved tensor on the device between forward
and backward, a device copy per node that reads one) cannot be measured here; its tests read the graph.
"""
import os

import pytest
import torch

import tracer
from tracer.capture import load_model_source
from tracer.errors import UsageError
from tracer.passes.host import host_memory
from tracer.stepgraph import Phase, StorageRole
from truth import measure_step_at_allocator

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
SAVED_ON_CPU = os.path.join(FIXTURES, "saved_on_cpu.py")
SCALARS = 24           # the 0-dim scalars (optimizer step counts, the loss) the prediction leaves out


def _fixture(tmp_path, pin_memory: bool) -> str:
    path = tmp_path / f"saved_on_cpu_pin_{pin_memory}.py"
    with open(SAVED_ON_CPU) as f:
        path.write_text(f.read().replace("PIN_MEMORY = True", f"PIN_MEMORY = {pin_memory}"))
    return str(path)


def _measured(model: str, batch: int, seq: int, *, saved_on_cpu: bool = False) -> dict[str, int]:
    source = load_model_source(model)
    torch.manual_seed(0)
    real = source.build_model()
    return measure_step_at_allocator(real, source.example_batch(batch, seq), torch.optim.AdamW(real.parameters()),
                                     saved_on_cpu=saved_on_cpu)


def _predicted(model: str, batch: int, seq: int, **options):
    return tracer.analyze(model, batch=batch, seq=seq, target="cpu", **options).policies["eager"]


def _assert_every_phase_exact(predicted, measured: dict[str, int]) -> None:
    for phase, peak in measured.items():
        assert abs(predicted.phases[phase].peak_bytes - peak) <= SCALARS, (phase, predicted.phases[phase].peak_bytes, peak)


@pytest.mark.parametrize("pin_memory", [True, False])
def test_a_model_files_save_on_cpu_region_is_exact(tmp_path, pin_memory):
    path = _fixture(tmp_path, pin_memory)
    predicted = _predicted(path, 4, 64)
    _assert_every_phase_exact(predicted, _measured(path, 4, 64))
    copies = [n for n in predicted.graph.config.notes if "save_on_cpu" in n]
    assert len(copies) == 1
    assert ("copied to host memory" in copies[0]) is pin_memory and ("nothing is copied" in copies[0]) is not pin_memory


@pytest.mark.parametrize("model", ["llama-debug", os.path.join(FIXTURES, "dropout_zero.py")])
def test_offload_activations_is_save_on_cpu_around_forward_and_loss(model):
    """A tensor two nodes save is copied twice (the RoPE tables, the log-probabilities); a saved input's
    object dies when the forward's Python lets go of it, not when autograd would have."""
    predicted = _predicted(model, 2, 64, offload="activations")
    _assert_every_phase_exact(predicted, _measured(model, 2, 64, saved_on_cpu=True))
    plain = _predicted(model, 2, 64)
    assert predicted.phases["forward"].peak_bytes > plain.phases["forward"].peak_bytes   # copies share the CPU's memory


def test_on_a_cuda_target_no_saved_tensor_stays_on_the_device_between_forward_and_backward():
    analysis = tracer.analyze(SAVED_ON_CPU, batch=4, seq=64)          # the default CUDA target
    graph = analysis.policies["eager"].graph
    first_backward = next(op.index for op in graph.ops if op.phase is Phase.BACKWARD)
    live = _device_intermediates_live_at(graph, first_backward)
    made_by = {v.storage_id: op for op in graph.ops for v in op.outputs}
    # the loss is computed outside the region: only it and what its ops save stay on the device
    assert graph.loss_storage_id in live
    assert all("cross_entropy" in made_by[s].source.code for s in live), [made_by[s].source for s in live]
    host = host_memory(graph)
    assert host is not None and host.saved_bytes > 0
    back = [s for s in graph.storages if s.name.endswith("(back on the device)")]
    assert back and all(not s.host for s in back)
    # the same saves, copied on a CPU target too: the host copies have the same bytes
    cpu = tracer.analyze(SAVED_ON_CPU, batch=4, seq=64, target="cpu").policies["eager"].graph
    assert sum(s.nbytes for s in cpu.storages if s.name.endswith("(saved on the host)")) == host.saved_bytes


def _device_intermediates_live_at(graph, op_index: int) -> set[int]:
    from tracer.passes.liveness import compute_liveness
    liveness = compute_liveness(graph)
    return {iv.storage_id for iv in liveness.intervals
            if graph.storages[iv.storage_id].role is StorageRole.INTERMEDIATE and iv.nbytes
            and iv.alloc_op is not None and iv.alloc_op >= 0 and iv.alloc_op < op_index
            and (iv.free_op is None or iv.free_op >= op_index)}


def test_offload_activations_lowers_the_device_peak_and_reports_the_host():
    offloaded = tracer.analyze("llama-debug", batch=2, seq=64, offload="activations").policies["eager"]
    plain = tracer.analyze("llama-debug", batch=2, seq=64).policies["eager"]
    assert offloaded.peak_bytes < plain.peak_bytes
    assert offloaded.host is not None and offloaded.host.saved_bytes >= plain.saved.activation_bytes


def test_offload_activations_is_refused_with_a_recompute_policy():
    with pytest.raises(UsageError, match="--offload activations"):
        tracer.analyze("llama-debug", batch=2, seq=64, offload="activations", policies=("full",))


def test_saved_tensor_hooks_the_capture_does_not_run_are_named():
    predicted = _predicted(os.path.join(FIXTURES, "foreign_saved_hooks.py"), 2, 8)
    assert any("foreign_saved_hooks.pack" in n and "not run by the capture" in n for n in predicted.graph.config.notes)


def test_a_custom_functions_forward_is_not_taken_for_foreign_hooks():
    """The capture's own hooks, active around a custom Function's forward, are not the user's."""
    predicted = _predicted(os.path.join(FIXTURES, "autograd_holds.py"), 2, 8)
    assert not any("saved-tensor hooks" in n for n in predicted.graph.config.notes)


def test_a_step_run_op_by_op_runs_the_loops_save_on_cpu_itself():
    """The op-by-op path (a second-order step, a quantized base, --capture dispatch) runs save_on_cpu's own
    hooks on the fake tensors: a CPU view, exact as the graph path is."""
    model = os.path.join(FIXTURES, "dropout_zero.py")
    predicted = _predicted(model, 2, 64, offload="activations", capture="dispatch")
    _assert_every_phase_exact(predicted, _measured(model, 2, 64, saved_on_cpu=True))


def test_offload_activations_under_gradient_accumulation():
    """Two micro-batches, each forward under save_on_cpu(pin_memory=True), then one optimizer step: every
    phase's peak over the micro-batches is the real loop's."""
    import contextlib

    from torch.profiler import record_function

    from truth import peaks_at_allocator
    predicted = _predicted("llama-debug", 2, 64, offload="activations", accumulate=2)
    source = load_model_source("llama-debug")
    torch.manual_seed(0)
    model = source.build_model()
    optimizer = torch.optim.AdamW(model.parameters())
    batches = [source.example_batch(2, 64) for _ in range(2)]

    def step(ranged: bool):
        def phase(name):
            return record_function(f"phase:{name}") if ranged else contextlib.nullcontext()
        loss = None
        for batch in batches:
            with phase("forward"), torch.autograd.graph.save_on_cpu(pin_memory=True):
                loss = model(*batch)
            with phase("backward"):
                loss.backward()
        with phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loss = None

    step(False)
    measured = peaks_at_allocator(step, model, batches[0] + batches[1], optimizer)
    for phase, peak in measured.items():
        worst = max(p.peak_bytes for name, p in predicted.phases.items() if name.startswith(phase))
        assert abs(worst - peak) <= SCALARS, (phase, worst, peak)
