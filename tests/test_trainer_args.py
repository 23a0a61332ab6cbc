"""`--trainer-args`: a Hugging Face Trainer's TrainingArguments (tracer/trainer_args.py) give the step the
Trainer runs: the same analysis as the flags they stand for. The flags themselves are checked against real
steps elsewhere (bf16 autocast with transformers' gradient_checkpointing_enable, both ways:
tests/accuracy/test_autocast_cache.py; accumulation, 8-bit AdamW: tests/accuracy)."""
import json
import os

import pytest

import tracer
from tracer.cli import main
from tracer.errors import ExitCode, UsageError
from tracer.trainer_args import trainer_options

LLAMA = ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
         "vocab_size=512")


def _written(tmp_path, **kwargs) -> str:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "out"), use_cpu=True, report_to=[], **kwargs)
    path = tmp_path / "args.json"
    path.write_text(args.to_json_string())
    return str(path)


def test_the_arguments_the_trainer_writes_map_to_tracers_options(tmp_path):
    path = _written(tmp_path, per_device_train_batch_size=4, gradient_accumulation_steps=2, bf16=True,
                    optim="adamw_bnb_8bit", gradient_checkpointing=True)
    assert trainer_options(path) == {"batch": 4, "accumulate": 2, "precision": "bf16", "optimizer": "adamw8bit",
                                     "gradient_checkpointing": "non-reentrant", "trainer_args": os.path.abspath(path)}
    reentrant = tmp_path / "reentrant.json"
    reentrant.write_text(json.dumps({"gradient_checkpointing": True,
                                     "gradient_checkpointing_kwargs": {"use_reentrant": True},
                                     "torch_compile": True, "optim": "adafactor"}))
    assert trainer_options(str(reentrant)) == {"precision": "fp32", "optimizer": "adafactor-hf",
                                               "policies": ("compiled",), "gradient_checkpointing": "reentrant",
                                               "trainer_args": str(reentrant)}


def test_what_tracer_cannot_follow_is_refused_by_name(tmp_path):
    galore = tmp_path / "galore.json"
    galore.write_text(json.dumps({"optim": "galore_adamw"}))
    with pytest.raises(UsageError, match="optim 'galore_adamw'"):
        trainer_options(str(galore))
    every_other = tmp_path / "every_other.json"
    every_other.write_text(json.dumps({"gradient_checkpointing": True,
                                       "gradient_checkpointing_kwargs": {"every_n_layers": 2}}))
    with pytest.raises(UsageError, match="every_n_layers"):
        trainer_options(str(every_other))
    with pytest.raises(UsageError, match="gradient_checkpointing_enable"):
        tracer.analyze("llama-debug", batch=1, seq=16, target="cpu", gradient_checkpointing="non-reentrant")


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_the_trainers_step_is_the_step_its_flags_give(tmp_path):
    """A tiny transformers Llama under the Trainer's bf16, accumulation and gradient checkpointing: the same
    forward and backward, byte for byte in every phase, as the equivalent flags (the optimizer is the one the
    Trainer builds: tests/accuracy/test_trainer_step.py); the model's layers are checkpointed as
    transformers' gradient_checkpointing_enable() writes it (one region per layer)."""
    path = _written(tmp_path, per_device_train_batch_size=2, gradient_accumulation_steps=2, bf16=True,
                    gradient_checkpointing=True)
    model = ["hf:llama", "--seq", "32", "--target", "cpu", "--quiet", "--no-cache",
             *(arg for key in LLAMA for arg in ("--hf-config", key))]
    assert main([*model, "--json", str(tmp_path / "trainer.json"), "--trainer-args", path]) == ExitCode.OK
    assert main([*model, "--json", str(tmp_path / "flags.json"), "--batch", "2", "--accumulate", "2",
                 "--precision", "bf16", "--gradient-checkpointing", "non-reentrant"]) == ExitCode.OK
    trainer, flags = (json.loads((tmp_path / f"{name}.json").read_text()) for name in ("trainer", "flags"))
    for policy, report in trainer["policies"].items():
        phases = {name: peak for name, peak in report["phases"].items() if not name.startswith("optimizer")}
        assert phases == {name: peak for name, peak in flags["policies"][policy]["phases"].items()
                          if not name.startswith("optimizer")}
    assert trainer["config"]["gradient_checkpointing"] == "non-reentrant"
    assert trainer["capture_notes"] == flags["capture_notes"]
    analysis = tracer.analyze("hf:llama", hf_config=LLAMA, seq=32, target="cpu", batch=2, accumulate=2,
                              precision="bf16", gradient_checkpointing="non-reentrant")
    regions = [n for n in analysis.graph.config.notes if n.startswith("checkpointed region")]
    assert len(regions) == 2                 # one per layer
