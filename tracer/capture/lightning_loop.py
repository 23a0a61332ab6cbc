"""Lightning's training loop: a model whose `build_model()` returns a `LightningModule` is stepped as
Lightning's automatic optimization steps it.

    loss = training_step(batch, batch_idx) / normalize     a Tensor, or a mapping's "loss"; one 0-dim division
    optimizer.zero_grad()                                                  after forward, before backward
    loss.backward()
    optimizer.step()

(`lightning.pytorch.loops.optimization.automatic`: the closure runs the step function, then zero_grad,
then backward, and `optimizer.step(closure)` runs it; zero_grad runs on the first micro-batch of an
accumulation window only.) The batch reaches `training_step` as one object, as the dataloader yields it:
the tuple `example_batch` returns, or its dict. The optimizer is `configure_optimizers()`'s when the model
file defines no `make_optimizer`: an optimizer, a one-element list or tuple, a dict with "optimizer", or
`([optimizers], [schedulers])`; schedulers make no tensor.

What the loop's order means for memory: the gradients the previous step made are not dropped at the end of
that step but by the zero_grad inside this step's closure, after the forward. In a steady step they are
held through the whole forward (and, on the device, beside its activations), and the gradients this step
makes outlive it; caller_held.py's `hold_previous_gradients` puts that on the captured step's storages. A
mapping's tensors besides the loss are kept in the closure's result until the step ends
(`training_step_extras`, held as caller_held.py holds a loop's kept outputs); nothing of a step is held
into the next one's forward. Under
`--precision bf16|fp16` (Lightning's "bf16-mixed" / "16-mixed") its autocast runs with the weight-cast
cache off (`autocast_cache_enabled`).

Recognised by the class: `lightning.pytorch.LightningModule` or `pytorch_lightning.LightningModule` in the
model's class hierarchy, by name and module, so Lightning is never imported here. Not modelled: manual
optimization (`automatic_optimization = False`: refused, the module's own training_step decides the
order), several optimizers, what `self.log` keeps (a detached 0-dim copy per logged value) and the detached
copy of the loss the closure keeps (0-dim), and the next batch Lightning's data fetcher holds (in host memory
on a GPU run).

With `--accumulate N` (`accumulate_grad_batches`) the loop takes one batch at a time: a micro-batch's inputs
reach the device when its turn comes and are dropped when the next one's are bound, after its backward
(caller_held.py's `inputs_at_their_turn`), where --accumulate's own rule holds every micro-batch's inputs
from the start of the step (the Hugging Face Trainer fetches a whole accumulation window first).
"""
from __future__ import annotations

import warnings
from collections.abc import Mapping

import torch

from tracer.errors import ModelRunError, UsageError

_LIGHTNING_MODULES = ("lightning.pytorch.", "pytorch_lightning.")


def is_lightning_module(model) -> bool:
    """Lightning's LightningModule is in `model`'s class hierarchy."""
    return any(cls.__name__ == "LightningModule" and cls.__module__.startswith(_LIGHTNING_MODULES)
               for cls in type(model).__mro__)


def check_automatic_optimization(model) -> None:
    """Raises UsageError for a module that steps its optimizers itself (manual optimization)."""
    if getattr(model, "automatic_optimization", True) is False:
        raise UsageError(f"{type(model).__name__} sets automatic_optimization = False: its training_step runs "
                         "backward and the optimizer itself, in an order tracer does not follow",
                         hint="define forward to return the loss and make_optimizer(params) in the model file")


def training_step_loss(model, batch: tuple, batch_keys: tuple[str, ...] | None):
    """Lightning's closure: `training_step(batch, 0)` on the batch as one object; returns the loss it hands
    over (a Tensor, or a mapping's "loss"), divided as the closure divides it (by 1: the division's 0-dim
    output and its backward are the loop's), and what training_step returned."""
    check_automatic_optimization(model)
    with warnings.catch_warnings():
        # `self.log` outside a Trainer warns that it logs nothing: what it would keep is a 0-dim copy
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
        out = model.training_step(dict(zip(batch_keys, batch)) if batch_keys is not None else tuple(batch), 0)
    return _closure_loss(out), out


def _closure_loss(out):
    if isinstance(out, Mapping):
        if out.get("loss") is None:
            raise ModelRunError(f"training_step returned a {type(out).__name__} without a 'loss' (keys: "
                                f"{', '.join(map(str, out.keys()))})",
                                hint="return the loss, or a dict holding it under 'loss', as Lightning requires")
        out = out["loss"]
    if not isinstance(out, torch.Tensor):
        raise ModelRunError(f"training_step returned {type(out).__name__}, not the loss",
                            hint="return the loss tensor, or a dict holding it under 'loss'")
    return out / 1


def training_step_extras(out) -> tuple:
    """What Lightning's loop keeps of training_step's output besides the loss: a mapping's other tensors,
    held in the closure's result until the step ends (the keep function of caller_held.py)."""
    if not isinstance(out, Mapping):
        return ()
    return tuple((f"training_step's {key!r}", value) for key, value in out.items()
                 if key != "loss" and isinstance(value, torch.Tensor))


def autocast_cache_enabled(model) -> bool:
    """Whether the loop's autocast keeps its weight-cast cache (capture/autocast_cache.py): Lightning's
    mixed-precision plugin enters `torch.autocast(..., cache_enabled=False)`, so each cast is freed after its
    last use; a plain loop's `torch.autocast` keeps the cache."""
    return not is_lightning_module(model)


def configured_optimizer(model):
    """The optimizer `configure_optimizers()` returns, in any of Lightning's return forms."""
    made = model.configure_optimizers()
    if isinstance(made, Mapping):
        made = made.get("optimizer")
    elif isinstance(made, (list, tuple)) and len(made) == 2 and isinstance(made[0], (list, tuple)):
        made = made[0]                                     # ([optimizers], [schedulers])
    if isinstance(made, (list, tuple)):
        if len(made) != 1:
            raise UsageError(f"configure_optimizers() returned {len(made)} optimizers: Lightning steps several "
                             "only under manual optimization", hint="return one optimizer")
        made = made[0]
        if isinstance(made, Mapping):
            made = made.get("optimizer")
    if made is None or not callable(getattr(made, "step", None)):
        raise UsageError(f"configure_optimizers() gave {type(made).__name__}, not an optimizer",
                         hint="return an optimizer, or a dict holding it under 'optimizer'")
    return made


def optimizer_factory(model, make_optimizer):
    """The model file's make_optimizer, else a LightningModule's configure_optimizers, else None."""
    if make_optimizer is not None or not is_lightning_module(model):
        return make_optimizer
    return lambda params: configured_optimizer(model)
