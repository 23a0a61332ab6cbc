"""Every optimizer people train with, from make_optimizer in a model file, predicted for a CPU target and
measured on a real CPU step at the allocator (tests/truth.py `measure_step_at_allocator`, which also sees
inside custom-op kernels and compiled code): every phase's peak within 0.1% and the peak in the same
phase. torch.optim, bitsandbytes (CPU kernels traced), torchao (compiled per-parameter updates planned by
Inductor, quantized moments as tensor subclasses), pytorch_optimizer, lion-pytorch, schedulefree (stepped
in train mode) and heavyball (compiled at import). The known gaps are strict xfails with their measured
size; docs/guides/optimizers.md lists all of them."""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph
from truth import measure_step_at_allocator

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "library_optimizer_net.py")

STEADY = [
    *(f"torch.optim:{name}" for name in ("SGD", "Adam", "AdamW", "Adamax", "NAdam", "RAdam", "Adagrad",
                                         "Adadelta", "RMSprop", "Rprop", "ASGD", "Adafactor")),
    *(f"bitsandbytes.optim:{name}" for name in ("AdamW8bit", "PagedAdamW8bit", "AdamW", "Lion8bit",
                                                "AdEMAMix8bit", "RMSprop8bit", "Adagrad8bit")),
    *(f"torchao.optim:{name}" for name in ("AdamW8bit", "Adam4bit", "AdamW4bit", "AdamWFp8", "_AdamW")),
    *(f"pytorch_optimizer:{name}" for name in ("AdEMAMix", "ADOPT", "Prodigy", "SOAP", "Lion", "AdaFactor")),
    "lion_pytorch:Lion", "schedulefree:AdamWScheduleFree", "schedulefree:SGDScheduleFree", "heavyball:AdamW",
    "heavyball:SOAP",                # torch.linalg.qr in its compiled step: LAPACK's workspaces counted
]
FIRST = ["torch.optim:SGD", "torch.optim:AdamW", "torch.optim:Adafactor", "torchao.optim:AdamW8bit",
         "torchao.optim:AdamW4bit", "bitsandbytes.optim:AdamW8bit", "bitsandbytes.optim:Lion8bit",
         "lion_pytorch:Lion", "schedulefree:AdamWScheduleFree", "heavyball:AdamW",
         "pytorch_optimizer:SOAP"]      # its preconditioners start from torch.linalg.eigh: LAPACK's workspace
GAPS = [
    pytest.param("heavyball:Muon", "steady", marks=pytest.mark.xfail(strict=True, reason=(
        "heavyball's Muon: the optimizer phase 1.05% low (24,504,224 B against 24,764,968 B): oneDNN's "
        "scratchpad inside each bf16 matmul (260,736 B), flagged in the report"))),
]


SECOND_ORDER = ["pytorch_optimizer:SophiaH", "pytorch_optimizer:AdaHessian"]   # the loop: backward(create_graph=True)


def _model_file(tmp_path, optimizer: str, *, create_graph: bool = False) -> str:
    pytest.importorskip(optimizer.partition(":")[0].partition(".")[0])
    with open(FIXTURE) as f:
        text = f.read().replace('OPTIMIZER = "bitsandbytes.optim:AdamW8bit"', f'OPTIMIZER = "{optimizer}"')
    text += "\ncreate_graph = True\n" if create_graph else ""
    path = tmp_path / "net.py"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize("optimizer,step", [*((o, "steady") for o in STEADY), *((o, "first") for o in FIRST),
                                            *GAPS])
def test_optimizer_step_at_the_allocator(tmp_path, optimizer, step):
    path = _model_file(tmp_path, optimizer)
    source = load_model_source(path)
    predicted = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=8, target="cpu", step=step))
                              ).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step_at_allocator(model, source.example_batch(2, 8), source.make_optimizer(model.parameters()),
                                         steady=step == "steady")
    for phase, peak in measured.items():
        assert abs(predicted.phases[phase].peak_bytes - peak) <= peak * 0.001, (phase, predicted.phases[phase].peak_bytes, peak)
    assert predicted.peak_phase == max(measured, key=measured.get)
    state = [s for s in predicted.graph.storages if s.role.value == "optimizer_state"]
    assert optimizer.startswith(("torch.optim:SGD", "schedulefree:SGD")) or state, "the bill names no optimizer state"


@pytest.mark.parametrize("optimizer", ["heavyball:PSGDKron"])
def test_heavyball_run_eagerly_at_the_allocator(tmp_path, monkeypatch, optimizer):
    """heavyball with `heavyball.utils.compile_mode = None` (its switch to run eagerly). PSGDKron's compiled
    step is predicted too, but its real CPU step cannot be measured here: Inductor's C++ lowering of its
    psgd_update_precond fails (an assertion in torch/_inductor/ir.py) on this torch."""
    import heavyball.utils
    monkeypatch.setattr(heavyball.utils, "compile_mode", None)
    source = load_model_source(_model_file(tmp_path, optimizer))
    predicted = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=8, target="cpu"))).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step_at_allocator(model, source.example_batch(2, 8), source.make_optimizer(model.parameters()))
    for phase, peak in measured.items():
        assert abs(predicted.phases[phase].peak_bytes - peak) <= peak * 0.001, (phase, predicted.phases[phase].peak_bytes, peak)


@pytest.mark.parametrize("step", ["steady", "first"])
@pytest.mark.parametrize("optimizer", SECOND_ORDER)
def test_second_order_step_at_the_allocator(tmp_path, optimizer, step):
    """The loop calls loss.backward(create_graph=True) and the step differentiates the gradients (a Hessian
    estimate): run op by op, every phase within 0.1% of the real step and the gradients billed as such."""
    source = load_model_source(_model_file(tmp_path, optimizer, create_graph=True))
    predicted = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=8, target="cpu", step=step))
                              ).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step_at_allocator(model, source.example_batch(2, 8), source.make_optimizer(model.parameters()),
                                         steady=step == "steady", create_graph=True)
    for phase, peak in measured.items():
        assert abs(predicted.phases[phase].peak_bytes - peak) <= peak * 0.001, (phase, predicted.phases[phase].peak_bytes, peak)
    assert predicted.peak_phase == max(measured, key=measured.get)
    roles = {s.role.value for s in predicted.graph.storages}
    assert {"gradient", "optimizer_state"} <= roles


@pytest.mark.parametrize("optimizer,kernel", [("heavyball:Muon", "reduced-precision matmuls")])
def test_kernel_scratch_the_step_does_not_count_is_flagged(tmp_path, optimizer, kernel):
    """The known gap above is a kernel workspace the allocator sees inside one call: the report names
    the kernel, and the optimizer phase is low by less than one such workspace per live call (under 1.1%)."""
    path = _model_file(tmp_path, optimizer)
    source = load_model_source(path)
    predicted = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=8, target="cpu"))).policies["eager"]
    notes = [n for n in predicted.graph.config.notes if n.startswith("kernel scratch not counted")]
    assert len(notes) == 1 and kernel in notes[0]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step_at_allocator(model, source.example_batch(2, 8), source.make_optimizer(model.parameters()),
                                         steady=True)
    assert 0 <= measured["optimizer"] - predicted.phases["optimizer"].peak_bytes <= measured["optimizer"] * 0.011
