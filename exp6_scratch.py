import time, sys, torch
sys.path.insert(0, "tests")
from truth import measure_step
from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.passes.analysis import analyze_graphs
D = ("num_hidden_layers=2", "hidden_size=64", "intermediate_size=128", "num_attention_heads=4", "vocab_size=512")
cases = {
 "hf:roberta": D + ("hidden_dropout_prob=0", "attention_probs_dropout_prob=0"),
 "hf:distilbert": ("n_layers=2", "dim=64", "hidden_dim=128", "n_heads=4", "vocab_size=512", "dropout=0", "attention_dropout=0"),
 "hf:opt": ("num_hidden_layers=2", "hidden_size=64", "ffn_dim=128", "num_attention_heads=4", "vocab_size=512", "word_embed_proj_dim=64", "dropout=0", "attention_dropout=0"),
 "hf:gpt_neox": D + ("hidden_dropout=0", "attention_dropout=0"), "hf:phi": D + ("resid_pdrop=0", "embd_pdrop=0", "attention_dropout=0"),
 "hf:gemma": D + ("num_key_value_heads=2", "head_dim=16"),
 "hf:falcon": ("num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "vocab_size=512", "hidden_dropout=0", "attention_dropout=0"),
 "hf:whisper": ("encoder_layers=2", "decoder_layers=2", "d_model=64", "encoder_attention_heads=4", "decoder_attention_heads=4", "encoder_ffn_dim=128", "decoder_ffn_dim=128", "vocab_size=512", "num_mel_bins=16", "max_source_positions=32", "max_target_positions=64", "pad_token_id=0", "bos_token_id=1", "eos_token_id=2", "decoder_start_token_id=1", "dropout=0", "attention_dropout=0", "activation_dropout=0"),
}
for name in sys.argv[1:] or cases:
    t = time.time()
    try:
        source = load_model_source(name, hf_config=cases[name])
        graphs = capture_steps(source, CaptureOptions(batch=2, seq=32), (PolicySpec(name="eager"),))
        p = analyze_graphs(graphs).policies["eager"]
        torch.manual_seed(0)
        model = source.build_model()
        m = measure_step(model, source.example_batch(2, 32), torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))
        rel = {ph: (p.phases[ph].peak_bytes - m.phase_peaks[ph]) / m.phase_peaks[ph] for ph in ("forward", "backward", "optimizer")}
        print(name, "saved", p.saved.total_bytes, m.saved_bytes, "start", p.start_bytes == m.start_bytes, p.peak_phase, m.peak_phase, {k: f"{v:.5f}" for k, v in rel.items()}, f"{time.time()-t:.1f}s", flush=True)
    except Exception as e:
        print(name, "FAIL", type(e).__name__, str(e)[:400], f"{time.time()-t:.1f}s", flush=True)
