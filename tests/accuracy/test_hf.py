"""Hugging Face models built from small configs (no download): eager prediction vs a real CPU step."""
import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.errors import ModelInputError
from tracer.passes.analysis import analyze_graphs
from optional import needs
from truth import measure_step

pytestmark = needs("transformers", reason="the hf extra (pip install -e '.[hf]')")

DECODER = ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
           "num_key_value_heads=2", "vocab_size=512")
CONFIGS = {
    "hf:gpt2": ("n_layer=2", "n_embd=64", "n_head=4", "vocab_size=512", "n_positions=64",
                "resid_pdrop=0", "embd_pdrop=0", "attn_pdrop=0"),
    "hf:llama": DECODER,
    "hf:qwen2": DECODER,
    "hf:bert": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                "vocab_size=512", "hidden_dropout_prob=0", "attention_probs_dropout_prob=0"),
    "hf:t5": ("num_layers=2", "d_model=64", "d_ff=128", "num_heads=4", "d_kv=16", "vocab_size=512", "dropout_rate=0"),
    # each builds its own architecture's head (roberta and distilbert used to build BERT)
    "hf:roberta": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                   "vocab_size=512", "hidden_dropout_prob=0", "attention_probs_dropout_prob=0"),
    "hf:distilbert": ("n_layers=2", "dim=64", "hidden_dim=128", "n_heads=4", "vocab_size=512", "dropout=0",
                      "attention_dropout=0"),
    "hf:opt": ("num_hidden_layers=2", "hidden_size=64", "ffn_dim=128", "num_attention_heads=4", "vocab_size=512",
               "word_embed_proj_dim=64", "dropout=0", "attention_dropout=0"),
    "hf:gpt_neox": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                    "vocab_size=512", "hidden_dropout=0", "attention_dropout=0"),
    "hf:whisper": ("encoder_layers=2", "decoder_layers=2", "d_model=64", "encoder_attention_heads=4",
                   "decoder_attention_heads=4", "encoder_ffn_dim=128", "decoder_ffn_dim=128", "vocab_size=512",
                   "num_mel_bins=16", "max_source_positions=32", "max_target_positions=64", "pad_token_id=0",
                   "bos_token_id=1", "eos_token_id=2", "decoder_start_token_id=1", "dropout=0", "attention_dropout=0",
                   "activation_dropout=0"),
    # speech models whose layout their feature extractor gives: frames-first features and an int32 / bool mask
    "hf:speech_to_text": ("encoder_layers=2", "decoder_layers=2", "d_model=64", "encoder_attention_heads=4",
                          "decoder_attention_heads=4", "encoder_ffn_dim=128", "decoder_ffn_dim=128",
                          "vocab_size=512", "conv_channels=32", "input_feat_per_channel=16", "dropout=0",
                          "attention_dropout=0", "activation_dropout=0"),
    "hf:canary": ("vocab_size=256",
                  'encoder_config={"hidden_size":64,"num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":4,'
                  '"intermediate_size":128,"num_mel_bins":16,"dropout":0.0,"layerdrop":0.0,'
                  '"activation_dropout":0.0,"attention_dropout":0.0}',
                  'decoder_config={"vocab_size":256,"hidden_size":64,"intermediate_size":128,"num_hidden_layers":2,'
                  '"num_attention_heads":4,"num_key_value_heads":4,"head_dim":16}'),
    # a CTC head over a waveform (input_values as its feature extractor makes them): ctc_loss's log_alpha is
    # sized by the longest target, which the capture reads from the example batch's labels (SpecAugment off:
    # its masks are drawn with numpy, so the real step's would differ from the capture's)
    "hf:wav2vec2": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
                    "vocab_size=32", "conv_dim=[32,32,32,32,32,32,32]", "num_conv_pos_embeddings=16",
                    "mask_time_prob=0", "hidden_dropout=0", "attention_dropout=0", "activation_dropout=0",
                    "feat_proj_dropout=0", "final_dropout=0", "layerdrop=0"),
    # NaFlex patchified pixels with pixel_attention_mask and spatial_shapes, as its image processor makes them
    "hf:siglip2": ('vision_config={"num_hidden_layers":2,"hidden_size":64,"intermediate_size":128,'
                   '"num_attention_heads":4,"patch_size":8}',),
    # image features before the text (no image placeholder token): token ids and an image
    "hf:git": ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4",
               "vocab_size=512", "hidden_dropout_prob=0", "attention_probs_dropout_prob=0",
               'vision_config={"num_hidden_layers":2,"hidden_size":64,"intermediate_size":128,'
               '"num_attention_heads":4,"image_size":32,"patch_size":8}'),
}
# T5 also with eager attention: it runs dropout on the attention probabilities, which autograd saves twice over;
# llama also as a sequence classifier (--hf-task): it pools the last non-pad position
CASES = ([(name, "sdpa", None) for name in sorted(CONFIGS)] + [("hf:t5", "eager", None)]
         + [("hf:llama", "sdpa", "sequence-classification")])


