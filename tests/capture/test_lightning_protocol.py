"""Lightning's protocol as tracer reads it (tracer/capture/lightning_loop.py): which modules follow it, the
optimizer configure_optimizers returns in each of Lightning's forms, and what is refused."""
import pytest
import torch
from torch import nn

from tracer.capture.caller_held import hold_previous_gradients, inputs_at_their_turn
from tracer.capture.lightning_loop import configured_optimizer, is_lightning_module, training_step_loss
from tracer.capture.storages import StorageTable
from tracer.errors import ModelRunError, UsageError
from tracer.stepgraph import Phase, StorageRole, TensorValue

L = pytest.importorskip("lightning")


class _Lit(L.LightningModule):
    def __init__(self, returned=None, step_returns=None):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.returned, self.step_returns = returned, step_returns

    def training_step(self, batch, batch_idx):
        (x,) = batch
        loss = self.linear(x).sum()
        return self.step_returns(loss) if self.step_returns else loss

    def configure_optimizers(self):
        return self.returned(torch.optim.SGD(self.parameters(), lr=0.1))


def test_a_lightning_module_is_recognised_by_its_class_and_a_plain_module_is_not():
    assert is_lightning_module(_Lit())
    assert not is_lightning_module(nn.Linear(2, 2))
    assert not is_lightning_module(None)


@pytest.mark.parametrize("form", [lambda o: o, lambda o: [o], lambda o: (o,), lambda o: {"optimizer": o},
                                  lambda o: ([o], [torch.optim.lr_scheduler.StepLR(o, 1)]),
                                  lambda o: [{"optimizer": o, "lr_scheduler": torch.optim.lr_scheduler.StepLR(o, 1)}]])
def test_configure_optimizers_gives_its_optimizer_in_every_lightning_form(form):
    assert isinstance(configured_optimizer(_Lit(returned=form)), torch.optim.SGD)


def test_several_optimizers_are_refused_because_lightning_steps_them_only_manually():
    module = _Lit(returned=lambda o: [o, torch.optim.SGD(o.param_groups[0]["params"], lr=0.1)])
    with pytest.raises(UsageError, match="2 optimizers"):
        configured_optimizer(module)


def test_manual_optimization_is_refused_with_what_to_do():
    module = _Lit()
    module.automatic_optimization = False
    with pytest.raises(UsageError, match="automatic_optimization"):
        training_step_loss(module, (torch.randn(2, 4),), None)


def test_the_loss_comes_from_a_tensor_or_a_dicts_loss_and_a_dict_without_one_is_refused():
    loss, out = training_step_loss(_Lit(step_returns=lambda l: {"loss": l, "x": l}), (torch.randn(2, 4),), None)
    assert loss.dim() == 0 and set(out) == {"loss", "x"}
    with pytest.raises(ModelRunError, match="without a 'loss'"):
        training_step_loss(_Lit(step_returns=lambda l: {"other": l}), (torch.randn(2, 4),), None)
    with pytest.raises(ModelRunError, match="not the loss"):
        training_step_loss(_Lit(step_returns=lambda l: None), (torch.randn(2, 4),), None)


class _Op:
    def __init__(self, phase, micro_batch=None, reads=()):
        self.phase, self.micro_batch = phase, micro_batch
        self.args, self.kwargs, self.outputs = tuple(TensorValue(sid, (4,), "int64") for sid in reads), (), ()


def test_gradients_freed_by_the_steps_zero_grad_outlive_it_and_the_previous_steps_are_held_through_forward():
    ops = [_Op(Phase.FORWARD), _Op(Phase.FORWARD), _Op(Phase.BACKWARD), _Op(Phase.OPTIMIZER)]
    table = StorageTable()
    grad = table.add(None, StorageRole.GRADIENT, nbytes=64, dtype="float32", shape=(16,), name="w.grad",
                     released_after_op=3)
    notes = hold_previous_gradients(ops, table, steady=True)
    assert table.get(grad).released_after_op is None and table.get(grad).persistent
    previous = table.get(len(table) - 1)
    assert (previous.preexisting, previous.released_after_op, previous.nbytes) == (True, 1, 64)
    assert "64 B" in notes[0]
    first = StorageTable()
    first.add(None, StorageRole.GRADIENT, nbytes=64, dtype="float32", shape=(16,), released_after_op=3)
    hold_previous_gradients(ops, first, steady=False)
    assert len(first) == 1


def test_a_loop_taking_one_batch_at_a_time_holds_each_micro_batchs_inputs_from_its_turn_to_the_next():
    table = StorageTable()
    inputs = [table.add(None, StorageRole.INPUT, nbytes=32, dtype="int64", shape=(4,), preexisting=True,
                        persistent=True) for _ in range(3)]
    ops = [_Op(Phase.FORWARD, 1, reads=(inputs[0],)), _Op(Phase.BACKWARD, 1),
           _Op(Phase.FORWARD, 2, reads=(inputs[1],)), _Op(Phase.BACKWARD, 2),
           _Op(Phase.FORWARD, 3, reads=(inputs[2],)), _Op(Phase.BACKWARD, 3), _Op(Phase.OPTIMIZER)]
    inputs_at_their_turn(ops, table)
    held = [(table.get(s).preexisting, table.get(s).persistent, table.get(s).released_after_op) for s in inputs]
    assert held == [(True, False, 1), (False, False, 3), (False, True, None)]
