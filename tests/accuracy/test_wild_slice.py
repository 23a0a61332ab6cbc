"""A fast slice of the corpus sweep (benchmarks/wild.py): varied architectures not covered by test_hf.py or
tests/models/test_hf_models.py, each shrunk by the sweep's generic tiny overrides, predicted (--target cpu,
eager) and measured in a real CPU step (tests/truth.py): every phase peak within 0.1%, saved bytes equal.
Hand-written styles (benchmarks/wild_styles/) and transformers architectures: an ALBERT masked LM (one layer
shared by all), BEiT and ConvNeXt image classifiers, BLOOM (ALiBi, eager attention), a Cohere2 mixture of
experts with balanced routers, BART (seq2seq); a hand-written router (`out.index_add_` per expert, `y, aux =
moe(x)`) and nn.MultiheadAttention's defaults (`x, _ = block(x, pad)` holding the head-averaged weights);
Mamba2 (the shrink keeping head width in the default's proportion), DeepSeek V2 (a top-k left unset),
Gemma3n's text model (shared-KV layer count in proportion; a parameter clamped through `.data` in forward) and
X-MOD (a default language; rows picked by a mask from a float constant)."""
import pytest

from optional import needs
from wild_sweep_module import wild_sweep

pytestmark = needs("transformers", "einops", "peft", reason="pip install -e '.[hf,test]'")

SLICE = ["style:nanogpt", "style:einops_attention", "style:lora_peft", "style:convnet", "style:moe_router",
         "style:mha_default",
         "hf:albert", "hf:beit", "hf:bloom", "hf:convnext", "hf:cohere2_moe", "hf:bart",
         "hf:mamba2", "hf:deepseek_v2", "hf:gemma3n_text", "hf:xmod"]


@pytest.mark.parametrize("name", SLICE)
def test_a_wild_model_is_exact_against_a_real_step(name):
    row = wild_sweep().run_one(name, time_limit_s=120)
    assert row.status == "exact", f"{name}: {row.status}: {row.reason} (predicted {row.predicted}, measured " \
                                  f"{row.measured})"
