"""capture/eager_kernels.py: while tracing, ops give their outputs the layout eager's kernels give them."""
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tracer.capture.eager_kernels import CONTIGUOUS_IN_EAGER, layouts_as_in_eager


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
