"""`hf:` resolves a transformers model_type exactly, builds the head `--hf-task` (or the architecture's default)
names, and traces it to a prediction. Tiny configs; nothing is downloaded. Exactness against a real CPU step
is in tests/accuracy/test_hf.py."""
import json

import pytest
import torch

from optional import needs
from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.errors import ExitCode, ModelInputError, ModelRunError
from tracer.models.hf import build_hf_model, hf_batch_notes, hf_example_batch, hf_spec, parse_overrides

# builds transformers models (importing transformers alone takes seconds; collecting this module does not)
pytestmark = [pytest.mark.slow, needs("transformers", reason="the hf extra (pip install -e '.[hf]')")]

TINY = ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=64", "num_attention_heads=2", "vocab_size=128")
CONFIGS = {
    "roberta": TINY,
    "distilbert": ("n_layers=1", "dim=32", "hidden_dim=64", "n_heads=2", "vocab_size=128"),
    "opt": ("num_hidden_layers=1", "hidden_size=32", "ffn_dim=64", "num_attention_heads=2", "vocab_size=128",
            "word_embed_proj_dim=32"),
    "gpt_neox": TINY,
    "phi": TINY,
    "gemma": TINY + ("num_key_value_heads=1", "head_dim=16"),
    "falcon": ("num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "vocab_size=128"),
    "vit": ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=64", "num_attention_heads=2", "image_size=32",
            "patch_size=8"),
    "whisper": ("encoder_layers=1", "decoder_layers=1", "d_model=32", "encoder_attention_heads=2",
                "decoder_attention_heads=2", "encoder_ffn_dim=64", "decoder_ffn_dim=64", "vocab_size=128",
                "num_mel_bins=8", "max_source_positions=16", "max_target_positions=32", "pad_token_id=0",
                "bos_token_id=1", "eos_token_id=2", "decoder_start_token_id=1"),
    "speech_to_text": ("encoder_layers=1", "decoder_layers=1", "d_model=32", "encoder_attention_heads=2",
                       "decoder_attention_heads=2", "encoder_ffn_dim=64", "decoder_ffn_dim=64", "vocab_size=128",
                       "conv_channels=16", "input_feat_per_channel=16"),
    "canary": ("vocab_size=128", 'encoder_config={"hidden_size":32,"num_hidden_layers":1,"num_attention_heads":2,'
               '"num_key_value_heads":2,"intermediate_size":64,"num_mel_bins":16,"subsampling_conv_channels":16}',
               'decoder_config={"vocab_size":128,"hidden_size":32,"intermediate_size":64,"num_hidden_layers":1,'
               '"num_attention_heads":2,"num_key_value_heads":2,"head_dim":16}'),
    "t5": ("num_layers=1", "d_model=32", "d_ff=64", "num_heads=2", "d_kv=16", "vocab_size=128"),
    "mixtral": TINY + ("num_key_value_heads=1", "num_local_experts=4", "num_experts_per_tok=2"),
    "resnet": ("embedding_size=8", "hidden_sizes=[8,8,8,8]", "depths=[1,1,1,1]", "layer_type=basic"),
    "clip": ("vision_config={\"num_hidden_layers\":1,\"hidden_size\":32,\"intermediate_size\":64,"
             "\"num_attention_heads\":2,\"image_size\":32,\"patch_size\":8}",),
    "gemma3": ("text_config={\"num_hidden_layers\":1,\"hidden_size\":32,\"intermediate_size\":64,"
               "\"num_attention_heads\":2,\"num_key_value_heads\":1,\"head_dim\":16,\"vocab_size\":128}",
               "vision_config={\"num_hidden_layers\":1,\"hidden_size\":32,\"intermediate_size\":64,"
               "\"num_attention_heads\":2,\"image_size\":32,\"patch_size\":8}", "mm_tokens_per_image=4"),
    "siglip2": ("vision_config={\"num_hidden_layers\":1,\"hidden_size\":32,\"intermediate_size\":64,"
                "\"num_attention_heads\":2,\"patch_size\":8}",),
    "git": TINY + ("vision_config={\"num_hidden_layers\":1,\"hidden_size\":32,\"intermediate_size\":64,"
                   "\"num_attention_heads\":2,\"image_size\":32,\"patch_size\":8}",),
}


