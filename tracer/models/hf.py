"""Hugging Face transformers models built from a config, never from downloaded weights.

`hf:<model_type>` names an architecture by its transformers `model_type`, matched exactly (case and `-`/`_`
aside: `hf:gpt-neox` is gpt_neox; a name is never matched by a substring of it, and an unknown one is refused
with the close names). The config is the library's default for that model_type (`AutoConfig.for_model`), or
a local `config.json` (`--config-json`, whose `model_type` is used exactly, e.g. for
`hf:meta-llama/Llama-3.2-1B`), with `--hf-config key=value` overrides on top.

The head is a task (`--hf-task`, `TASKS`): its transformers auto mapping gives the class for the model_type
(causal-lm: LlamaForCausalLM, masked-lm: RobertaForMaskedLM, ...). Without `--hf-task`, a config.json's
`architectures` class is built when it is one of these heads; otherwise the first task of `DEFAULT_TASKS` the
architecture has (seq2seq before masked-lm before causal-lm: t5 is seq2seq, bert and roberta masked LMs,
whisper speech-seq2seq, vit image-classification). An architecture with none of these heads is refused,
never replaced by another.

The loss comes from the model's own `labels` path; the example batch is what a training step feeds that head
(`hf_example_batch`): token ids and labels of the same shape (a separate tensor, as a data collator's copy),
per-sequence class labels, pixel values at the config's image size (`--seq` unused; where the head also takes
inputs its own image processor makes, such as NaFlex's pixel_attention_mask and spatial_shapes, all of them as
that processor makes them of one image: `_image_layout`), token ids with such images where a token head puts
image features before the text and has no image placeholder token (`_images_before_text`: GIT), or speech features:
Whisper-style log-mel features (num_mel_bins x 2*max_source_positions frames) where the config fixes them,
else what the model's own feature extractor makes of AUDIO_SECONDS of audio (its axis order and frame count,
with an attention mask of ones where the head takes one; a note says so). A training step also needs settings some
default configs lack (`_training_settings`: no KV cache, also in nested configs; a decoder start and pad
token; the first of `languages` where a model with per-language adapters has no default language);
nothing else of the config is changed: axial position embeddings that do not split the width or fill the
sequence (`_check_axial_positions`: Reformer) are refused, naming values that fit. `attn_implementation` is selectable (sdpa or eager) since it changes what is saved. While
the forward is traced, the mask code is made to run as eager runs it (`_masks_as_in_eager`; dropout with p=0
is handled for every model by the capture, see tracer/capture/eager_kernels.py).

A CTC head (`ctc`) reads a waveform, `input_values` as its feature extractor makes them of AUDIO_SECONDS, with
`seq` label tokens that are never the blank (`_ctc_labels`).

Not handled: heads outside `TASKS` (question answering, object detection, ...), speech models without
a feature extractor making `input_features` or `input_values`, audio language models (token ids with audio placeholders), and models whose code lives on the hub (trust_remote_code): these are refused
with what to do (a model file can build any of them). `transformers` is an optional extra: it is imported
only here, inside the functions that need it, with a clear error when it is missing.
"""
from __future__ import annotations

import contextlib
import dataclasses
import difflib
import functools
import json
import os
import re

import torch
from torch import nn

from tracer.errors import ModelInputError, package_import_error
from tracer.models.hf_tasks import DEFAULT_TASKS, TASKS, Task  # noqa: F401 - data, without torch

_INPUT_NAMES = {"tokens": "input_ids", "image": "pixel_values", "audio": "input_features", "waveform": "input_values"}
_SPEC_KEYS_DROPPED = ("architectures", "transformers_version", "_name_or_path", "torch_dtype", "dtype", "auto_map")


@dataclasses.dataclass(frozen=True)
class HFSpec:
    name: str                                  # as given after "hf:"
    model_type: str                            # transformers' model_type, exactly
    task: str                                  # a key of TASKS
    model_class: str                           # transformers class name of the head, e.g. "RobertaForMaskedLM"
    config: dict                               # kwargs for the config class (config.json, then overrides)
    attn_implementation: str = "sdpa"


class LossFromLabels(nn.Module):
    """forward(*inputs) -> the model's own loss; `inputs` in the order of `input_names`, labels last."""

    def __init__(self, model: nn.Module, input_names: tuple[str, ...]):
        super().__init__()
        self.model = model
        self.input_names = input_names

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        with _masks_as_in_eager():
            return self.model(**dict(zip(self.input_names, inputs))).loss


