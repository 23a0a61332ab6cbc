"""Training precisions: what each `--precision` runs, defined once for every capture path.

    fp32       everything in float32
    bf16       torch.autocast(bfloat16) around forward and loss, fp32 weights (autocast keeps bf16 copies)
    bf16-pure  bf16 weights and inputs, no autocast
    fp16       torch.autocast(float16) around forward and loss, fp32 weights, and `torch.amp.GradScaler`
               (what Hugging Face Trainer's fp16=True and V100/T4 users run): `scaler.scale(loss).backward()`,
               then `scaler.step(optimizer)` (unscale_: the inverse scale and the inf flag, the in-place
               unscale of every gradient) and `scaler.update()`

The loss scaling in the joint graph multiplies the loss by a Python number: the same bytes as the real
`loss * scale` (a 4-byte scaled loss in forward, a 4-byte gradient in backward; the 0-dim scale tensor
already exists). The scaler's own tensors (scale, growth tracker, inverse scale, inf flags) are recorded
with the optimizer step (capture/optimizer.py), which runs `unscale_`, `step`, `update` as
`scaler.step` does when no gradient is inf or NaN (the step is taken; its `.item()` check reads no
memory). Not modelled: a skipped step (inf gradients), fused optimizers' in-kernel unscaling
(`scaler.step` passes the scale to a fused optimizer instead of calling unscale_).
"""
from __future__ import annotations

import contextlib

import torch

from tracer.choices import PRECISIONS  # noqa: F401 - the names, without torch, for the CLI

LOSS_SCALE = 2.0 ** 16                     # GradScaler's init_scale; the value never changes memory


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The autocast dtype around forward and loss, or None (no autocast)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)


def autocast_context(precision: str):
    """torch.autocast on the (CPU, fake) capture device for `precision`, else a null context."""
    dtype = autocast_dtype(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def uses_grad_scaler(precision: str) -> bool:
    return precision == "fp16"


def scaled_loss(loss: torch.Tensor, precision: str) -> torch.Tensor:
    """`scaler.scale(loss)` for a precision trained with a GradScaler, else the loss itself."""
    return loss * LOSS_SCALE if uses_grad_scaler(precision) else loss


def make_grad_scaler(precision: str):
    """The GradScaler of a step at `precision` (on the CPU capture device), or None."""
    if not uses_grad_scaler(precision):
        return None
    return torch.amp.GradScaler("cpu", init_scale=LOSS_SCALE)
