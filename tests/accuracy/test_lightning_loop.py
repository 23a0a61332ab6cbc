"""A LightningModule is stepped as Lightning's automatic optimization steps it (tracer/capture/lightning_loop.py):
training_step on the batch, zero_grad after the forward, backward, then configure_optimizers' optimizer. The
prediction is checked against a real `lightning.Trainer.fit` on the CPU, measured at the allocator inside the
Trainer's own loop (its callback hooks mark the phases)."""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph

L = pytest.importorskip("lightning")

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures", "lightning_lm.py")
BATCH, SEQ = 2, 64
# 0-dim tensors of at most 8 B that Lightning's loop keeps and tracer does not model: the closure's detached
# copy of the loss, and what `self.log` keeps (its metric's value and cumulated batch size, and their
# updates); at most six of them
SCALARS = 6 * 8


class _PhasePeaks(L.Callback):
    """Peak bytes per phase of the optimizer step made of batches `at` .. `at + micro_batches - 1`, at the CPU
    allocator: each forward (on_train_batch_start to on_before_backward, so the closure's zero_grad is in
    it), each backward, and the optimizer (on_before_optimizer_step to on_train_batch_end), named as tracer
    names its phases. The profiler starts an optimizer step earlier: the allocator reports a free only for
    memory it saw allocated, and the previous step's gradients and batch are freed in this one."""

    def __init__(self, at: int, micro_batches: int = 1):
        from torch.profiler import ProfilerActivity, profile
        self.at, self.last, self.micro_batches = at, at + micro_batches - 1, micro_batches
        self.range, self.peaks, self.batch_idx = None, None, None
        self.profiler = profile(activities=[ProfilerActivity.CPU], profile_memory=True)

    def _name(self, phase: str) -> str:
        micro_batch = self.batch_idx - self.at + 1
        return phase if self.micro_batches == 1 else f"{phase} (micro-batch {micro_batch})"

    def _phase(self, name):
        from torch.profiler import record_function
        if self.range is not None:
            self.range.__exit__(None, None, None)
        self.range = record_function(f"phase:{name}") if name else None
        if self.range is not None:
            self.range.__enter__()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batch_idx = batch_idx
        if batch_idx == max(self.at - self.micro_batches, 0):          # the previous optimizer step's first
            self.profiler.__enter__()
        if batch_idx == self.at:
            from tracer.capture.build import model_held_tensors
            held = [*pl_module.parameters(), *pl_module.buffers(), *batch,
                    *(p.grad for p in pl_module.parameters() if p.grad is not None),
                    *(v for state in trainer.optimizers[0].state.values() for v in state.values()
                      if isinstance(v, torch.Tensor)),
                    # tensors a module keeps on a plain attribute (a table made in the first forward)
                    *(v for m in pl_module.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)),
                    *(t for t, _ in model_held_tensors(pl_module))]
            self.live = sum({t.untyped_storage()._cdata: t.untyped_storage().nbytes() for t in held}.values())
        if self.at <= batch_idx <= self.last:
            self._phase(self._name("forward"))

    def on_before_backward(self, trainer, pl_module, loss):
        if self.range is not None:
            self._phase(self._name("backward"))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.range is not None:
            self._phase("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx != self.last:
            return
        self._phase(None)
        self.profiler.__exit__(None, None, None)
        events = list(self.profiler.profiler.kineto_results.events())
        ranges = {e.name().removeprefix("phase:"): (e.start_ns(), e.start_ns() + e.duration_ns())
                  for e in events if e.name().startswith("phase:")}
        start = min(begin for begin, _ in ranges.values())
        changes = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]" and e.start_ns() >= start)
        self.peaks = {}
        for phase, (begin, end) in ranges.items():
            now = self.live + sum(nbytes for at, nbytes in changes if at < begin)
            self.peaks[phase] = now
            for at, nbytes in changes:
                if begin <= at <= end:
                    now += nbytes
                    self.peaks[phase] = max(self.peaks[phase], now)


