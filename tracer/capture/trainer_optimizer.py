"""The optimizer the Hugging Face Trainer builds from its arguments (`--trainer-args args.json`), for a model
file that defines no `make_optimizer`.

`trainer_optimizer_source(source, path)` returns the `ModelSource` whose `make_optimizer` is transformers' own
`Trainer.create_optimizer` on the built model, with the `TrainingArguments` the JSON file holds: the class and
keyword arguments `Trainer.get_optimizer_cls_and_kwargs` picks for `optim`, and the Trainer's two parameter
groups (weight decay on every parameter but biases and norms, then the rest). The groups' order is the order
the step visits the parameters in, which decides a for-loop optimizer's peak (a `denom` of the previous
parameter is still bound while the next one's is made). The Trainer's own code runs on a stand-in for the
Trainer that holds only the model and the arguments.

Not modelled: `Trainer(optimizers=...)` or `optimizer_cls_and_kwargs` given by a script, and the layer-wise
optimizers (GaLore, LOMO) that take the model instead of parameter groups (refused by the capture as any
optimizer that does not build on fake tensors).
"""
from __future__ import annotations

import dataclasses
import json
import types

from tracer.capture.model_input import ModelSource
from tracer.errors import UsageError, package_import_error


def trainer_optimizer_source(source: ModelSource, path: str) -> ModelSource:
    """`source` whose optimizer is the one the Trainer builds from the arguments in `path`."""
    arguments = training_arguments(path)
    built: list = []

    def build_model():
        model = source.build_model()
        built[:] = [model]
        return model

    def make_optimizer(params):
        from transformers import Trainer

        model = built[0]
        trainer = types.SimpleNamespace(model=model, args=arguments, optimizer=None, optimizer_cls_and_kwargs=None,
                                        get_optimizer_cls_and_kwargs=Trainer.get_optimizer_cls_and_kwargs)
        trainer.get_decay_parameter_names = lambda m: Trainer.get_decay_parameter_names(trainer, m)
        return Trainer.create_optimizer(trainer, model)

    return dataclasses.replace(source, build_model=build_model, make_optimizer=make_optimizer)


def training_arguments(path: str):
    """`TrainingArguments` from the JSON `TrainingArguments.to_json_string()` wrote: its init fields, on the
    CPU (the capture runs there; the arguments only pick the optimizer here)."""
    try:
        from transformers import TrainingArguments
    except ImportError as exc:
        raise package_import_error("--trainer-args (the Trainer's optimizer)", ("transformers",), exc,
                                   install="pip install transformers") from exc
    with open(path) as f:
        values = json.load(f)
    fields = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    chosen = {k: v for k, v in values.items() if k in fields}
    chosen.update(use_cpu=True, report_to=[], output_dir=chosen.get("output_dir") or "tracer-trainer-args")
    try:
        return TrainingArguments(**chosen)
    except Exception as exc:                   # noqa: BLE001 - the arguments' own check, said in one line
        raise UsageError(f"--trainer-args {path}: TrainingArguments refused them: {type(exc).__name__}: {exc}",
                         hint="give the JSON that TrainingArguments.to_json_string() writes") from exc