@contextlib.contextmanager
def _masks_as_in_eager():
    """Under torch.export, transformers builds explicit causal masks (so the graph stays shape-generic), which
    also turns off SDPA's is_causal and native GQA and repeats K/V. Eager and torch.compile skip the mask.
    The tracer predicts what eager runs, so while tracing it answers "not exporting" to the mask code, and
    "not tracing" for a fake tensor (the step run op by op holds fake tensors where eager holds real ones)."""
    import transformers.masking_utils as masking

    saved = masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices

    def check_without_reading(packed_sequence_mask) -> bool:
        # eager's check `(packed_sequence_mask[:, -1] == 0).all()`, whose value a fake tensor cannot give: its
        # comparison's temporary is made; the 0-dim `.all()` eager reads into Python is left out, as the
        # joint graph leaves out a 0-dim truth value no op reads (2 FLOPs at batch 2), on both capture paths
        packed_sequence_mask[:, -1] == 0
        return True

    def unpacked(position_ids):
        is_tracing = masking.is_tracing
        masking.is_tracing = check_without_reading
        try:
            saved[1](position_ids)      # the same small temporaries eager makes, then "not packed", as the
        finally:                        # example batch's positions are plain 0..s-1 (eager reads the values)
            masking.is_tracing = is_tracing
        return None

    tracing = getattr(masking, "is_tracing", None)

    def tracing_as_eager(tensor=None) -> bool:
        # transformers counts a fake tensor as tracing (and then builds the mask it would skip in eager);
        # here a fake tensor stands for the real one, whose values eager reads
        return tracing(None) or isinstance(tensor, torch.fx.Proxy)

    masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices = (lambda: False), unpacked
    if tracing is not None:
        masking.is_tracing = tracing_as_eager
    try:
        yield
    finally:
        masking.is_torchdynamo_exporting, masking.find_packed_sequence_indices = saved
        if tracing is not None:
            masking.is_tracing = tracing


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
            attn_implementation: str = "sdpa", task: str | None = None) -> HFSpec:
    """What `hf:<name>` builds. Raises ModelInputError for an unknown model_type (naming the close ones), a
    hub name without --config-json, a config.json that contradicts the name, or a task the architecture has
    no head for."""
    if attn_implementation not in ("sdpa", "eager"):
        raise ModelInputError(f"--hf-attn {attn_implementation!r}: use sdpa or eager")
    if task is not None and task not in TASKS:
        raise ModelInputError(f"--hf-task {task!r} is not a task tracer builds", hint=f"valid: {', '.join(TASKS)}")
    known = _model_types()
    named_type = _exact_model_type(name, known)
    config: dict = {}
    architecture = None
    if config_json is None:
        if named_type is None:
            raise _unknown_name(name, known)
        model_type = named_type
    else:
        config = _read_config_json(config_json)
        model_type = config.pop("model_type", None)
        architectures = config.get("architectures") or []
        architecture = architectures[0] if architectures else None
        for key in _SPEC_KEYS_DROPPED:
            config.pop(key, None)
        if model_type is None:
            raise ModelInputError(f"--config-json {config_json} has no model_type",
                                  hint="add the model_type of its architecture, e.g. \"model_type\": \"llama\"")
        if model_type not in known:
            raise ModelInputError(f"--config-json {config_json}: model_type {model_type!r} is not an architecture "
                                  f"transformers {_version()} knows{_close_names(model_type, known)}",
                                  hint="its code may live on the hub (trust_remote_code): write a model file "
                                       "whose build_model() builds it")
        if named_type is not None and named_type != model_type:
            raise ModelInputError(f"hf:{name} names model_type {named_type!r} but --config-json {config_json} has "
                                  f"{model_type!r}", hint="name the config's architecture, or pass its hub name")
    chosen_task, model_class = _choose_head(name, model_type, task, architecture)
    config = {**config, **(overrides or {})}
    _check_layer_counts(config, config_json or f"hf:{name}")
    return HFSpec(name=name, model_type=model_type, task=chosen_task, model_class=model_class, config=config,
                  attn_implementation=attn_implementation)


# Layers a config may ask for: the deepest transformers trained have about a thousand (DeepNet's 1,000-layer
# post-LN stack); building more only delays the refusal that capture.build.MAX_BUILD_REGISTRATIONS gives a model file.
MAX_CONFIG_LAYERS = 4096
_LAYER_COUNT_KEY = re.compile(r"(^|_)layers?$")     # num_hidden_layers, n_layer, num_layers, decoder_layers ...


