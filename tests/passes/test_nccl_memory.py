"""A rank that talks to other ranks holds NCCL's buffers on its GPU (one communicator per process group):
"fits" is judged against the device's total less the CUDA context and, under --shard over more than one rank
and under --tp, one communicator's buffers each (tracer/choices.py NCCL_COMMUNICATOR_BYTES, from published
measurements, per GPU; --nccl-memory sets it)."""
import pytest

import tracer
from tracer.choices import CUDA_CONTEXT_BYTES, GPUS, NCCL_COMMUNICATOR_BYTES, NVLINK4_NCCL_COMMUNICATOR_BYTES
from tracer.errors import UsageError
from tracer.pipeline import AnalysisOptions
from tracer.reports.compare_text import render_device_memory

H100 = GPUS["h100"].memory_bytes


@pytest.mark.parametrize("settings, communicators", [
    ({}, 0),
    ({"shard": "fsdp", "world_size": 1}, 0),
    ({"shard": "fsdp", "world_size": 8}, 1),
    ({"shard": "zero2", "world_size": 8}, 1),
    ({"tp": 2}, 1),
    ({"shard": "fsdp", "world_size": 8, "tp": 2}, 2),
])
def test_each_process_group_takes_one_communicators_buffers_from_the_capacity(settings, communicators):
    setup = AnalysisOptions(batch=1, seq=16, **settings).device_setup()
    assert setup.nccl_communicators == communicators
    assert setup.capacity_bytes == H100 - CUDA_CONTEXT_BYTES - communicators * NVLINK4_NCCL_COMMUNICATOR_BYTES


def test_an_nvlink4_gpu_takes_more_per_communicator_than_the_others():
    """NCCL's buffers grow with the channels a faster link uses: 1.06 GB per H100 (NVIDIA/nccl#1685) against
    688 MB per A100 (NVIDIA/nccl#964)."""
    for gpu, per_communicator in (("h100", NVLINK4_NCCL_COMMUNICATOR_BYTES), ("b200", NVLINK4_NCCL_COMMUNICATOR_BYTES),
                                  ("a100", NCCL_COMMUNICATOR_BYTES), ("rtx4090", NCCL_COMMUNICATOR_BYTES)):
        setup = AnalysisOptions(batch=1, seq=16, gpu=gpu, shard="fsdp", world_size=4).device_setup()
        assert setup.nccl_bytes == per_communicator, gpu


def test_the_flag_sets_one_communicators_size_and_refuses_a_negative_one():
    setup = AnalysisOptions(batch=1, seq=16, shard="fsdp", world_size=8, tp=2, nccl_memory_bytes=2**30).device_setup()
    assert setup.nccl_bytes == 2 * 2**30 and setup.capacity_bytes == H100 - CUDA_CONTEXT_BYTES - 2 * 2**30
    assert AnalysisOptions(batch=1, seq=16, shard="fsdp", world_size=8,
                           nccl_memory_bytes=0).device_setup().capacity_bytes == H100 - CUDA_CONTEXT_BYTES
    with pytest.raises(UsageError, match="nccl_memory_bytes"):
        AnalysisOptions(batch=1, seq=16, nccl_memory_bytes=-1)


def test_the_verdict_says_what_nccl_takes():
    policy = tracer.analyze("llama-debug", batch=1, seq=16, shard="fsdp", world_size=8).policies["eager"]
    device = policy.rank_device
    assert device.nccl_bytes == NVLINK4_NCCL_COMMUNICATOR_BYTES and device.nccl_communicators == 1
    assert device.capacity_bytes == H100 - CUDA_CONTEXT_BYTES - NVLINK4_NCCL_COMMUNICATOR_BYTES
    text = render_device_memory(device)
    assert "for 1 NCCL communicator's buffers (--nccl-memory, per communicator)" in text
    assert policy.device.nccl_bytes == NVLINK4_NCCL_COMMUNICATOR_BYTES     # the unsharded view is judged alike
