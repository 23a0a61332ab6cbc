"""capture/eager_kernels.py: while tracing, ops give their outputs the layout eager's kernels give them."""
import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tracer.capture.eager_kernels import (CONTIGUOUS_IN_EAGER, SUGGESTED_FORMAT_IN_EAGER, layouts_as_in_eager,
                                         norm_statistics_as_in_eager)


def _layer_norm_grad_input_strides():
    x = torch.randn(2, 12, 16)
    weight, bias = torch.randn(16), torch.randn(16)
    _, mean, rstd = torch.ops.aten.native_layer_norm(x, [16], weight, bias, 1e-5)
    grad_out = torch.randn(2, 16, 12).transpose(1, 2)           # transposed, as after a permute
    grad_input, _, _ = torch.ops.aten.native_layer_norm_backward(grad_out, x, [16], mean, rstd, weight, bias,
                                                                 [True, True, True])
    return grad_input.stride()


def test_the_table_names_what_the_cpu_kernel_does():
    assert set(CONTIGUOUS_IN_EAGER) == {"aten.native_layer_norm_backward.default"}
    assert _layer_norm_grad_input_strides() == (192, 16, 1)     # the real CPU kernel: contiguous


def test_traced_layer_norm_grad_input_has_the_eager_layout_and_only_while_tracing():
    with FakeTensorMode(), layouts_as_in_eager():
        assert _layer_norm_grad_input_strides() == (192, 16, 1)
    with FakeTensorMode():
        assert _layer_norm_grad_input_strides() == (192, 1, 12)  # torch's decomposition follows grad_out


# inputs of 8 channels in three layouts: a transposed 3-d one (BatchNorm1d over `x.transpose(1, 2)`), a
# channels-last 4-d one and a 4-d one permuted into no memory format
_BATCH_NORM_INPUTS = {"transposed 3-d": lambda: torch.randn(2, 16, 8).transpose(1, 2),
                      "channels-last 4-d": lambda: torch.randn(2, 8, 4, 4).to(memory_format=torch.channels_last),
                      "permuted 4-d": lambda: torch.randn(2, 4, 8, 4).permute(0, 2, 1, 3)}


def _batch_norm_strides(make_input) -> dict[str, tuple]:
    """The strides of the output (forward ops) or grad_input (backward) of each batch norm kernel that runs
    on the CPU, for one input layout."""
    aten = torch.ops.aten
    torch.manual_seed(0)
    x = make_input()
    weight, bias, mean, var = torch.ones(8), torch.zeros(8), torch.zeros(8), torch.ones(8)
    out, save_mean, save_invstd = aten.native_batch_norm(x, weight, bias, mean.clone(), var.clone(), True, 0.1, 1e-5)
    grad_out = torch.randn_like(x)
    return {
        "aten.native_batch_norm.default": out.stride(),
        "aten._native_batch_norm_legit.default":
            aten._native_batch_norm_legit(x, weight, bias, mean.clone(), var.clone(), True, 0.1, 1e-5)[0].stride(),
        "aten._native_batch_norm_legit_functional.default":
            aten._native_batch_norm_legit_functional(x, weight, bias, mean, var, True, 0.1, 1e-5)[0].stride(),
        "aten._native_batch_norm_legit_no_training.default":
            aten._native_batch_norm_legit_no_training(x, weight, bias, mean, var, 0.1, 1e-5)[0].stride(),
        "aten._batch_norm_with_update.default":
            aten._batch_norm_with_update(x, weight, bias, mean.clone(), var.clone(), 0.1, 1e-5)[0].stride(),
        "aten._batch_norm_no_update.default":
            aten._batch_norm_no_update(x, weight, bias, mean, var, 0.1, 1e-5)[0].stride(),
        "aten.native_batch_norm_backward.default":
            aten.native_batch_norm_backward(grad_out, x, weight, mean, var, save_mean, save_invstd, True, 1e-5,
                                            [True, True, True])[0].stride(),
    }