def _check_layer_counts(config: dict, where: str) -> None:
    """ModelInputError when a layer count of the config (or of a nested config: text_config, ...) is past
    MAX_CONFIG_LAYERS, before anything is built."""
    for key, value in config.items():
        if isinstance(value, dict):
            _check_layer_counts(value, where)
        elif (_LAYER_COUNT_KEY.search(key) and isinstance(value, int) and not isinstance(value, bool)
              and value > MAX_CONFIG_LAYERS):
            raise ModelInputError(f"{where}: {key} = {value:,} is more layers than tracer builds "
                                  f"(up to {MAX_CONFIG_LAYERS:,})",
                                  hint="check the config; a real model has at most a few hundred layers")


def build_hf_model(spec: HFSpec) -> nn.Module:
    transformers = _import_transformers()
    config = _make_config(spec)
    model_class = getattr(transformers, spec.model_class)
    config._attn_implementation = _attn_implementation(spec, model_class)
    _check_axial_positions(spec, config, None)
    model = _expert_parallel(model_class, model_class(config))
    return LossFromLabels(model, _input_names(spec))


def _expert_parallel(model_class, model: nn.Module) -> nn.Module:
    """Under --ep N (torch.distributed's default group has N ranks: tracer/capture/process_group.py), a
    model with an expert-parallel plan is split as transformers splits it for
    `from_pretrained(..., distributed_config=DistributedConfig(ep_size=N, tp_size=N, tp_plan={}))`: its
    experts' weights DTensors sharded over the N ranks, which share the batch and exchange the routed tokens
    with all-to-all. Otherwise the model as built."""
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1 \
            or not getattr(model, "ep_plan", None):
        return model
    from transformers.distributed import DistributedConfig
    ranks = dist.get_world_size()
    config, _, mesh = model_class.prepare_distribute_model(DistributedConfig(ep_size=ranks, tp_size=ranks, tp_plan={}))
    return model_class.maybe_distribute_model(model, config, mesh)


def _attn_implementation(spec: HFSpec, model_class) -> str:
    """sdpa where the class supports it, else eager (as transformers picks when none is asked for: models
    without attention, or with their own attention code, have no sdpa path)."""
    if spec.attn_implementation == "sdpa" and not getattr(model_class, "_supports_sdpa", True):
        return "eager"
    return spec.attn_implementation


def hf_example_batch(spec: HFSpec, batch: int, seq: int) -> tuple[torch.Tensor, ...]:
    """The forward's inputs for one training step of `spec`'s head, labels last (see the module docstring)."""
    task = TASKS[spec.task]
    config = _make_config(spec)
    if task.inputs == "tokens":
        _check_axial_positions(spec, config, seq)
        inputs = (torch.randint(0, _vocab_size(config, spec), (batch, seq)),)                # (b, s)
        if _images_before_text(spec, config):
            inputs += (_pixel_values(config, spec, batch),)                                   # (b, c, h, w)
    elif task.inputs == "image":
        layout = _image_layout(config, spec)
        if layout is None:
            inputs = (_pixel_values(config, spec, batch),)                                    # (b, c, h, w)
        else:                   # pixels as the processor lays them out, its other inputs as it makes them
            inputs = (torch.randn(batch, *layout.pixel_shape),                                # (b, patches, c*p*p)
                      *(torch.tensor(values).expand(batch, *torch.tensor(values).shape).clone()
                        for _, values in layout.others))
    else:
        layout = _audio_layout(config, spec, seq)
        inputs = (torch.randn(batch, *layout.features_shape),)       # (b, mels, frames), (b, frames, mels), (b, samples)
        if layout.mask_dtype is not None:                            # every frame is audio: a mask of ones
            inputs += (torch.ones(batch, layout.frames, dtype=getattr(torch, layout.mask_dtype)),)
    if task.labels == "sequence":
        labels = torch.randint(0, config.num_labels, (batch,))                              # (b,)
    elif spec.task == "token-classification":
        labels = torch.randint(0, config.num_labels, (batch, seq))                          # (b, s)
    elif spec.task == "ctc":
        labels = _ctc_labels(config, spec, batch, seq)                                      # (b, s)
    else:
        labels = torch.randint(0, _vocab_size(config, spec), (batch, seq))                  # (b, s)
    return (*inputs, labels)


def _ctc_labels(config, spec: HFSpec, batch: int, seq: int) -> torch.Tensor:
    """Token ids other than the blank (the config's pad_token_id): transformers' CTC loss drops blanks from
    the targets as padding, so every example's target is `seq` tokens long, as a collator's unpadded labels."""
    vocabulary = _vocab_size(config, spec)
    blank = getattr(config, "pad_token_id", None)
    if blank is None or not 0 <= blank < vocabulary:
        return torch.randint(0, vocabulary, (batch, seq))
    labels = torch.randint(0, vocabulary - 1, (batch, seq))
    return labels + (labels >= blank).long()


