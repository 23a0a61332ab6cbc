"""--offload optimizer: the device side predicted vs a real CPU step whose optimizer runs on a "host" the
tracker does not count (tests/truth.py's StorageTracker, with the host's storages left out): host copies of
the parameters, host gradient buffers filled by a post-accumulate-grad hook that then frees the device
gradient, the optimizer stepping the host copies, and the parameters copied back in place."""
import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.errors import UsageError
from tracer.passes.analysis import analyze_graph
from tracer.pipeline import AnalysisOptions
from truth import StorageTracker, _batch_tensors


class DeviceTracker(StorageTracker):
    """Counts device storages only: storages made while `on_host` is set, and the host tensors, are not."""

    def __init__(self, host_tensors):
        super().__init__()
        self.host_keys = {t.untyped_storage()._cdata for t in host_tensors}
        self.on_host = False

    def _register(self, storage, line, phase) -> None:
        if not self.on_host and storage._cdata not in self.host_keys:
            super()._register(storage, line, phase)


def measure_offloaded_step(model, batch):
    params = [p for p in model.parameters() if p.requires_grad]
    host_params = [p.detach().clone() for p in params]
    host_grads = [torch.zeros_like(p) for p in params]
    for host, grad in zip(host_params, host_grads):
        host.grad = grad
    opt = torch.optim.AdamW(host_params, lr=1e-3)

    def to_host(i):
        def hook(p):
            host_grads[i].copy_(p.grad)
            p.grad = None                  # the device gradient is freed once copied
        return hook

    for i, p in enumerate(params):
        p.register_post_accumulate_grad_hook(to_host(i))

    def step(tracker):
        tracker.phase = "forward"
        loss = model(*batch)
        tracker.phase = "backward"
        loss.backward()
        tracker.phase = "optimizer"
        tracker.on_host = True
        opt.step()
        tracker.on_host = False
        with torch.no_grad():
            for p, host in zip(params, host_params):
                p.copy_(host)

    step(DeviceTracker([]))                 # warm-up: the optimizer state exists before the measured step
    state = [v for s in opt.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tracker = DeviceTracker(host_params + host_grads + state)
    del state
    tracker.track_existing(list(model.parameters()) + list(model.buffers()) + _batch_tensors(batch), "device")
    start = tracker.current
    with tracker:
        step(tracker)
    return start, tracker


def test_device_side_of_an_offloaded_optimizer_is_exact():
    source = load_model_source("llama-debug")
    options = CaptureOptions(batch=2, seq=64, offload="optimizer", target="cpu")
    result = analyze_graph(capture_step(source, options)).policies["eager"]
    torch.manual_seed(0)
    start, tracker = measure_offloaded_step(source.build_model(), source.example_batch(2, 64))
    assert result.start_bytes == start
    assert {name: p.peak_bytes for name, p in result.phases.items()} == tracker.phase_peaks
    assert result.peak_bytes == tracker.peak
    # the bill: nothing of the optimizer on the device, its state and the copies in host memory
    assert result.at_peak.by_category["optimizer_state"] == 0
    param_bytes = sum(p.numel() * 4 for p in source.build_model().parameters())
    host = result.host.resident_bytes
    assert host["parameter"] == host["gradient"] == param_bytes
    assert host["optimizer_state"] == 2 * param_bytes + 4 * len(list(source.build_model().parameters()))


def test_offloading_the_parameters_too_leaves_only_copies_in_use_on_the_device():
    source = load_model_source("llama-debug")
    both = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=64, offload="optimizer+params",
                                                             target="cpu"))).policies["eager"]
    optimizer_only = analyze_graph(capture_step(source, CaptureOptions(batch=2, seq=64, offload="optimizer",
                                                                       target="cpu"))).policies["eager"]
    param_bytes = sum(p.numel() * 4 for p in source.build_model().parameters())
    assert optimizer_only.start_bytes - both.start_bytes == param_bytes
    assert both.peak_bytes < optimizer_only.peak_bytes
    assert both.host.resident_bytes["parameter"] == param_bytes


@pytest.mark.parametrize("extra", [dict(accumulate=2), dict(zero_grad_set_to_none=False),
                                   dict(shard="ddp", world_size=2), dict(offload_typo=True)])
def test_combinations_that_are_not_modelled_are_refused(extra):
    if extra.pop("offload_typo", False):
        with pytest.raises(UsageError, match="offload"):
            AnalysisOptions(offload="params")
        return
    with pytest.raises(UsageError, match="--offload"):
        AnalysisOptions(offload="optimizer", **extra)