@pytest.mark.parametrize("layout", _BATCH_NORM_INPUTS)
def test_traced_batch_norm_allocates_in_the_inputs_suggested_format_as_the_cpu_kernels_do(layout):
    """Batch norm's kernels allocate their output and grad_input in the input's suggested memory format:
    contiguous but for a channels-last 4-d input. torch's decompositions keep a transposed input's strides."""
    real = _batch_norm_strides(_BATCH_NORM_INPUTS[layout])
    assert set(real) <= set(SUGGESTED_FORMAT_IN_EAGER)
    with FakeTensorMode(allow_non_fake_inputs=True), layouts_as_in_eager():
        assert _batch_norm_strides(_BATCH_NORM_INPUTS[layout]) == real
    if layout == "transposed 3-d":
        assert real["aten.native_batch_norm.default"] == (128, 16, 1)            # contiguous
        with FakeTensorMode(allow_non_fake_inputs=True):                            # torch's own fake kernel
            assert _batch_norm_strides(_BATCH_NORM_INPUTS[layout])["aten.native_batch_norm.default"] == (128, 1, 8)


def test_a_batch_norm_over_a_transposed_input_steps_exactly_on_both_rungs():
    """BatchNorm1d over `up(x).transpose(1, 2)`, transposed back into a linear: eager's contiguous output
    makes the linear copy its transposed input and save the copy (16,384 B the traced step missed)."""
    for capture in ("auto", "dispatch"):
        _cpu_step_exact("batchnorm_shared_head.py", 2, 16, capture=capture)


def _layer_norm_statistics_dtypes(x_dtype, parameter_dtype):
    x = torch.randn(2, 8, 16, dtype=x_dtype)
    weight = bias = None if parameter_dtype is None else torch.ones(16, dtype=parameter_dtype)
    out, mean, rstd = torch.ops.aten.native_layer_norm(x, [16], weight, bias, 1e-5)
    return out.dtype, mean.dtype, rstd.dtype


def test_layer_norm_statistics_take_the_dtype_the_targets_kernel_gives_them():
    """Mean and rstd, which autograd saves: the CPU kernel makes them fp32 when a 16-bit input meets fp32
    parameters (autocast's case), else in the input's dtype; CUDA's always in the accumulation type. torch's
    fake kernel gives a CPU tensor the input's dtype in both cases."""
    bf16, fp32 = torch.bfloat16, torch.float32
    cases = [(bf16, fp32), (bf16, bf16), (bf16, None), (torch.float16, fp32), (fp32, fp32)]
    real = [_layer_norm_statistics_dtypes(*case) for case in cases]       # the CPU kernel itself
    assert real[0] == (bf16, fp32, fp32) and real[1] == (bf16, bf16, bf16)
    with FakeTensorMode():
        assert _layer_norm_statistics_dtypes(bf16, fp32) == (bf16, bf16, bf16)     # torch's fake kernel
        with norm_statistics_as_in_eager(cpu=True):
            assert [_layer_norm_statistics_dtypes(*case) for case in cases] == real
        with norm_statistics_as_in_eager(cpu=False):
            assert [_layer_norm_statistics_dtypes(*case)[1] for case in cases] == [fp32, fp32, fp32, fp32, fp32]
        assert _layer_norm_statistics_dtypes(bf16, fp32) == (bf16, bf16, bf16)     # restored on the way out


def _group_norm_statistics_dtypes(x_dtype, parameter_dtype):
    x = torch.randn(2, 8, 16, dtype=x_dtype)
    weight = bias = None if parameter_dtype is None else torch.ones(8, dtype=parameter_dtype)
    out, mean, rstd = torch.ops.aten.native_group_norm(x, weight, bias, 2, 8, 16, 4, 1e-5)
    return out.dtype, mean.dtype, rstd.dtype, tuple(mean.shape)


def test_group_norm_statistics_take_the_dtype_the_kernel_gives_them_on_either_device():
    """group_norm.cpp chooses the statistics' dtype for every device: fp32 for a 16-bit input with fp32
    parameters, else the input's; torch's fake kernel gives the input's dtype."""
    bf16, fp32 = torch.bfloat16, torch.float32
    cases = [(bf16, fp32), (bf16, bf16), (bf16, None), (fp32, fp32)]
    real = [_group_norm_statistics_dtypes(*case) for case in cases]
    assert real[0] == (bf16, fp32, fp32, (2, 4))
    with FakeTensorMode():
        assert _group_norm_statistics_dtypes(bf16, fp32)[1] == bf16
        for cpu in (True, False):
            with norm_statistics_as_in_eager(cpu=cpu):
                assert [_group_norm_statistics_dtypes(*case) for case in cases] == real
        assert _group_norm_statistics_dtypes(bf16, fp32)[1] == bf16


