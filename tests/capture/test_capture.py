"""Capture of debug-size reference models: phases, attribution, parameters, optimizer ops."""
import os

import pytest

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.stepgraph import Phase, StorageRole


@pytest.fixture(scope="module")
def llama_graph(llama_debug):
    return llama_debug.policies["eager"].graph


def test_phases_are_in_step_order(llama_graph):
    phases = [op.phase for op in llama_graph.ops]
    first_bw, first_opt = phases.index(Phase.BACKWARD), phases.index(Phase.OPTIMIZER)
    assert set(phases[:first_bw]) == {Phase.FORWARD}
    assert set(phases[first_bw:first_opt]) == {Phase.BACKWARD}
    assert set(phases[first_opt:]) == {Phase.OPTIMIZER}


def test_tied_parameters_share_one_storage_and_one_gradient(llama_graph):
    params = [s for s in llama_graph.storages if s.role is StorageRole.PARAMETER]
    assert len(params) == 20                       # embed/lm_head tied: 21 names, 20 storages
    assert sum(s.nbytes for s in params) == llama_graph.parameter_count * 4
    grads = [s for s in llama_graph.storages if s.role is StorageRole.GRADIENT]
    assert len(grads) == 20


def test_backward_ops_map_to_the_forward_line_and_module(llama_graph):
    forward_mm = [op for op in llama_graph.ops if op.phase is Phase.FORWARD and op.target == "aten.mm.default"
                  and op.module == "blocks.1.attn.wq"]
    backward_mm = [op for op in llama_graph.ops if op.phase is Phase.BACKWARD and op.target == "aten.mm.default"
                   and op.module == "blocks.1.attn.wq"]
    assert len(forward_mm) == 1 and len(backward_mm) == 2          # grad_W and grad_x
    assert {op.source for op in backward_mm} == {forward_mm[0].source}
    assert os.path.basename(forward_mm[0].source.file) == "llama.py"
    assert "self.wq(x)" in forward_mm[0].source.code


def test_helper_function_lines_are_kept(llama_graph):
    rope_ops = [op for op in llama_graph.ops if op.source and op.source.function == "apply_rope"]
    assert rope_ops and all(op.phase in (Phase.FORWARD, Phase.BACKWARD) for op in rope_ops)


def test_optimizer_ops_are_attributed_to_the_optimizer_source(llama_graph):
    opt_ops = [op for op in llama_graph.ops if op.phase is Phase.OPTIMIZER and op.source]
    assert any(op.source.file.endswith("optim/adam.py") for op in opt_ops)
    assert any(op.target == "aten._foreach_sqrt.default" for op in opt_ops)


def test_no_real_memory_is_allocated_for_a_7b_model():
    import resource
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    from tracer.capture.joint import build_fake
    from torch._subclasses.fake_tensor import FakeTensorMode
    model = build_fake(load_model_source("llama-7b"), 1, 16, "fp32", FakeTensorMode()).model
    assert sum(p.numel() for p in model.parameters()) == 6_738_415_616
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 1_000_000   # KiB: far below 27 GB


@pytest.mark.slow
@pytest.mark.parametrize("capture", ["auto", "dispatch"])
def test_a_fused_rnn_module_is_flagged_in_the_report(capture):
    """nn.LSTM runs cuDNN's fused kernel on CUDA, which the traced step does not reproduce (nor the step run
    op by op, which runs the CPU's kernels): never silently off. On the CPU its oneDNN kernel is traced as
    eager runs it (capture/eager_kernels.py), and run op by op it is eager's own C++ path: no note."""
    path = os.path.join(os.path.dirname(__file__), "..", "fixtures", "lstm_lm.py")
    graph = capture_step(load_model_source(path), CaptureOptions(batch=2, seq=8, target="cuda", capture=capture))
    (note,) = [n for n in graph.config.notes if "fused RNN kernel" in n]
    assert note.startswith("rnn: nn.LSTM runs cuDNN's fused RNN kernel")
    graph = capture_step(load_model_source(path), CaptureOptions(batch=2, seq=8, target="cpu", capture=capture))
    assert not [n for n in graph.config.notes if "RNN" in n]


def test_rnn_notes_name_what_the_trace_does_not_reproduce():
    from torch import nn

    from tracer.capture import _fused_module_notes
    model = nn.ModuleDict({"lstm": nn.LSTM(4, 4), "gru": nn.GRU(4, 4), "rnn": nn.RNN(4, 4),
                           "projected": nn.LSTM(4, 8, proj_size=4)})
    (cpu,) = _fused_module_notes(model, cpu=True)
    assert cpu.startswith("rnn, projected: nn.RNN runs ATen's RNN cells")
    (cuda,) = _fused_module_notes(model, cpu=False)
    assert cuda.startswith("lstm, gru, rnn, projected: nn.LSTM runs cuDNN's fused RNN kernel")


@pytest.mark.parametrize("precision", ["fp32", pytest.param("fp16", marks=pytest.mark.slow)])
def test_no_op_is_attributed_to_tracers_own_code(analyzed, precision):
    """Lines point at model code (the zoo's files count as model code), never at tracer's pipeline or
    capture wrappers (fp16's loss scaling runs in the capture's step module)."""
    import tracer
    tracer_dir = os.path.dirname(os.path.abspath(tracer.__file__)) + os.sep
    graph = analyzed("llama-debug", batch=2, seq=32, precision=precision).policies["eager"].graph
    files = {os.path.abspath(op.source.file) for op in graph.ops if op.source is not None}
    assert not [f for f in files if f.startswith(tracer_dir) and not f.startswith(tracer_dir + "models" + os.sep)]