def _check_axial_positions(spec: HFSpec, config, seq: int | None) -> None:
    """Axial position embeddings (`axial_pos_embds`: Reformer) lay the positions out on a grid and split the
    width over its axes: `axial_pos_embds_dim` must sum to the hidden size and, in training, `axial_pos_shape`
    multiply to the sequence length. tracer changes no key the user did not set, so a config or --seq that
    breaks either is refused, naming the keys and values that would fit."""
    shape, dims = getattr(config, "axial_pos_shape", None), getattr(config, "axial_pos_embds_dim", None)
    if not getattr(config, "axial_pos_embds", False) or shape is None or dims is None:
        return
    width = int(config.hidden_size)
    if sum(dims) != width:
        raise ModelInputError(f"hf:{spec.name}: axial_pos_embds_dim {list(dims)} must sum to hidden_size {width} (the "
                              f"axial position embeddings are concatenated into the width)",
                              hint=f"pass --hf-config axial_pos_embds_dim={json.dumps(split_width(list(dims), width))}")
    grid = functools.reduce(lambda a, b: a * b, shape, 1)
    if seq is not None and seq != grid:
        raise ModelInputError(f"hf:{spec.name}: --seq {seq} must be the product of axial_pos_shape {list(shape)}, "
                              f"{grid}: axial positions train only on sequences that fill their grid",
                              hint=f"use --seq {grid}, or pass --hf-config "
                                   f"axial_pos_shape={json.dumps(axial_grid(seq, len(shape)))}")