def test_interpolate_traces_as_the_eager_kernel_and_its_backward_exactly():
    """F.interpolate's Python decomposition saves index tensors eager never makes (an `arange` per axis for
    nearest); traced as ATen's upsample kernels, the step equals a real CPU step's."""
    import os

    from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
    from tracer.passes.analysis import analyze_graphs
    from truth import measure_step

    source = load_model_source(os.path.join(os.path.dirname(__file__), "..", "fixtures", "upsampling.py"))
    graph = capture_steps(source, CaptureOptions(batch=2, seq=8, target="cpu"), (PolicySpec(name="eager"),))["eager"]
    targets = [op.target for op in graph.ops]
    assert {"aten.upsample_nearest2d.default", "aten.upsample_nearest2d_backward.default",
            "aten.upsample_bilinear2d.default", "aten.upsample_bilinear2d_backward.default"} <= set(targets)
    assert "aten._unsafe_index.Tensor" not in targets
    predicted = analyze_graphs({"eager": graph}).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(2, 8), torch.optim.AdamW(model.parameters()))
    assert {name: p.peak_bytes for name, p in predicted.phases.items()} == measured.phase_peaks
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert torch.ops.aten.upsample_nearest2d.vec.py_kernels        # torch's own kernels are back afterwards


def _cpu_step_exact(fixture: str, batch: int, seq: int, capture: str = "auto"):
    """A fixture's traced CPU step (eager policy) against a real CPU step: every phase's peak and the saved
    bytes. Returns the graph."""
    import os

    from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
    from tracer.passes.analysis import analyze_graphs
    from truth import measure_step

    source = load_model_source(os.path.join(os.path.dirname(__file__), "..", "fixtures", fixture))
    graph = capture_steps(source, CaptureOptions(batch=batch, seq=seq, target="cpu", capture=capture),
                          (PolicySpec(name="eager"),))["eager"]
    predicted = analyze_graphs({"eager": graph}).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(batch, seq), torch.optim.AdamW(model.parameters()))
    assert {name: p.peak_bytes for name, p in predicted.phases.items()} == measured.phase_peaks
    assert predicted.saved.total_bytes == measured.saved_bytes
    return graph


@pytest.mark.parametrize("capture", ["auto", "dispatch"])
def test_lstm_traces_as_onednns_rnn_with_its_workspace_exactly(capture):
    """nn.LSTM on the CPU runs oneDNN's RNN in training (one mkldnn_rnn_layer per layer, saving a workspace
    of oneDNN's own size, and one bias gradient per bias); torch's decomposition traced it cell by cell and
    predicted 52% of the saved bytes. Run op by op, the C++ kernel reaches oneDNN's layer itself, whose fake
    kernel gave an empty workspace."""
    from torch._C import DispatchKey
    graph = _cpu_step_exact("lstm_lm.py", 2, 16, capture=capture)
    layers = [op for op in graph.ops if op.target == "aten.mkldnn_rnn_layer.default"]
    assert len(layers) == 2
    assert all(graph.storage(op.outputs[3].storage_id).nbytes > 0 for op in layers)      # the workspace
    assert capture == "dispatch" or not graph.config.notes                                # nothing flagged
    meta = torch.ops.aten.mkldnn_rnn_layer.default.py_kernels[DispatchKey.Meta]
    assert meta.__module__ == "torch._meta_registrations"                                 # torch's own again


@pytest.mark.parametrize("capture", ["auto", "dispatch"])
def test_gru_traces_as_atens_in_place_cells_exactly(capture):
    """nn.GRU on the CPU runs ATen's GRU cells: the gates computed in place into each step's hidden
    projection (`unsafe_chunk` pieces written one by one); torch's decomposition computes them out of place
    (two more tensors saved per step)."""
    graph = _cpu_step_exact("gru_lm.py", 2, 16, capture=capture)
    assert "aten.unsafe_split.Tensor" in {op.target for op in graph.ops}


def test_the_workspace_size_is_the_cpu_kernels():
    from tracer.capture.eager_kernels import mkldnn_rnn_workspace_nbytes
    x, w0, w1, b = torch.randn(7, 5, 33), torch.randn(200, 33), torch.randn(200, 50), torch.randn(200)
    hx = torch.zeros(5, 50)
    args = (x, w0, w1, b, b, hx, hx, False, [], 2, 50, 1, True, False, False, True)
    assert mkldnn_rnn_workspace_nbytes(args) == torch.ops.aten.mkldnn_rnn_layer.default(*args)[3].nbytes