def _built(name, task=None, config=None):
    spec = hf_spec(name, overrides=parse_overrides(CONFIGS[config or name]), task=task)
    return spec, build_hf_model(spec).model


@pytest.mark.parametrize("name, head", [
    ("roberta", "RobertaForMaskedLM"), ("distilbert", "DistilBertForMaskedLM"), ("opt", "OPTForCausalLM"),
    ("gpt_neox", "GPTNeoXForCausalLM"), ("phi", "PhiForCausalLM"), ("gemma", "GemmaForCausalLM"),
    ("falcon", "FalconForCausalLM"), ("t5", "T5ForConditionalGeneration"),
    ("whisper", "WhisperForConditionalGeneration"), ("vit", "ViTForImageClassification"),
    ("mixtral", "MixtralForCausalLM"),
])
def test_each_model_type_builds_its_own_default_head(name, head):
    """Never another architecture's model: roberta and distilbert used to build BERT."""
    spec, model = _built(name)
    assert type(model).__name__ == head == spec.model_class
    assert model.config.model_type == name


def test_the_name_is_a_model_type_exactly_ignoring_case_and_dash_vs_underscore():
    assert hf_spec("gpt-neox").model_type == "gpt_neox"
    assert hf_spec("GPT_NeoX").model_type == "gpt_neox"
    assert hf_spec("xlm_roberta").model_type == "xlm-roberta"


@pytest.mark.parametrize("name", ["llama3", "bert-base-uncased", "robert", "qwen", "gpt"])
def test_a_substring_or_prefix_of_a_model_type_is_refused(name):
    with pytest.raises(ModelInputError) as info:
        hf_spec(name)
    assert info.value.exit_code == ExitCode.USAGE


def test_an_unknown_name_is_refused_naming_the_close_ones():
    with pytest.raises(ModelInputError, match="close names: .*\\bllama\\b") as info:
        load_model_source("hf:lama")
    assert info.value.exit_code == ExitCode.USAGE


@pytest.mark.parametrize("task, head, label_shape", [
    ("causal-lm", "LlamaForCausalLM", (2, 16)),
    ("sequence-classification", "LlamaForSequenceClassification", (2,)),
    ("token-classification", "LlamaForTokenClassification", (2, 16)),
])
def test_hf_task_chooses_the_head_and_its_labels(task, head, label_shape):
    spec = hf_spec("llama", overrides=parse_overrides(TINY), task=task)
    model = build_hf_model(spec)
    batch = hf_example_batch(spec, 2, 16)
    assert type(model.model).__name__ == head
    assert tuple(batch[-1].shape) == label_shape
    assert model(*batch).numel() == 1


def test_hf_task_picks_a_causal_lm_over_robertas_default_masked_lm():
    _, model = _built("roberta", task="causal-lm")
    assert type(model).__name__ == "RobertaForCausalLM"


def test_a_task_the_architecture_lacks_is_refused_with_the_ones_it_has():
    with pytest.raises(ModelInputError, match="vit has no causal-lm head.*image-classification"):
        hf_spec("vit", task="causal-lm")


def test_an_unknown_task_is_refused():
    with pytest.raises(ModelInputError, match="valid: causal-lm"):
        hf_spec("llama", task="causal")


def _config_json(tmp_path, **config):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


MOE = dict(model_type="qwen2_moe", num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
           num_key_value_heads=1, vocab_size=128, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
           shared_expert_intermediate_size=32)


def test_a_qwen2_moe_config_json_builds_a_mixture_of_experts(tmp_path):
    """It used to build a dense Qwen2 (the model_type contains 'qwen2') with the experts dropped."""
    source = load_model_source("hf:Qwen/Qwen1.5-MoE-A2.7B", config_json=_config_json(tmp_path, **MOE))
    model = source.build_model().model
    assert type(model).__name__ == "Qwen2MoeForCausalLM"
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "Qwen2MoeExperts"
    assert experts.gate_up_proj.shape[0] == 4                          # (experts, 2 * moe_intermediate, hidden)
    assert "mixture of experts" in source.failure_hint


