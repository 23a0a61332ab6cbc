import time, sys, torch
from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
D = ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=64", "num_attention_heads=2", "vocab_size=128")
cases = {
 "hf:roberta": D, "hf:distilbert": ("n_layers=1", "dim=32", "hidden_dim=64", "n_heads=2", "vocab_size=128"),
 "hf:opt": ("num_hidden_layers=1", "hidden_size=32", "ffn_dim=64", "num_attention_heads=2", "vocab_size=128", "word_embed_proj_dim=32"),
 "hf:gpt_neox": D, "hf:phi": D, "hf:gemma": D + ("num_key_value_heads=1", "head_dim=16"),
 "hf:falcon": ("num_hidden_layers=1", "hidden_size=32", "num_attention_heads=2", "vocab_size=128"),
 "hf:vit": ("num_hidden_layers=1", "hidden_size=32", "intermediate_size=64", "num_attention_heads=2", "image_size=32", "patch_size=8"),
 "hf:whisper": ("encoder_layers=1", "decoder_layers=1", "d_model=32", "encoder_attention_heads=2", "decoder_attention_heads=2", "encoder_ffn_dim=64", "decoder_ffn_dim=64", "vocab_size=128", "num_mel_bins=8", "max_source_positions=16", "max_target_positions=32", "pad_token_id=0", "bos_token_id=1", "eos_token_id=2", "decoder_start_token_id=1"),
 "hf:mixtral": D + ("num_key_value_heads=1", "num_local_experts=4", "num_experts_per_tok=2"),
}
for name in sys.argv[1:] or cases:
    t = time.time()
    try:
        source = load_model_source(name, hf_config=cases[name])
        graphs = capture_steps(source, CaptureOptions(batch=2, seq=16, target="cpu"), (PolicySpec(name="eager"),))
        a = analyze_graphs(graphs).policies["eager"]
        print(name, "OK", a.peak_bytes, a.peak_phase, f"{time.time()-t:.1f}s", flush=True)
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e)[:400], f"{time.time()-t:.1f}s", flush=True)