def split_width(parts: list[int], width: int) -> list[int]:
    """`parts` rescaled in proportion to sum to `width` ([64, 192] -> 64: [16, 48]); each part at least 1."""
    total = sum(parts)
    scaled = [max(1, part * width // total) for part in parts[:-1]]
    return [*scaled, max(1, width - sum(scaled))]


def axial_grid(positions: int, axes: int) -> list[int]:
    """`axes` factors of `positions`, as even as its divisors allow, largest first (1024, 2 -> [32, 32]; 16 -> [4, 4])."""
    factors = []
    for axis in range(axes, 1, -1):
        factor = max(d for d in range(1, positions + 1) if positions % d == 0 and d ** axis <= positions)
        factors.append(factor)
        positions //= factor
    return sorted([*factors, positions], reverse=True)


def _pixel_values(config, spec: HFSpec, batch: int) -> torch.Tensor:
    height, width = _image_size(config, spec)
    return torch.randn(batch, _num_channels(config), height, width)                         # (b, c, h, w)


_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")


def hf_failure_hint(spec: HFSpec) -> str:
    """What to say when building or tracing `spec`'s model fails: the code is transformers', not the user's."""
    config = _make_config(spec)
    if any(isinstance(getattr(config, key, None), int) and getattr(config, key) > 1 for key in _EXPERT_COUNTS):
        return (f"{spec.model_class} is a mixture of experts, built as one, traced under the --moe-routing "
                f"assumption: try --hf-config experts_implementation=eager (the per-expert loop) or another "
                f"--moe-routing")
    return (f"{spec.model_class} is transformers' code: try --hf-attn eager or another --capture, or build it "
            f"in a model file")


def _input_names(spec: HFSpec) -> tuple[str, ...]:
    inputs = TASKS[spec.task].inputs
    config = _make_config(spec)
    if inputs in ("audio", "waveform") and _audio_layout(config, spec, None).mask_dtype is not None:
        return _INPUT_NAMES[inputs], "attention_mask", "labels"
    if inputs == "tokens" and _images_before_text(spec, config):
        return _INPUT_NAMES[inputs], "pixel_values", "labels"
    if inputs == "image" and (layout := _image_layout(config, spec)) is not None:
        return _INPUT_NAMES[inputs], *(name for name, _ in layout.others), "labels"
    return _INPUT_NAMES[inputs], "labels"


def _make_config(spec: HFSpec):
    """The config object: model_type's config class from spec.config, plus `_training_settings`."""
    _import_transformers()
    from transformers import AutoConfig
    try:
        config = AutoConfig.for_model(spec.model_type, **spec.config)
    except (TypeError, ValueError) as exc:
        raise ModelInputError(f"hf:{spec.name}: the {spec.model_type} config rejects the given fields: {exc}",
                              hint="check --hf-config / --config-json") from exc
    for key, value in _training_settings(spec, config).items():
        setattr(config, key, value)
    for sub in _sub_configs(config):           # a composite model's language model reads its own use_cache
        if getattr(sub, "use_cache", False):
            sub.use_cache = False
    return config


def _sub_configs(config) -> list:
    """The configs nested in a composite config (`text_config`, `vision_config`, ...), at any depth."""
    out = []
    for key in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "to_dict"):
            out += [sub] + _sub_configs(sub)
    return out


def _training_settings(spec: HFSpec, config) -> dict:
    """Settings a training step from labels needs that a default config may lack: no KV cache; an
    encoder-decoder needs a decoder start token (to shift the labels right) and a pad token; a decoder's
    sequence classifier needs a pad token (it pools the last non-pad position). Values the config or the
    user set are kept."""
    out = {}
    if getattr(config, "use_cache", False):
        out["use_cache"] = False
    needs_pad = spec.task in ("seq2seq", "speech-seq2seq", "sequence-classification")
    if needs_pad and getattr(config, "pad_token_id", None) is None:
        out["pad_token_id"] = 0
    if spec.task in ("seq2seq", "speech-seq2seq") and getattr(config, "decoder_start_token_id", None) is None:
        out["decoder_start_token_id"] = out.get("pad_token_id", getattr(config, "pad_token_id", 0))
    languages = getattr(config, "languages", None)
    if hasattr(config, "default_language") and config.default_language is None and languages:
        out["default_language"] = list(languages)[0]    # per-language adapters (X-MOD): the batch's language
    return out


def _choose_head(name: str, model_type: str, task: str | None, architecture: str | None) -> tuple[str, str]:
    """(task, head class name) for model_type: the asked task, else the config.json's architecture, else the
    first of DEFAULT_TASKS it has."""
    heads = _heads(model_type)
    if task is not None:
        if task not in heads:
            raise ModelInputError(f"hf:{name}: {model_type} has no {task} head in transformers {_version()}",
                                  hint=_tasks_hint(model_type, heads))
        return task, heads[task]
    if architecture is not None:
        for candidate, cls in heads.items():
            if cls == architecture:
                return candidate, cls
        raise ModelInputError(f"hf:{name}: the config.json's architecture {architecture} is not a head tracer "
                              f"builds an example batch for", hint=_tasks_hint(model_type, heads))
    for candidate in DEFAULT_TASKS:
        if candidate in heads:
            return candidate, heads[candidate]
    raise ModelInputError(f"hf:{name}: {model_type} has none of the heads tracer builds ({', '.join(TASKS)})",
                          hint=_tasks_hint(model_type, heads))


def _heads(model_type: str) -> dict[str, str]:
    """task -> head class name, for the tasks of TASKS that model_type has and whose inputs tracer makes."""
    _import_transformers()
    import transformers
    from transformers.models.auto import modeling_auto
    out = {}
    for task_name, task in TASKS.items():
        cls = getattr(modeling_auto, task.mapping).get(model_type)
        if isinstance(cls, (tuple, list)):
            cls = cls[0]
        if cls is None or not hasattr(transformers, cls):
            continue
        head = getattr(transformers, cls)
        if getattr(head, "main_input_name", None) == _INPUT_NAMES[task.inputs] and _takes_labels(head):
            out[task_name] = cls
    return out


def _takes_labels(head) -> bool:
    """The head's forward can return a loss from `labels`: it names `labels`, or its declared output has a
    `loss` field (a head whose output has none, e.g. a backbone's features, has no loss to train)."""
    import inspect
    try:
        signature = inspect.signature(head.forward)
    except (TypeError, ValueError):
        return True
    output = signature.return_annotation
    if "labels" in signature.parameters or not dataclasses.is_dataclass(output):
        return True
    return "loss" in {field.name for field in dataclasses.fields(output)}


def _tasks_hint(model_type: str, heads: dict[str, str]) -> str:
    if heads:
        return f"pass --hf-task one of {', '.join(heads)}"
    return "write a model file whose build_model() builds it with its loss"


def _vocab_size(config, spec: HFSpec) -> int:
    """The token vocabulary: the config's own, else its text (decoder) sub-config's, as a multimodal model's
    language head reads it."""
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        vocab = getattr(_text_config(config), "vocab_size", None)
    if vocab is None:
        raise ModelInputError(f"hf:{spec.name}: the {spec.model_type} config has no vocab_size to draw token ids from",
                              hint="pass --hf-config vocab_size=N, or write a model file")
    return int(vocab)


def _text_config(config):
    try:
        return config.get_text_config(decoder=True)
    except (AttributeError, TypeError, ValueError):
        return None


DEFAULT_IMAGE_SIZE = 224        # the ImageNet crop, where a config leaves the size to the input (conv nets)
DEFAULT_NUM_CHANNELS = 3


def _image_size(config, spec: HFSpec) -> tuple[int, int]:
    size = _vision_field(config, "image_size") or DEFAULT_IMAGE_SIZE
    return (int(size), int(size)) if isinstance(size, int) else (int(size[0]), int(size[1]))


def _num_channels(config) -> int:
    return int(_vision_field(config, "num_channels") or DEFAULT_NUM_CHANNELS)


def _vision_field(config, key: str):
    """`key` of the config, else of its vision sub-config (CLIP, SigLIP); None where neither has it."""
    value = getattr(config, key, None)
    if value is None:
        value = getattr(getattr(config, "vision_config", None), key, None)
    return value


def _images_before_text(spec: HFSpec, config) -> bool:
    """A token head that also reads images and has no image placeholder token (no `*image_token*` key in its
    config) puts the image features before the text (GIT): its loss skips those positions, so the batch
    carries images too. A head with placeholders reads images only where the token ids name them: text only."""
    if getattr(config, "vision_config", None) is None or "pixel_values" not in _forward_parameters(spec):
        return False
    return not any("image_token" in key for key in config.to_dict())


def _forward_parameters(spec: HFSpec) -> tuple[str, ...]:
    import inspect
    return tuple(inspect.signature(getattr(_import_transformers(), spec.model_class).forward).parameters)


@dataclasses.dataclass(frozen=True)
class ImageLayout:
    pixel_shape: tuple[int, ...]            # one example's pixel_values, e.g. (patches, channels*patch*patch)
    others: tuple                           # (name, one example's values as a numpy array), in forward's order
    processor: str                          # the image processor the layout was read from
    image_size: tuple[int, int]             # the (height, width) of the dummy image it was made of


def _image_layout(config, spec: HFSpec) -> ImageLayout | None:
    """How the head reads images where its forward takes inputs its own image processor (transformers'
    IMAGE_PROCESSOR_MAPPING) makes beside pixel_values (NaFlex: patchified pixels with pixel_attention_mask and
    spatial_shapes): what that processor, at the config's patch size, makes of one image at the config's size.
    None where the head takes pixel_values alone: images at the config's size, channels first."""
    height, width = _image_size(config, spec)
    patch = _vision_field(config, "patch_size")
    return _processor_layout(spec.name, spec.model_type, spec.model_class, _forward_parameters(spec),
                             height, width, None if patch is None else int(patch))


@functools.lru_cache(maxsize=None)
def _processor_layout(spec_name: str, model_type: str, model_class: str, takes: tuple[str, ...], height: int,
                      width: int, patch: int | None) -> ImageLayout | None:
    transformers = _import_transformers()
    processor_class = _image_processor_class(model_type, transformers)
    names = getattr(processor_class, "model_input_names", None) or ()
    others = [name for name in takes if name in names and name != "pixel_values"]
    if processor_class is None or not others:
        return None
    try:                                # real arrays, whatever device the model is being built on
        with torch.device("cpu"):
            return _probe_processor(processor_class, others, height, width, patch)
    except Exception as exc:            # transformers' own code (a missing optional package, ...)
        raise ModelInputError(f"hf:{spec_name}: {model_class} takes {', '.join(others)} beside pixel_values, which "
                              f"tracer makes as {processor_class.__name__} does, and it failed on a dummy image: "
                              f"{type(exc).__name__}: {exc}", hint="write a model file with its example batch") from exc


def _image_processor_class(model_type: str, transformers):
    """model_type's image processor class: the PIL one first (it needs no torchvision); None where it has none."""
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES
    names = IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type)
    if isinstance(names, dict):
        names = [names.get("pil"), *names.values()]
    elif not isinstance(names, (tuple, list)):
        names = [names]
    for name in names:
        try:
            return getattr(transformers, name)
        except (TypeError, AttributeError, ImportError):       # None, or a backend that is not installed
            continue
    return None


