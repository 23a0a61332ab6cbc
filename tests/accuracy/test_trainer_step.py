"""`--trainer-args args.json` against a real `Trainer.training_step` with the same arguments: forward, loss
and backward as the Trainer runs them, then the optimizer the Trainer builds (transformers' own
`create_optimizer`: its class for `optim` and its two parameter groups, whose order decides a for-loop
optimizer's peak), measured at the CPU allocator like tests/truth.py does."""
import contextlib
import os

import pytest
import torch

from tracer.capture import CaptureOptions, capture_step, load_model_source
from tracer.passes.analysis import analyze_graph
from tracer.trainer_args import trainer_options
from truth import peaks_at_allocator

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "hf_llama_trainer.py")


def _trainer_step_peaks(trainer, model, batch) -> dict[str, int]:
    """Peak bytes of `training_step` (forward, loss, backward: "backward") and of the optimizer step with
    zero_grad ("optimizer"), after one warm-up step."""
    from torch.profiler import record_function

    def step(ranged: bool):
        def phase(name):
            return record_function(f"phase:{name}") if ranged else contextlib.nullcontext()
        with phase("backward"):
            loss = trainer.training_step(model, dict(batch))
        with phase("optimizer"):
            trainer.optimizer.step()
            model.zero_grad(set_to_none=True)
            del loss

    step(ranged=False)
    return peaks_at_allocator(step, model, batch, trainer.optimizer)


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused", "adafactor"])
def test_trainer_args_predict_the_trainers_step(tmp_path, optim):
    transformers = pytest.importorskip("transformers")
    arguments = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2,
                                               optim=optim, report_to=[], use_cpu=True, max_grad_norm=0.0,
                                               weight_decay=0.01)
    path = tmp_path / "args.json"
    path.write_text(arguments.to_json_string())
    source = load_model_source(FIXTURE)
    fields = trainer_options(str(path))
    options = CaptureOptions(batch=fields["batch"], seq=32, target="cpu", trainer_args=fields["trainer_args"])
    predicted = analyze_graph(capture_step(source, options)).policies["eager"]

    torch.manual_seed(0)
    model = source.build_model()
    trainer = transformers.Trainer(model=model, args=arguments)
    trainer.create_optimizer()
    trainer.current_gradient_accumulation_steps = 1         # set by Trainer.train's loop before each step
    measured = _trainer_step_peaks(trainer, model, source.example_batch(2, 32))
    training_step = max(predicted.phases["forward"].peak_bytes, predicted.phases["backward"].peak_bytes)
    # within 0-dim scalars (transformers' Adafactor keeps a few more than the capture sees: 76 B)
    assert abs(training_step - measured["backward"]) <= 128, (training_step, measured["backward"])
    assert abs(predicted.phases["optimizer"].peak_bytes - measured["optimizer"]) <= 128, (
        predicted.phases["optimizer"].peak_bytes, measured["optimizer"])