def test_a_config_jsons_architectures_names_the_head(tmp_path):
    path = _config_json(tmp_path, **MOE, architectures=["Qwen2MoeForSequenceClassification"])
    spec = hf_spec("Qwen/some-classifier", config_json=path)
    assert (spec.task, spec.model_class) == ("sequence-classification", "Qwen2MoeForSequenceClassification")
    assert hf_spec("Qwen/some-classifier", config_json=path, task="causal-lm").model_class == "Qwen2MoeForCausalLM"


def test_a_config_json_contradicting_the_named_model_type_is_refused(tmp_path):
    with pytest.raises(ModelInputError, match="names model_type 'qwen2' but .* has 'qwen2_moe'"):
        hf_spec("qwen2", config_json=_config_json(tmp_path, **MOE))


def test_a_config_json_with_an_unknown_model_type_is_refused(tmp_path):
    with pytest.raises(ModelInputError, match="model_type 'qwen2_moee' is not .*close names: qwen2_moe"):
        hf_spec("my-model", config_json=_config_json(tmp_path, **{**MOE, "model_type": "qwen2_moee"}))


def test_whisper_gets_log_mel_features_of_the_length_its_encoder_takes():
    spec = hf_spec("whisper", overrides=parse_overrides(CONFIGS["whisper"]))
    features, labels = hf_example_batch(spec, 2, 16)
    assert tuple(features.shape) == (2, 8, 32) and tuple(labels.shape) == (2, 16)   # (b, mels, 2 * source positions)
    with pytest.raises(ModelInputError, match="max_target_positions 32"):
        hf_example_batch(spec, 2, 64)


def test_a_speech_model_outside_whispers_layout_gets_what_its_feature_extractor_makes_and_says_so():
    """Speech2Text reads (frames, mels) features with an int32 mask; Parakeet's (canary's) encoder a bool mask,
    its mel count from the encoder's config: 1 s of audio each, as their extractors lay it out."""
    spec = hf_spec("speech_to_text", overrides=parse_overrides(CONFIGS["speech_to_text"]))
    features, mask, labels = hf_example_batch(spec, 2, 16)
    assert tuple(features.shape) == (2, 98, 16) and tuple(labels.shape) == (2, 16)
    assert mask.dtype == torch.int32 and tuple(mask.shape) == (2, 98) and bool((mask == 1).all())
    assert build_hf_model(spec).input_names == ("input_features", "attention_mask", "labels")
    assert any("1 s of audio" in note and "Speech2TextFeatureExtractor" in note for note in hf_batch_notes(spec))
    canary = hf_spec("canary", overrides=parse_overrides(CONFIGS["canary"]))
    features, mask, _ = hf_example_batch(canary, 1, 8)
    assert tuple(features.shape) == (1, 101, 16) and mask.dtype == torch.bool
    whisper = hf_spec("whisper", overrides=parse_overrides(CONFIGS["whisper"]))
    assert hf_batch_notes(whisper) == ()           # its config fixes the layout: nothing assumed


def test_a_conv_net_without_an_image_size_gets_imagenet_images_and_says_so():
    spec = hf_spec("resnet", overrides=parse_overrides(CONFIGS["resnet"]))
    pixels, labels = hf_example_batch(spec, 2, 16)
    assert tuple(pixels.shape) == (2, 3, 224, 224) and tuple(labels.shape) == (2,)
    graph, _ = _predict("resnet")
    assert any("no image_size" in note and "3 x 224 x 224" in note for note in graph.config.notes)


def test_a_vision_sub_config_gives_the_image_size_and_the_model_is_built_without_sdpa_where_it_has_none():
    spec = hf_spec("clip", overrides=parse_overrides(CONFIGS["clip"]))
    assert spec.model_class == "CLIPForImageClassification"
    pixels, _ = hf_example_batch(spec, 2, 16)
    assert tuple(pixels.shape) == (2, 3, 32, 32)
    resnet = build_hf_model(hf_spec("resnet", overrides=parse_overrides(CONFIGS["resnet"]))).model
    assert resnet.config._attn_implementation == "eager"      # ResNet has no sdpa path; sdpa is not refused