def _probe_processor(processor_class, others: list[str], height: int, width: int, patch: int | None) -> ImageLayout:
    import numpy as np
    processor = processor_class(**({} if patch is None else {"patch_size": patch}))
    made = processor(np.zeros((height, width, 3), dtype=np.uint8), return_tensors="np")
    pixels = np.asarray(made["pixel_values"])
    return ImageLayout(pixel_shape=tuple(int(n) for n in pixels.shape[1:]),
                       others=tuple((name, np.asarray(made[name])[0]) for name in others),
                       processor=processor_class.__name__, image_size=(height, width))


def hf_batch_notes(spec: HFSpec) -> tuple[str, ...]:
    """The assumptions `hf_example_batch` makes for `spec` that the config does not state, for the report."""
    if TASKS[spec.task].inputs in ("audio", "waveform"):
        layout = _audio_layout(_make_config(spec), spec, None)
        if not layout.extractor:
            return ()
        mask = "" if layout.mask_dtype is None else f" and an attention mask of ones ({layout.mask_dtype})"
        made = (f"features {' x '.join(map(str, layout.features_shape))} ({layout.frames} frames)"
                if len(layout.features_shape) == 2 else f"input_values of {layout.frames} samples")
        return (f"hf:{spec.name}: the example batch is {AUDIO_SECONDS} s of audio per example as {layout.extractor} "
                f"lays it out: {made}{mask}; for longer audio write a model file with its example batch",)
    config = _make_config(spec)
    if TASKS[spec.task].inputs == "tokens" and _images_before_text(spec, config):
        height, width = _image_size(config, spec)
        return (f"hf:{spec.name}: {spec.model_class} puts image features before the text (its config names no image "
                f"placeholder token): the example batch is token ids and one {_num_channels(config)} x {height} x "
                f"{width} image per example",)
    if TASKS[spec.task].inputs != "image":
        return ()
    layout = _image_layout(config, spec)
    if layout is not None:
        made = ", ".join(f"{name} {values.tolist()}" if values.size <= 4 else f"{name} {' x '.join(map(str, values.shape))}"
                         f" ({values.dtype})" for name, values in layout.others)
        return (f"hf:{spec.name}: the example batch is what {layout.processor} makes of one "
                f"{layout.image_size[0]} x {layout.image_size[1]} image per example: pixel_values "
                f"{' x '.join(map(str, layout.pixel_shape))}, {made}",)
    missing = [key for key in ("image_size", "num_channels") if _vision_field(config, key) is None]
    if not missing:
        return ()
    height, width = _image_size(config, spec)
    return (f"hf:{spec.name}: the {spec.model_type} config has no {'/'.join(missing)}; the example batch is "
            f"{_num_channels(config)} x {height} x {width} images (pass --hf-config image_size=N to change it)",)


