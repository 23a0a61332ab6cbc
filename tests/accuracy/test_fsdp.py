"""FSDP2 per-rank memory vs a real `fully_shard` step on 2 CPU processes (gloo), measured at storage level.

Each rank runs llama-debug (2 blocks, tied embedding) with `fully_shard` on every block and on the root,
AdamW (foreach, as `--optimizer adamw`), one warm-up step, then one tracked step (forward+loss, backward,
step, zero_grad). The tracker is tests/truth.py's idea (a dispatch mode that registers the storage of
every tensor an op touches) with two changes FSDP2 needs: DTensors are flattened to their local tensors,
and live bytes are re-summed from the storages' current sizes after every op, because FSDP2 allocates and
frees unsharded parameters with `untyped_storage().resize_()`, which no dispatch mode and no finalizer
sees.

The prediction is `shard_memory(analysis, "fsdp", 2, backend="gloo")` on the single-process analysis of
the same step, for reshard_after_forward True and False and for a step whose peak falls inside a
reduce-scatter. Two details of the real engine are modelled in tracer/passes/sharding.py: gloo's
reduce-scatter works on a copy of its input (one unit's padded gradients; NCCL does not copy), and FSDP2
frees the previous unit's all-gather output and the unit's last gradient only when a local variable of
`wait_for_unshard` / `foreach_reduce` goes out of scope. Not modelled, and not deterministic: gloo's
worker thread drops its reference to a collective's tensors on its own schedule. Measured in 8 runs on a
quiet machine: 47 of 48 (rank, case) backward and optimizer peaks equal the prediction to the byte, one
optimizer peak is 131,328 B above it; under load, both ranks of the b1 s16 case were +76,160 and
+115,200 B in backward. So the forward peak must be exact on every rank, and the backward and optimizer
peaks at least the prediction and at most one unit's gathered bytes above it.
"""
import gc
import weakref

import pytest
import torch

from gloo import run_ranks
from tracer.capture import CaptureOptions, PolicySpec, capture_steps
from tracer.capture.model_input import ModelSource
from tracer.models import llama
from tracer.passes.analysis import analyze_graphs
from tracer.passes.sharding import shard_memory

WORLD_SIZE = 2
# (batch, seq, reshard_after_forward): peak in backward at the loss; the same without resharding; a tiny
# batch whose peak is the gloo reduce-scatter of the last block's gradients
CASES = [(2, 256, True), (2, 256, False), (1, 16, True)]
CONFIG = llama.LLAMA_SIZES["debug"]


def _plain_tensors(t):
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        for name in names:
            inner = getattr(t, name)
            if isinstance(inner, torch.Tensor):
                yield from _plain_tensors(inner)
    elif isinstance(t, torch.Tensor):
        yield t


def _tracker():
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class ResizeAwareTracker(TorchDispatchMode):
        """Live bytes = the current size of every storage seen so far and still alive, after each op."""

        def __init__(self):
            super().__init__()
            self.storages: dict[int, weakref.ref] = {}
            self.phase = "setup"
            self.phase_peaks: dict[str, int] = {}

        def track(self, tensors) -> None:
            for t in tensors:
                for plain in _plain_tensors(t):
                    storage = plain.untyped_storage()
                    key = storage._cdata
                    if key not in self.storages:
                        self.storages[key] = weakref.ref(storage)
                        weakref.finalize(storage, self.storages.pop, key, None)

        def live_bytes(self) -> int:
            return sum(s.nbytes() for ref in list(self.storages.values()) if (s := ref()) is not None)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.track(t for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor))
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), self.live_bytes())
            return out

    return ResizeAwareTracker()


def _fsdp_internal_tensors(model) -> list:
    from torch.distributed.fsdp._fully_shard._fsdp_state import _get_module_fsdp_state
    out = []
    for module in model.modules():
        state = _get_module_fsdp_state(module)
        for group in (state._fsdp_param_groups if state is not None else ()):
            for fsdp_param in group.fsdp_params:
                out += [fsdp_param._sharded_param_data, *fsdp_param.all_gather_outputs]
                if hasattr(fsdp_param, "_unsharded_param"):
                    out.append(fsdp_param._unsharded_param)
    return out


def _measure_rank(batch: int, seq: int, reshard: bool) -> dict:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = llama.Llama(CONFIG)
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, targets = llama.example_batch(CONFIG, batch, seq)
    loss = model(tokens, targets)                       # warm-up: optimizer state exists (steady step)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    del loss
    gc.collect()
    tracker = _tracker()
    state = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    tracker.track([*model.parameters(), *model.buffers(), tokens, targets, *state, *_fsdp_internal_tensors(model)])
    with tracker:
        tracker.phase = "forward"
        loss = model(tokens, targets)
        tracker.phase = "backward"
        loss.backward()
        tracker.phase = "optimizer"
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {"phase_peaks": tracker.phase_peaks}


def _measure_cases(rank: int) -> list[dict]:
    return [_measure_rank(batch, seq, reshard) for batch, seq, reshard in CASES]


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> list[list[dict]]:
    """measured[rank][case] = {"phase_peaks": {...}}."""
    return run_ranks(_measure_cases, WORLD_SIZE, str(tmp_path_factory.mktemp("fsdp")))


def _predict(batch: int, seq: int, reshard: bool):
    source = ModelSource(name="llama-debug", path=None, build_model=lambda: llama.Llama(CONFIG),
                         example_batch=lambda b, s: llama.example_batch(CONFIG, b, s))
    analysis = analyze_graphs(capture_steps(source, CaptureOptions(batch=batch, seq=seq), (PolicySpec(name="eager"),)))
    return shard_memory(analysis.policies["eager"], "fsdp", WORLD_SIZE, reshard_after_forward=reshard,
                        backend="gloo")


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"b{b}-s{s}-reshard{int(r)}" for b, s, r in CASES])
def test_fsdp2_per_rank_peak_matches_a_real_fully_shard_step(measured, case):
    batch, seq, reshard = CASES[case]
    predicted = _predict(batch, seq, reshard)
    held = max(unit.padded_bytes for unit in predicted.units)     # one unit's collective buffer
    for rank in range(WORLD_SIZE):
        phases = measured[rank][case]["phase_peaks"]
        assert predicted.phases["forward"] == phases["forward"], (rank, predicted.phases, phases)
        for phase in ("backward", "optimizer"):
            assert predicted.phases[phase] <= phases[phase] <= predicted.phases[phase] + held, \
                (rank, phase, predicted.phases, phases, held)