def test_a_naflex_vision_model_gets_the_patchified_batch_its_image_processor_makes_and_says_so():
    """SigLIP2 reads patches (b, patches, c*p*p) with pixel_attention_mask and spatial_shapes, as
    Siglip2ImageProcessor makes them: at patch 8 its 256-patch budget is a 16 x 16 grid of a 224 x 224 image."""
    spec = hf_spec("siglip2", overrides=parse_overrides(CONFIGS["siglip2"]))
    pixels, mask, shapes, labels = hf_example_batch(spec, 2, 16)
    assert tuple(pixels.shape) == (2, 256, 3 * 8 * 8) and tuple(labels.shape) == (2,)
    assert mask.dtype == torch.int32 and tuple(mask.shape) == (2, 256) and bool((mask == 1).all())
    assert shapes.tolist() == [[16, 16], [16, 16]]
    model = build_hf_model(spec)
    assert model.input_names == ("pixel_values", "pixel_attention_mask", "spatial_shapes", "labels")
    model(pixels, mask, shapes, labels).backward()          # the real model runs on it
    assert any("Siglip2ImageProcessor" in note and "spatial_shapes [16, 16]" in note for note in hf_batch_notes(spec))
    vit = hf_spec("vit", overrides=parse_overrides(CONFIGS["vit"]))
    assert build_hf_model(vit).input_names == ("pixel_values", "labels")     # its processor makes pixels only


def test_a_token_head_that_puts_image_features_before_the_text_gets_images_too():
    """GIT's loss skips its image positions (logits[:, image tokens:]): token ids alone leave no logits to
    score. Gemma3 names an image placeholder token, so it stays text only."""
    spec = hf_spec("git", overrides=parse_overrides(CONFIGS["git"]))
    tokens, pixels, labels = hf_example_batch(spec, 2, 16)
    assert tuple(tokens.shape) == (2, 16) and tuple(pixels.shape) == (2, 3, 32, 32) and tuple(labels.shape) == (2, 16)
    model = build_hf_model(spec)
    assert model.input_names == ("input_ids", "pixel_values", "labels")
    model(tokens, pixels, labels).backward()
    assert any("before the text" in note for note in hf_batch_notes(spec))
    gemma3 = hf_spec("gemma3", overrides=parse_overrides(CONFIGS["gemma3"]))
    assert build_hf_model(gemma3).input_names == ("input_ids", "labels")


def test_axial_positions_that_do_not_fit_the_width_or_the_sequence_are_refused_with_values_that_fit():
    """Reformer's axial position embeddings split the width (64 + 192 = 256) and, in training, fill the
    sequence (64 x 64 = 4096): tracer changes no key the user did not set, and says which values would fit."""
    with pytest.raises(ModelInputError, match=r"axial_pos_embds_dim \[64, 192\] must sum to hidden_size 64") as info:
        build_hf_model(hf_spec("reformer", overrides={"hidden_size": 64}))
    assert "--hf-config axial_pos_embds_dim=[16, 48]" in info.value.hint
    spec = hf_spec("reformer", overrides={"hidden_size": 64, "axial_pos_embds_dim": [16, 48]})
    with pytest.raises(ModelInputError, match="--seq 1024 must be the product of axial_pos_shape") as info:
        hf_example_batch(spec, 2, 1024)
    assert "--seq 4096" in info.value.hint and "axial_pos_shape=[32, 32]" in info.value.hint
    tokens, labels = hf_example_batch(hf_spec("reformer", overrides={"axial_pos_shape": [4, 4]}), 2, 16)
    assert tuple(tokens.shape) == tuple(labels.shape) == (2, 16)