AUDIO_SECONDS = 1           # of silence, as the model's own feature extractor turns it into features


@dataclasses.dataclass(frozen=True)
class AudioLayout:
    features_shape: tuple[int, ...]         # one example's input_features: (mels, frames) or (frames, mels);
                                            # its input_values (a waveform): (samples,)
    frames: int                             # frames, or samples of a waveform
    mask_dtype: str | None = None           # the extractor's attention_mask dtype, where the head takes one
    extractor: str = ""                     # the feature extractor the layout was read from ("": Whisper's rule)


def _audio_layout(config, spec: HFSpec, seq: int | None) -> AudioLayout:
    """How the head reads audio. An encoder with fixed positions over mel frames (num_mel_bins and
    max_source_positions in its config: Whisper) takes exactly 2 * max_source_positions frames, mels first.
    Any other speech model reads what its own feature extractor (transformers' FEATURE_EXTRACTOR_MAPPING)
    makes of AUDIO_SECONDS of audio at the config's feature count: its axis order, its frame count and its
    attention mask (ones, in the extractor's dtype) where the head takes one. At most max_target_positions
    label tokens."""
    limit = getattr(config, "max_target_positions", None)
    if seq is not None and limit is not None and seq > limit:
        raise ModelInputError(f"hf:{spec.name}: --seq {seq} is longer than the decoder's max_target_positions {limit}",
                              hint=f"use --seq {limit} or less, or --hf-config max_target_positions={seq}")
    if TASKS[spec.task].inputs == "waveform":
        return _extractor_layout(spec.name, spec.model_type, None, spec.model_class, "input_values")
    mels, positions = getattr(config, "num_mel_bins", None), getattr(config, "max_source_positions", None)
    if mels is not None and positions is not None:
        return AudioLayout(features_shape=(int(mels), 2 * int(positions)), frames=2 * int(positions))
    return _extractor_layout(spec.name, spec.model_type, _audio_feature_count(config), spec.model_class)


def _audio_feature_count(config) -> int | None:
    """Mel bins per frame from the config, its encoder's or its audio sub-config; None: the extractor's default."""
    for cfg in (config, getattr(config, "encoder_config", None), getattr(config, "audio_config", None)):
        mels = getattr(cfg, "num_mel_bins", None)
        if mels is not None:
            return int(mels)
    per_channel = getattr(config, "input_feat_per_channel", None)       # Speech2Text: per channel x channels
    if per_channel is not None:
        return int(per_channel) * int(getattr(config, "input_channels", 1) or 1)
    return None


