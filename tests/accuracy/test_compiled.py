"""The compiled policy's saved set vs what torch.compile really saves on CPU: a capturing AOT backend records
the compiled forward graph's outputs beyond the user outputs (the saved activations), deduplicated by
storage, without the graph's own inputs (parameters, token ids), which our `activation_bytes` also omits."""
import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.partitioners import min_cut_rematerialization_partition

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs


def _real_compiled_saved_bytes(model, batch) -> int:
    seen = {}

    def partition(joint, inputs, **kwargs):
        seen["num_fwd_outputs"] = kwargs["num_fwd_outputs"]
        return min_cut_rematerialization_partition(joint, inputs, **kwargs)

    def forward_compiler(gm, inputs):
        seen["forward"] = gm
        return gm

    torch._dynamo.reset()
    compiled = torch.compile(model, dynamic=False, backend=aot_autograd(
        fw_compiler=forward_compiler, bw_compiler=lambda gm, inputs: gm, partition_fn=partition))
    compiled(*batch).backward()
    gm = seen["forward"]
    inputs = {p.meta["val"].untyped_storage()._cdata for p in gm.graph.find_nodes(op="placeholder")
              if isinstance(p.meta.get("val"), torch.Tensor)}
    outputs = next(iter(gm.graph.find_nodes(op="output"))).args[0][seen["num_fwd_outputs"]:]
    saved = {}
    for node in outputs:
        val = getattr(node, "meta", {}).get("val")
        if isinstance(val, torch.Tensor) and val.untyped_storage()._cdata not in inputs:
            saved[val.untyped_storage()._cdata] = val.untyped_storage().nbytes()
    torch._dynamo.reset()
    return sum(saved.values())


def test_compiled_saved_bytes_equal_torch_compile():
    source = load_model_source("llama-debug")
    torch.manual_seed(0)
    measured = _real_compiled_saved_bytes(source.build_model(), source.example_batch(2, 64))
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=64), (PolicySpec(name="compiled"),))
    predicted = analyze_graphs(graphs).policies["compiled"]
    assert measured > 0
    assert predicted.saved.activation_bytes == measured
