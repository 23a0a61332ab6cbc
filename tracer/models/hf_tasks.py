"""The heads an `hf:` model can be trained with (`--hf-task`), as plain data: no torch, so the command line's
--help lists them without importing it. tracer.models.hf builds the heads.
"""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Task:
    mapping: str            # transformers.models.auto.modeling_auto.<mapping>: model_type -> head class name
    inputs: str             # "tokens", "image", "audio" (features) or "waveform" (input_values): what it reads
    labels: str             # "tokens" (one per position) or "sequence" (one per example)


TASKS = {
    "causal-lm": Task("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "tokens", "tokens"),
    "masked-lm": Task("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "tokens", "tokens"),
    "seq2seq": Task("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "tokens", "tokens"),
    "speech-seq2seq": Task("MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES", "audio", "tokens"),
    "sequence-classification": Task("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES", "tokens", "sequence"),
    "token-classification": Task("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "tokens", "tokens"),
    "image-classification": Task("MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES", "image", "sequence"),
    # connectionist temporal classification over a waveform (wav2vec2, HuBERT, WavLM ...): --seq label tokens
    "ctc": Task("MODEL_FOR_CTC_MAPPING_NAMES", "waveform", "tokens"),
}
# the default head: the first of these the architecture has (an encoder-decoder is trained as one, an encoder
# with an LM head as a masked LM, a vision model as a classifier)
DEFAULT_TASKS = ("seq2seq", "speech-seq2seq", "masked-lm", "causal-lm", "image-classification",
                 "sequence-classification", "ctc")
