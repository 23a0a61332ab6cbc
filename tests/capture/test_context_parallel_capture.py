"""--cp N: the sequence split over N ranks, attention run as torch's context_parallel rings it
(tracer/capture/context_parallel.py): rank 0 of N fake ranks holds its share of the positions, the gathered
keys and values and the ring's merges. Exactness against real two-process steps is in
tests/accuracy/test_context_parallel.py; here, what the capture records and what it refuses."""
from __future__ import annotations

import os

import pytest

import tracer
from tracer.capture.context_parallel import load_balanced, local_seq
from tracer.errors import ModelRunError, UsageError

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "context_parallel_lm.py")
# a model file whose attention is CALL on (batch, 2 heads, seq, 16) queries, keys and values
ATTENTION_MODEL = '''
import torch, torch.nn as nn, torch.nn.functional as F

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.qkv, self.head = nn.Embedding(64, 32), nn.Linear(32, 96), nn.Linear(32, 64)

    def forward(self, tokens, targets):
        b, s = tokens.shape
        q, k, v = (t.view(b, s, 2, 16).transpose(1, 2) for t in self.qkv(self.emb(tokens)).chunk(3, dim=-1))
        y = CALL
        return F.cross_entropy(self.head(y.transpose(1, 2).reshape(b, s, 32)).flatten(0, 1), targets.flatten())

def build_model():
    return Net()

def example_batch(batch, seq):
    return torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))
'''
HAND_WRITTEN = "torch.softmax(q @ k.transpose(-1, -2) / 16 ** 0.5, dim=-1) @ v"


def _ops(result, name: str) -> list:
    return [op for op in result.graph.ops if op.target.startswith(name)]


def test_each_rank_holds_its_share_of_the_sequence():
    whole = tracer.analyze(FIXTURE, batch=2, seq=64, target="cpu")
    split = tracer.analyze(FIXTURE, batch=2, seq=64, target="cpu", cp=2)
    assert split.graph.config.seq == 32
    assert split.policies["eager"].saved.total_bytes < whole.policies["eager"].saved.total_bytes
    assert any(note.startswith("--cp 2: built and stepped as rank 0 of 2 ranks") and "of the 64 positions" in note
               and "all_gather_into_tensor" in note for note in split.graph.config.notes)


def test_the_forward_gathers_every_ranks_keys_and_values_once_per_attention():
    """(batch 2, 4 heads, 32 local positions, head size 16) keys and values in fp32, concatenated: 32 KiB
    on each rank, 64 KiB gathered from two."""
    split = tracer.analyze(FIXTURE, batch=2, seq=64, target="cpu", cp=2)
    forward_gathers = [op for op in _ops(split, "_c10d_functional.all_gather_into_tensor")
                       if op.phase.value == "forward"]
    assert len(forward_gathers) == 2                      # one per block
    assert all(op.outputs[0].shape == (2 * 2 * 2 * 4 * 32 * 16,) for op in forward_gathers)


def test_the_cuda_target_rings_the_cuda_kernel_torch_picks():
    """On the CUDA target the ring calls the kernel PyTorch's rules pick (memory-efficient attention for fp32
    on an H100), through torch's own context-parallel handler: each call's query holds the rank's share of
    the positions, or half of it where load balancing skips the masked half. (torch's ring needs those halves
    to be multiples of 32 under the efficient kernel, whose logsumexp is padded so.)"""
    split = tracer.analyze(FIXTURE, batch=2, seq=128, target="cuda", cp=2)
    kernels = [op for op in split.graph.ops if op.target in (
        "aten._scaled_dot_product_flash_attention.default", "aten._scaled_dot_product_efficient_attention.default")]
    assert kernels and not _ops(split, "aten._scaled_dot_product_flash_attention_for_cpu")
    assert {op.args[0].shape[2] for op in kernels} == {64, 32}


def test_the_local_length_and_load_balancing_follow_torchs_rules():
    assert local_seq(1024, 4) == 256
    assert load_balanced(1024, 4) and not load_balanced(1020, 4)
    with pytest.raises(UsageError, match="does not split evenly over 3 ranks"):
        local_seq(1024, 3)


def test_hand_written_attention_is_refused_under_cp(tmp_path):
    path = tmp_path / "hand_written.py"
    path.write_text(ATTENTION_MODEL.replace("CALL", HAND_WRITTEN))
    with pytest.raises(UsageError, match="ran no attention that torch's context parallelism splits"):
        tracer.analyze(str(path), batch=1, seq=16, target="cpu", cp=2)


@pytest.mark.parametrize("options", [dict(tp=2), dict(pp=2), dict(ep=2), dict(shard="fsdp", world_size=2),
                                     dict(policies=("compiled",)), dict(seq=63)])
def test_cp_with_what_it_does_not_model_is_refused(options):
    with pytest.raises(UsageError, match="--cp"):
        tracer.analyze(FIXTURE, **{"batch": 2, "seq": 64, "target": "cpu", "cp": 2, **options})


@pytest.mark.parametrize("call,refusal", [
    ("F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(s, s, dtype=torch.bool).tril())",
     "rings causal attention without a mask"),
    ("F.scaled_dot_product_attention(q, k, v, dropout_p=0.1, is_causal=True)", "attention dropout inside the ring"),
])
def test_attention_the_ring_cannot_split_is_refused_in_one_line(tmp_path, call, refusal):
    path = tmp_path / "unringable.py"
    path.write_text(ATTENTION_MODEL.replace("CALL", call))
    with pytest.raises(ModelRunError, match=refusal):
        tracer.analyze(str(path), batch=1, seq=16, target="cpu", cp=2)