def test_a_composite_models_nested_language_model_keeps_no_kv_cache():
    """GOT-OCR2's text_config has use_cache=True by default: its language model would build a DynamicCache in
    the training step, holding every layer's keys and values until forward returns."""
    from tracer.models.hf import _make_config
    config = _make_config(hf_spec("got_ocr2"))
    assert config.text_config.use_cache is False


@pytest.mark.slow
def test_a_multimodal_causal_lm_draws_its_token_ids_from_the_text_sub_config():
    spec = hf_spec("gemma3", overrides=parse_overrides(CONFIGS["gemma3"]))
    tokens, labels = hf_example_batch(spec, 2, 16)
    assert tokens.max() < 128 and tuple(labels.shape) == (2, 16)
    graph, source = _predict("gemma3")
    assert graph.parameter_count == sum(p.numel() for p in source.build_model().parameters())


def _predict(name):
    source = load_model_source(f"hf:{name}", hf_config=CONFIGS[name])
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=16, target="cpu"), (PolicySpec(name="eager"),))
    return graphs["eager"], source


@pytest.mark.slow
@pytest.mark.parametrize("name", ["opt", "gpt_neox", "phi", "gemma", "falcon", "whisper", "t5", "distilbert"])
def test_an_architecture_traces_to_a_prediction(name):
    graph, source = _predict(name)
    assert graph.parameter_count == sum(p.numel() for p in source.build_model().parameters())


def test_vit_traces_to_a_prediction():
    """ViT's init runs nn.init.trunc_normal_, whose value reads the fake build answers (capture/build.py)."""
    graph, source = _predict("vit")
    assert graph.parameter_count == sum(p.numel() for p in source.build_model().parameters())


def test_a_mixture_of_experts_traces_in_fp32_under_the_routing_assumption():
    graph, source = _predict("mixtral")
    assert any("routing" in note for note in graph.config.notes)
    assert graph.parameter_count == sum(p.numel() for p in source.build_model().parameters())


def test_the_command_line_refuses_an_unknown_name_in_one_line(capsys):
    from tracer.cli import main
    assert main(["hf:lama", "--seq", "4", "--quiet"]) == ExitCode.USAGE
    err = capsys.readouterr().err.strip()
    assert "close names: llama" in err and len(err.splitlines()) == 1


@pytest.mark.parametrize("planning", [[], ["--by-depth"], ["--fit", "1GiB"]])
def test_hf_task_reaches_every_analysis_the_command_line_runs(planning, capsys):
    """A task vit has no head for is refused wherever the model is built, so the flag got there."""
    from tracer.cli import main
    assert main(["hf:vit", "--hf-task", "causal-lm", "--seq", "4", "--quiet", *planning]) == ExitCode.USAGE
    assert "vit has no causal-lm head" in capsys.readouterr().err


def test_hf_task_reaches_analyze():
    import tracer
    with pytest.raises(ModelInputError, match="vit has no causal-lm head"):
        tracer.analyze("hf:vit", hf_task="causal-lm")


@pytest.mark.slow
def test_a_sequence_classifier_is_analysed_by_depth(capsys):
    """Its inputs are the (2, 16) token ids and one label per sequence: 256 + 16 bytes of int64."""
    from tracer.cli import main
    flags = [f"--hf-config={item}" for item in TINY + ("num_hidden_layers=6",)]
    assert main(["hf:llama", "--hf-task", "sequence-classification", *flags, "--seq", "16", "--by-depth",
                 "--quiet"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "6 blocks in model.model.layers" in out and "input 272 B" in out


def test_a_head_whose_output_has_no_loss_is_not_a_head_tracer_trains():
    """PPLCNetForImageClassification returns a backbone's features, without a loss: refused in one line."""
    with pytest.raises(ModelInputError, match="pp_lcnet has none of the heads"):
        hf_spec("pp_lcnet")


def test_a_model_with_per_language_adapters_and_no_default_language_gets_its_first_language():
    from tracer.models.hf import _make_config
    spec = hf_spec("xmod", overrides={"num_hidden_layers": 1, "hidden_size": 32, "num_attention_heads": 2})
    config = _make_config(spec)
    assert config.default_language == list(config.languages)[0]
