"""Silent mispredictions where a real step differs (issue 16): each case is exact against a real CPU step,
refused with one line (exit 3), or flagged in the report, never silently off."""
import pytest
import torch

from conftest import TINY, model
from tracer.errors import ExitCode


def one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def test_mse_loss_keeps_its_elementwise_storage_exact_vs_a_real_cpu_step():
    """F.mse_loss's 0-dim loss holds a storage of the elementwise loss's size (B x 256 floats) on CPU: every
    phase was 4,092 B low before the rule (tracer/capture/eager_kernels.py REDUCED_KEEPS_ELEMENTWISE)."""
    from tracer.capture import CaptureOptions, capture_step, load_model_source
    from tracer.passes.analysis import analyze_graph
    from truth import measure_step

    source = load_model_source(model("mse_loss"))
    result = analyze_graph(capture_step(source, CaptureOptions(batch=4, seq=8, target="cpu"))).policies["eager"]
    torch.manual_seed(0)
    real = source.build_model()
    opt = torch.optim.AdamW(real.parameters(), lr=1e-3)
    measured = measure_step(real, source.example_batch(4, 8), opt)
    assert result.start_bytes == measured.start_bytes
    assert result.peak_bytes == measured.peak_bytes and result.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        assert result.phases[phase].peak_bytes == measured.phase_peaks[phase], phase
    assert result.saved.total_bytes == measured.saved_bytes


def _loss_cases():
    x, t = torch.randn(4, 32), torch.randn(4, 32)
    p, sign = torch.rand(4, 32), torch.randint(0, 2, (4, 32)).float() * 2 - 1
    aten = torch.ops.aten
    return {
        "aten.mse_loss.default": lambda r: aten.mse_loss(x, t, r),
        "aten.smooth_l1_loss.default": lambda r: aten.smooth_l1_loss(x, t, r, 1.0),
        "aten.soft_margin_loss.default": lambda r: aten.soft_margin_loss(x, sign, r),
        "aten.binary_cross_entropy.default": lambda r: aten.binary_cross_entropy(p, p.round(), None, r),
        "aten.huber_loss.default": lambda r: aten.huber_loss(x, t, r, 1.0),
        "aten.l1_loss.default": lambda r: aten.l1_loss(x, t, r),
        "aten.binary_cross_entropy_with_logits.default":
            lambda r: aten.binary_cross_entropy_with_logits(x, p, None, None, r),
        "aten.kl_div.default": lambda r: aten.kl_div(x, p, r),
        "aten.hinge_embedding_loss.default": lambda r: aten.hinge_embedding_loss(x, sign, 1.0, r),
        "aten.mse_loss.default broadcast": lambda r: aten.mse_loss(x, t[0], r),
        "aten.mse_loss.default bf16 input": lambda r: aten.mse_loss(x.bfloat16(), t, r),
    }


@pytest.mark.parametrize("reduction", [1, 2])
@pytest.mark.parametrize("name", list(_loss_cases()))
def test_the_elementwise_storage_table_matches_the_real_cpu_kernels(name, reduction):
    """Which reduced losses keep an elementwise-sized storage in eager, checked against the real kernels:
    the table holds exactly the ones that do, with the bytes they hold."""
    from tracer.capture.eager_kernels import REDUCED_KEEPS_ELEMENTWISE
    from tracer.stepgraph import TensorValue
    torch.manual_seed(0)
    out = _loss_cases()[name](reduction)
    real_bytes = out.untyped_storage().nbytes()
    target = name.split()[0]
    assert (real_bytes > out.numel() * out.element_size()) == (target in REDUCED_KEEPS_ELEMENTWISE)
    if target in REDUCED_KEEPS_ELEMENTWISE:
        from tracer.capture.eager_kernels import reduced_loss_nbytes
        shape = (4, 32) if "broadcast" not in name else (32,)
        args = (TensorValue(0, (4, 32), "float32"), TensorValue(1, shape, "float32"))
        if target == "aten.binary_cross_entropy.default":
            args += (None,)
        assert reduced_loss_nbytes(target, args + (reduction,), {}, "float32") == real_bytes
        assert reduced_loss_nbytes(target, args + (0,), {}, "float32") is None       # reduction='none': its own shape


@pytest.mark.parametrize("name, needle", [
    ("inplace_on_leaf_view", "inplace_on_leaf_view.py:14: forward runs mul_ in place on a view of the parameter lin.weight"),
    ("inplace_on_leaf", "inplace_on_leaf.py:13: forward runs add_ in place on the parameter lin.weight"),
])
@pytest.mark.parametrize("capture", ["auto", "export"])
def test_inplace_on_a_parameter_with_grad_enabled_is_refused_as_eager_refuses_it(run_cli, name, needle, capture):
    """Eager raises "a [view of a] leaf Variable that requires grad is being used in an in-place operation";
    the direct AOT trace functionalized the op and predicted the step as if it ran."""
    code, out, err = run_cli(model(name), *TINY, "--capture", capture)
    line = one_line(err)
    assert code == ExitCode.ANALYSIS and out == ""
    assert needle in line and "torch.no_grad()" in line


def test_inplace_on_parameters_under_no_grad_is_predicted(run_cli):
    """EMA and weight renormalisation update parameters in place under torch.no_grad(): eager allows it."""
    code, out, err = run_cli(model("inplace_under_no_grad"), *TINY)
    assert code == ExitCode.OK, err
    assert "peak:" in out