def _lightning_fit_peaks(model_args: dict, at: int, precision: str = "32-true", accumulate: int = 1,
                         fixture: str = "lightning_lm") -> dict[str, int]:
    """The peaks of optimizer step `at` (counted from 0) of a real Trainer.fit of the fixture module."""
    torch.manual_seed(0)
    module = __import__(fixture)
    model = module.build_model(**model_args)
    model.prepare_data = lambda: None            # a demo's would download its dataset
    batches = [module.example_batch(BATCH, SEQ) for _ in range((at + 1) * accumulate)]
    peaks = _PhasePeaks(at * accumulate, accumulate)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=at + 1, precision=precision,
                        accumulate_grad_batches=accumulate, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[peaks])
    trainer.fit(model, torch.utils.data.DataLoader(batches, batch_size=None))
    assert peaks.peaks is not None
    return peaks.peaks


def _predicted(model_args: dict, fixture: str = FIXTURE, **options) -> dict[str, int]:
    source = load_model_source(fixture, model_args=tuple(f"{k}={v}" for k, v in model_args.items()))
    graph = capture_step(source, CaptureOptions(batch=BATCH, seq=SEQ, target="cpu", **options))
    return {name: phase.peak_bytes for name, phase in analyze_graph(graph).policies["eager"].phases.items()}


@pytest.fixture(autouse=True)
def _fixture_importable(monkeypatch):
    monkeypatch.syspath_prepend(os.path.dirname(FIXTURE))


@pytest.mark.parametrize("returns", ["tensor", "dict"])
def test_a_steady_lightning_step_is_exact(returns):
    """The previous step's gradients are held through the forward and freed by the closure's zero_grad
    before backward; a returned dict's logits are held until the step ends."""
    predicted = _predicted({"returns": returns})
    measured = _lightning_fit_peaks({"returns": returns}, at=2)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(predicted[phase] - measured[phase]) <= SCALARS, (phase, predicted, measured)


def test_the_first_lightning_step_is_exact():
    predicted = _predicted({}, step="first")
    measured = _lightning_fit_peaks({}, at=0)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(predicted[phase] - measured[phase]) <= SCALARS, (phase, predicted, measured)


def test_the_op_by_op_run_follows_lightnings_loop():
    predicted = _predicted({"returns": "dict"}, capture="dispatch")
    measured = _lightning_fit_peaks({"returns": "dict"}, at=2)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(predicted[phase] - measured[phase]) <= SCALARS, (phase, predicted, measured)


@pytest.mark.parametrize("precision, lightning_precision", [("bf16", "bf16-mixed"), ("fp16", "16-mixed")])
def test_mixed_precision_runs_autocast_without_its_weight_cast_cache(precision, lightning_precision):
    """Lightning's mixed precision enters torch.autocast(cache_enabled=False): each low-precision copy of a
    weight is freed after its last use instead of living to the end of the forward; "16-mixed" scales the
    loss with a GradScaler as --precision fp16 does."""
    predicted = _predicted({}, precision=precision)
    measured = _lightning_fit_peaks({}, at=2, precision=lightning_precision)
    for phase in ("forward", "backward", "optimizer"):
        assert abs(predicted[phase] - measured[phase]) <= SCALARS, (phase, predicted, measured)


def test_accumulated_batches_reach_the_device_one_at_a_time():
    """accumulate_grad_batches=2: zero_grad runs in the first micro-batch only, and each micro-batch's inputs
    are bound when its turn comes and dropped when the next one's are (not all held from the start, as
    --accumulate holds them for the Hugging Face Trainer)."""
    predicted = _predicted({}, accumulate=2)
    measured = _lightning_fit_peaks({}, at=2, accumulate=2)
    assert set(predicted) == set(measured) and len(measured) == 5
    for phase in measured:
        assert abs(predicted[phase] - measured[phase]) <= SCALARS, (phase, predicted, measured)


def test_lightnings_own_demo_transformer_is_exact():
    """Code nobody here wrote: lightning.pytorch.demos' LightningTransformer (nn.Transformer, dropout, a
    positional table kept on a plain attribute after the first forward, SGD), captured op by op since its
    forward branches on a mask's size."""
    fixture = os.path.join(os.path.dirname(FIXTURE), "lightning_demo_transformer.py")
    predicted = _predicted({}, fixture=fixture)
    measured = _lightning_fit_peaks({}, at=2, fixture="lightning_demo_transformer")
    for phase in ("forward", "backward", "optimizer"):
        assert abs(predicted[phase] - measured[phase]) <= SCALARS, (phase, predicted, measured)
