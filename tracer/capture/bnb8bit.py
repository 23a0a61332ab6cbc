"""bitsandbytes' optimizers for a CUDA target, simulated: their state is created with bitsandbytes' dtypes
and shapes and their step runs no aten op (the fused CUDA kernels allocate nothing full-size). For a CPU
target the classes run as they are: bitsandbytes' CPU kernels are Python code registered through
torch.library, which the optimizer recorder traces (capture/recorder.py): they dequantise each
parameter's moments to fp32, copy its gradient and the parameter to fp32, update, write back and
requantise, so the step's peak holds those copies of the largest parameter.

The layout modelled is bitsandbytes 0.50's `Optimizer2State` / `Optimizer1State.init_state` with the
defaults (optim_bits=8, block_wise=True, min_8bit_size=4096, percentile_clipping=100, max_unorm=0):
  * a parameter of n >= 4,096 elements: `state1` (and `state2` for two-state optimizers such as AdamW) uint8
    of the parameter's shape, and `absmax1` (`absmax2`) fp32 of ceil(n / 256) elements (one per block of
    256 values): 2 + 2 * 4 / 256 = 2.03125 bytes per parameter for AdamW8bit;
  * a parameter of n < 4,096 elements: `state1` (`state2`) fp32 of the parameter's shape, no absmax;
  * the quantisation maps `qmap1` (signed dynamic map) and `qmap2` (unsigned), 256 fp32 values each, are
    shared by every parameter of one optimizer (`name2qmap`): 2 KiB per optimizer, made at its first
    8-bit parameter;
  * `step` is a Python int, not a tensor.
Paged variants (`PagedAdamW8bit`, ...) allocate state1/state2 of parameters with >= 100,000 elements in CUDA
unified memory, which the driver pages to host memory under pressure: those bytes are counted as resident
on the device (the worst case, and what the device holds when nothing pages out), with a note.

The step's temporaries are not recorded: bitsandbytes' fused blockwise kernel dequantises, updates and
requantises each block in registers and shared memory, so it allocates no full-size tensor; the step is
recorded as one in-place op per parameter (`p.add_(grad, alpha=0)`, which allocates nothing).
Not modelled: `optim_bits=32` variants' kernels (their fp32 state is modelled the same way),
per-parameter config overrides (GlobalOptimManager), percentile clipping's `gnorm_vec` (100 fp32) and
`max_unorm`'s `unorm_vec`.
"""
from __future__ import annotations

import dataclasses

import torch

from tracer.errors import UsageError

BLOCK_SIZE = 256               # values per absmax block (bitsandbytes >= 0.45; 2048 before)
MIN_8BIT_SIZE = 4096           # smaller parameters keep fp32 state
PAGED_MIN_NUMEL = 100_000      # get_state_buffer pages only buffers of at least this many elements
QMAP_VALUES = 256


@dataclasses.dataclass(frozen=True)
class BnbLayout:
    """What one bitsandbytes optimizer class keeps per parameter."""
    states: int                # 2: Adam/AdamW/AdEMAMix-free two-moment optimizers; 1: Lion, momentum SGD, ...
    eight_bit: bool
    paged: bool


_TWO_STATE = ("adam", "adamw", "lamb")
_ONE_STATE = ("lion", "sgd", "momentum", "rmsprop", "adagrad", "lars")


def layout_of_class(name: str) -> BnbLayout:
    """The layout of a bitsandbytes optimizer class from its name (`AdamW8bit`, `PagedAdamW8bit`,
    `Lion8bit`, `AdamW32bit`, ...). Raises UsageError for a class whose state is not modelled."""
    lower = name.lower()
    paged = lower.startswith("paged")
    base = lower.removeprefix("paged").removesuffix("8bit").removesuffix("32bit")
    if base in _TWO_STATE:
        states = 2
    elif base in _ONE_STATE:
        states = 1
    else:
        raise UsageError(f"make_optimizer returned bitsandbytes.{name}, whose state tracer does not model",
                         hint="supported: bitsandbytes' Adam/AdamW/LAMB and Lion/SGD/RMSprop/Adagrad/LARS "
                              "classes (8bit, 32bit, Paged); or pass --optimizer adamw8bit")
    return BnbLayout(states=states, eight_bit=not lower.endswith("32bit") and "8bit" in lower, paged=paged)