@functools.lru_cache(maxsize=None)
def _extractor_layout(spec_name: str, model_type: str, mels: int | None, model_class: str,
                      input_name: str = "input_features") -> AudioLayout:
    transformers = _import_transformers()
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES
    name = FEATURE_EXTRACTOR_MAPPING_NAMES.get(model_type)
    refusal = ModelInputError(f"hf:{spec_name}: tracer makes speech batches as a model's own feature extractor lays "
                              f"them out; {model_type} has no usable one" + (f" ({name})" if name else ""),
                              hint="write a model file with its example batch")
    if name is None or not hasattr(transformers, name):
        raise refusal
    extractor_class = getattr(transformers, name)
    try:                                # real arrays, whatever device the model is being built on
        with torch.device("cpu"):
            return _probe_extractor(extractor_class, mels, model_class, transformers, input_name)
    except Exception as exc:            # transformers' own code (a missing optional package, ...)
        raise refusal from exc


def _probe_extractor(extractor_class, mels: int | None, model_class: str, transformers,
                     input_name: str = "input_features") -> AudioLayout:
    """One example's features as the extractor makes them of AUDIO_SECONDS of silence: their axis order (the
    axis of `mels` values is the feature axis), frame count and attention mask dtype; for `input_values` (a
    waveform, as wav2vec2's extractor makes it) its sample count."""
    import inspect
    import numpy as np
    sizes = {"feature_size": mels}               # Speech2Text's extractor also has a mel count of its own
    if "num_mel_bins" in inspect.signature(extractor_class.__init__).parameters:
        sizes["num_mel_bins"] = mels
    extractor = extractor_class(**sizes) if mels is not None else extractor_class()
    rate = int(getattr(extractor, "sampling_rate", 16000))
    made = extractor(np.zeros(rate * AUDIO_SECONDS, dtype=np.float32), sampling_rate=rate, return_tensors="np")
    features = np.asarray(made[input_name])
    if features.ndim != (2 if input_name == "input_values" else 3):
        raise ValueError(f"{input_name} of {features.ndim} dimensions")
    takes_mask = "attention_mask" in inspect.signature(getattr(transformers, model_class).forward).parameters
    mask = np.asarray(made["attention_mask"]) if "attention_mask" in made and takes_mask else None
    mask_dtype = None if mask is None else ("bool" if mask.dtype == np.bool_ else str(mask.dtype))
    if input_name == "input_values":
        samples = int(features.shape[1])
        return AudioLayout(features_shape=(samples,), frames=samples, mask_dtype=mask_dtype,
                           extractor=extractor_class.__name__)
    feature_count = mels if mels is not None else int(extractor.feature_size)
    _, first, second = features.shape
    frames = second if first == feature_count else first
    return AudioLayout(features_shape=(int(first), int(second)), frames=int(frames), mask_dtype=mask_dtype,
                       extractor=extractor_class.__name__)


def _read_config_json(path: str) -> dict:
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelInputError(f"cannot read --config-json {path}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelInputError(f"--config-json {path} is not a JSON object")
    return config


def _exact_model_type(name: str, known: tuple[str, ...]) -> str | None:
    """The model_type `name` is, exactly, ignoring case and `-` vs `_`; None for anything else (hub names)."""
    wanted = name.lower()
    if wanted in known:
        return wanted
    matches = [t for t in known if t.replace("-", "_") == wanted.replace("-", "_")]
    return matches[0] if len(matches) == 1 else None


def _unknown_name(name: str, known: tuple[str, ...]) -> ModelInputError:
    if "/" in name:
        return ModelInputError(f"hf:{name}: cannot build it without a download",
                               hint="pass --config-json with its config.json (its model_type names the "
                                    "architecture), or use a model_type: hf:llama, hf:gpt2, hf:t5, ...")
    return ModelInputError(f"hf:{name}: no transformers {_version()} model_type is {name!r}"
                           f"{_close_names(name.lower(), known)}",
                           hint="use a model_type exactly (hf:llama, hf:gpt_neox, hf:vit, ...), or --config-json")


def _close_names(name: str, known: tuple[str, ...]) -> str:
    close = difflib.get_close_matches(name, known, n=5, cutoff=0.6)
    return f"; close names: {', '.join(close)}" if close else ""


def _model_types() -> tuple[str, ...]:
    _import_transformers()
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    return tuple(CONFIG_MAPPING_NAMES)


def _version() -> str:
    return _import_transformers().__version__


def _import_transformers():
    try:
        import transformers
    except ImportError as exc:
        raise package_import_error("an hf: model", ("transformers",), exc, install="pip install -e '.[hf]'",
                                   error=ModelInputError) from exc
    os.environ.setdefault("HF_HUB_OFFLINE", "1")       # never reach for the hub
    transformers.logging.set_verbosity_error()
    return transformers