@pytest.mark.parametrize("name, attn, task", CASES)
def test_eager_step_of_a_transformers_model(name, attn, task):
    """Dropout is 0: CPU eager dropout saves a float mask where the graph (and CUDA) saves a bool one.
    Dropout with p=0 returns its input in eager, where torch's traced decomposition copies it; T5 saves both
    sides of its dropouts (relu -> dropout -> wo, softmax -> dropout -> matmul), so it checks the copy is gone."""
    source = load_model_source(name, hf_config=CONFIGS[name], hf_attn=attn, hf_task=task)
    graphs = capture_steps(source, CaptureOptions(batch=2, seq=32), (PolicySpec(name="eager"),))
    predicted = analyze_graphs(graphs).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(2, 32),
                            torch.optim.AdamW(model.parameters(), lr=1e-3))
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert predicted.start_bytes == measured.start_bytes
    assert predicted.peak_phase == measured.peak_phase
    for phase in ("forward", "backward", "optimizer"):
        p, m = predicted.phases[phase].peak_bytes, measured.phase_peaks[phase]
        assert p == m, f"{phase}: predicted {p:,} measured {m:,}"


def test_a_hub_name_without_a_config_file_says_how_to_build_it():
    with pytest.raises(ModelInputError, match="config-json"):
        load_model_source("hf:meta-llama/Llama-3.2-1B")


def test_config_json_names_the_architecture(tmp_path):
    config = tmp_path / "config.json"
    config.write_text('{"model_type": "llama", "num_hidden_layers": 1, "hidden_size": 32, "intermediate_size": 64,'
                      ' "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 128}')
    source = load_model_source("hf:meta-llama/Llama-3.2-1B", config_json=str(config))
    graphs = capture_steps(source, CaptureOptions(batch=1, seq=16), (PolicySpec(name="eager"),))
    assert graphs["eager"].parameter_count == sum(p.numel() for p in source.build_model().parameters())


@pytest.mark.parametrize("name, precision", [(name, precision) for name in ("hf:bert", "hf:roberta", "hf:git")
                                              for precision in ("bf16", "fp16")] + [("hf:wav2vec2", "bf16")])
def test_a_layer_norm_under_autocast_saves_its_statistics_as_the_cpu_kernel_does(name, precision):
    """A LayerNorm whose input autocast left in 16 bits (BERT's masked-LM head after its dense layer and GELU)
    keeps fp32 weight and bias, and the CPU kernel then makes its saved mean and rstd fp32, not the input's
    dtype as torch's fake kernel does; so does a GroupNorm (wav2vec2's feature encoder, run op by op): every
    phase peak and the saved bytes equal the real step's (they were 256 B low for BERT, RoBERTa and
    wav2vec2's GroupNorm, 136 B for GIT)."""
    source = load_model_source(name, hf_config=CONFIGS[name], hf_attn="sdpa")
    options = CaptureOptions(batch=2, seq=32, precision=precision, target="cpu")
    predicted = analyze_graphs(capture_steps(source, options, (PolicySpec(name="eager"),))).policies["eager"]
    torch.manual_seed(0)
    model = source.build_model()
    measured = measure_step(model, source.example_batch(2, 32), torch.optim.AdamW(model.parameters(), lr=1e-3),
                            precision=precision)
    assert predicted.saved.total_bytes == measured.saved_bytes
    assert {p: predicted.phases[p].peak_bytes for p in ("forward", "backward", "optimizer")} == measured.phase_peaks