def is_bitsandbytes_optimizer(opt) -> bool:
    return type(opt).__module__.split(".")[0] == "bitsandbytes"


def state_bytes_per_parameter(numel: int, layout: BnbLayout) -> int:
    """Bytes of one parameter's state (the shared qmaps excluded)."""
    if not layout.eight_bit or numel < MIN_8BIT_SIZE:
        return layout.states * numel * 4
    blocks = -(-numel // BLOCK_SIZE)
    return layout.states * (numel + blocks * 4)


class SimulatedBnbOptimizer(torch.optim.Optimizer):
    """A bitsandbytes optimizer's state, created lazily in step() as bitsandbytes creates it; step()
    updates nothing (the fused kernel's work allocates nothing)."""

    def __init__(self, params, layout: BnbLayout, *, label: str, cpu_kernels_missing: bool = False):
        super().__init__(params, dict(lr=1e-3))
        self.layout, self.label = layout, label
        self.cpu_kernels_missing = cpu_kernels_missing
        self._qmaps: list[torch.Tensor] = []

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                if not self.state[p]:
                    self._init_state(p)
                # stands for the fused kernel: reads the gradient, writes the parameter in place, allocates
                # nothing (alpha 0: the simulation never changes a value)
                p.add_(p.grad, alpha=0.0)
        return None

    def _init_state(self, p: torch.Tensor) -> None:
        state = self.state[p]
        state["step"] = 0
        keys = ("state1", "state2")[:self.layout.states]
        if not self.layout.eight_bit or p.numel() < MIN_8BIT_SIZE:
            for key in keys:
                state[key] = torch.zeros_like(p, dtype=torch.float32)
            return
        if not self._qmaps:           # name2qmap["dynamic"] / ["udynamic"], shared by every parameter
            self._qmaps = [torch.zeros(QMAP_VALUES, dtype=torch.float32) for _ in range(2)]
        blocks = -(-p.numel() // BLOCK_SIZE)
        for i, key in enumerate(keys, start=1):
            state[key] = torch.zeros_like(p, dtype=torch.uint8)
            state[f"qmap{i}"] = self._qmaps[i - 1]
            state[f"absmax{i}"] = torch.zeros(blocks, dtype=torch.float32)

    def notes(self) -> tuple[str, ...]:
        if self.layout.eight_bit:
            layout = (f"uint8 moments, one fp32 absmax per {BLOCK_SIZE} values, fp32 state below "
                      f"{MIN_8BIT_SIZE:,} elements, two shared 256-value qmaps")
        else:
            layout = "fp32 moments of each parameter's shape (32-bit state: no quantisation, no absmax or qmaps)"
        kernel = "dequantises in registers" if self.layout.eight_bit else "updates each parameter in place"
        out = [f"{self.label}: bitsandbytes' state layout ({layout}); its fused CUDA kernel {kernel}, so the "
               "step's temporaries are not modelled (none full-size)"]
        if self.cpu_kernels_missing:
            out.append(f"{self.label}: bitsandbytes is not installed here, so its CPU kernels (fp32 copies of "
                       "the moments, the gradient and the parameter per parameter) are not traced; "
                       "pip install bitsandbytes for them")
        if self.layout.paged:
            out.append(f"{self.label}: paged state (state1/state2 of parameters with >= {PAGED_MIN_NUMEL:,} "
                       "elements) lives in CUDA unified memory, paged to the host under pressure: counted as "
                       "resident on the device")
        return tuple(out)


def installed_class(name: str):
    """bitsandbytes' class behind `--optimizer name` when bitsandbytes is installed, else None."""
    from tracer.errors import package_installed
    if not package_installed("bitsandbytes"):
        return None
    import bitsandbytes.optim
    return {"adamw8bit": bitsandbytes.optim.AdamW8bit, "paged-adamw8bit": bitsandbytes.optim.PagedAdamW8bit}[name]


STANDARD = {"adamw8bit": BnbLayout(states=2, eight_bit=True, paged=False),
            "paged-adamw8bit": BnbLayout(states=2, eight_bit=True, paged=True)}


def simulate_bitsandbytes(opt) -> SimulatedBnbOptimizer:
    """The simulation of a user's bitsandbytes optimizer, over its parameter groups."""
    name = type(opt).__name__
    return SimulatedBnbOptimizer([{"params": g["params"]} for g in opt.param_groups], layout_of_class(name),
                                 label=f"bitsandbytes.{name}")
