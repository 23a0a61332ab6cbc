"""Hugging Face transformers models built from a config, never from downloaded weights.

`hf:<name>` picks an architecture by its short name (gpt2, llama, mistral, qwen2, mixtral, qwen2_moe,
qwen3_moe, bert, t5) and builds it
from the library's default config class, or from a local `config.json` (`--config-json`, whose
`model_type` names the architecture, e.g. for `hf:meta-llama/Llama-3.2-1B`), with `--hf-config key=value`
overrides. The loss comes from the model's own `labels` path; `attn_implementation` is selectable
(sdpa or eager) since it changes what is saved. While the forward is traced, the mask code is made to run
as eager runs it (`_masks_as_in_eager`; dropout with p=0 is handled for every model by the capture, see
tracer/capture/eager_kernels.py). `transformers` is an optional extra: it is imported only here,
inside the functions that need it, with a clear error when it is missing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os

import torch
from torch import nn

from tracer.errors import ModelInputError

# model_type -> (config class, model class, task)
ARCHITECTURES = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", "causal"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", "causal"),
    "mistral": ("MistralConfig", "MistralForCausalLM", "causal"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", "causal"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", "causal"),          # mixtures of experts (README)
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", "causal"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "causal"),
    "bert": ("BertConfig", "BertForMaskedLM", "masked"),
    "t5": ("T5Config", "T5ForConditionalGeneration", "seq2seq"),
}


# settings a default config lacks for a training step from labels
_TRAINING_DEFAULTS = {"t5": {"decoder_start_token_id": 0, "pad_token_id": 0}}


@dataclasses.dataclass(frozen=True)
class HFSpec:
    name: str                                  # as given after "hf:"
    model_type: str
    config: dict                               # kwargs for the config class
    attn_implementation: str = "sdpa"


class LossFromLabels(nn.Module):
    """forward(input_ids, labels) -> the model's own loss (no KV cache)."""

    def __init__(self, model: nn.Module, task: str):
        super().__init__()
        self.model = model
        self.task = task

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        with _masks_as_in_eager():
            if self.task == "masked":
                return self.model(input_ids=input_ids, labels=labels).loss
            return self.model(input_ids=input_ids, labels=labels, use_cache=False).loss


@contextlib.contextmanager
def _masks_as_in_eager():
    """Under torch.export, transformers builds explicit causal masks (so the graph stays shape-generic), which
    also turns off SDPA's is_causal and native GQA and repeats K/V. Eager and torch.compile skip the mask.
    The tracer predicts what eager runs, so while tracing it answers "not exporting" to the mask code."""
    import transformers.masking_utils as masking

    saved = masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices

    def check_without_reading(packed_sequence_mask) -> bool:
        (packed_sequence_mask[:, -1] == 0).all()    # eager's check, whose value a fake tensor cannot give
        return True

    def unpacked(position_ids):
        is_tracing = masking.is_tracing
        masking.is_tracing = check_without_reading
        try:
            saved[1](position_ids)      # the same small temporaries eager makes, then "not packed", as the
        finally:                        # example batch's positions are plain 0..s-1 (eager reads the values)
            masking.is_tracing = is_tracing
        return None

    masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices = (lambda: False), unpacked
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices = saved


def parse_overrides(items: list[str] | tuple[str, ...]) -> dict:
    """['n_layer=2', 'rope_theta=1e4', 'tie_word_embeddings=false'] -> typed dict (JSON values, else strings)."""
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ModelInputError(f"--hf-config {item!r} is not key=value", hint="e.g. --hf-config num_hidden_layers=2")
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


def hf_spec(name: str, *, overrides: dict | None = None, config_json: str | None = None,
            attn_implementation: str = "sdpa") -> HFSpec:
    config: dict = {}
    model_type = name.lower().split("/")[-1]
    if config_json is not None:
        try:
            with open(config_json) as f:
                config = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelInputError(f"cannot read --config-json {config_json}: {exc}") from exc
        model_type = config.pop("model_type", None) or model_type
        for key in ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype"):
            config.pop(key, None)
    if model_type not in ARCHITECTURES:
        known = next((arch for arch in ARCHITECTURES if arch in model_type), None)
        if known is None or (config_json is None and "/" in name):
            raise ModelInputError(
                f"hf:{name}: cannot build it without a download",
                hint=f"pass --config-json with its config.json (model_type one of {', '.join(ARCHITECTURES)}), "
                     f"or use a short name: {', '.join('hf:' + a for a in ARCHITECTURES)}")
        model_type = known
    if attn_implementation not in ("sdpa", "eager"):
        raise ModelInputError(f"--hf-attn {attn_implementation!r}: use sdpa or eager")
    config = {**_TRAINING_DEFAULTS.get(model_type, {}), **config, **(overrides or {})}
    return HFSpec(name=name, model_type=model_type, config=config,
                  attn_implementation=attn_implementation)


def build_hf_model(spec: HFSpec) -> nn.Module:
    transformers = _import_transformers()
    config_cls, model_cls, task = ARCHITECTURES[spec.model_type]
    config = getattr(transformers, config_cls)(**spec.config)
    config._attn_implementation = spec.attn_implementation
    model = getattr(transformers, model_cls)(config)
    return LossFromLabels(model, task)


def hf_example_batch(spec: HFSpec, batch: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
    vocab = _vocab_size(spec)
    input_ids = torch.randint(0, vocab, (batch, seq))
    return input_ids, torch.randint(0, vocab, (batch, seq))


def _vocab_size(spec: HFSpec) -> int:
    if "vocab_size" in spec.config:
        return int(spec.config["vocab_size"])
    transformers = _import_transformers()
    return int(getattr(transformers, ARCHITECTURES[spec.model_type][0])().vocab_size)


def _import_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise ModelInputError("hf: models need the transformers package",
                              hint="pip install -e '.[hf]'") from exc
    os.environ.setdefault("HF_HUB_OFFLINE", "1")       # never reach for the hub
    transformers.logging.set_verbosity_error()
    return transformers
