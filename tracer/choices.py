"""The name tables behind the command line's choices, importable without torch (one source of truth).

`python -m tracer --help` builds every flag's choices from these tables and from the other torch-free
registries (tracer.policies, tracer.passes.sharding's strategies, tracer.checks.options); the capture
code that implements each name imports its table from here, so a new optimizer, offload mode, precision or
GPU is added once. Nothing here imports torch or anything that does.
"""
from __future__ import annotations

import dataclasses


OPTIMIZERS = ("adamw", "adam", "sgd", "sgd-momentum", "sgd-plain", "adafactor", "adafactor-hf", "lion",
              "adamw8bit", "paged-adamw8bit", "none")          # tracer.capture.optimizer builds each
OFFLOAD_MODES = ("optimizer", "optimizer+params", "activations")  # tracer.capture.offload, activation_offload
QUANTIZED_BASES = ("4bit", "8bit")                                # tracer.capture.quantized_base
FP8_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")      # tracer.capture.float8
PIPELINE_SCHEDULES = ("1f1b", "gpipe", "interleaved-1f1b")         # tracer.passes.pipeline_parallel
PRECISIONS = ("fp32", "bf16", "bf16-pure", "fp16")             # tracer.capture.precision
TARGET_DEVICES = ("cpu", "cuda")                                # tracer.capture.target


@dataclasses.dataclass(frozen=True)
class GpuSpec:
    name: str
    sm: tuple[int, int]               # compute capability (major, minor)
    memory_bytes: int                 # the total the device reports (nvidia-smi, cudaMemGetInfo), not the label
    description: str
    sm_count: int                     # streaming multiprocessors (Inductor sizes split reductions by it)
    system_bytes: int = 0             # unified memory (CPU and GPU share it): what the operating system holds of it
    nccl_communicator_bytes: int | None = None   # one NCCL communicator's buffers on it (None: the default below)

    @property
    def unified(self) -> bool:
        """CPU and GPU share one memory: host offloading frees nothing of it."""
        return self.system_bytes > 0

_MIB = 2**20
# What one NCCL communicator holds on each GPU (its channels' send and receive buffers, the proxy's shared
# buffers), a stated default until measured on the user's machine: 688 MB per rank for a process group of
# more than 2 GPUs, measured with PyTorch on 4 A100s with NVLink (NVIDIA/nccl#964; 544 MB for 2 GPUs).
# NCCL's maintainers say it grows with the channel count, so a faster link takes more (NVIDIA/nccl#986):
# the NVLink-4/5 parts (H100, H200, B200) take the 1.06 GB per GPU measured on 8 H100s before any
# all-to-all (NVIDIA/nccl#1685). Every communicator holds its own unless they share resources. A sharded
# step (--shard over more than one rank) holds one, tensor parallelism (--tp > 1) one more, a pipeline
# stage (--pp > 1) one more;
# --nccl-memory SIZE sets the size of one.
NCCL_COMMUNICATOR_BYTES = 688 * 10**6
NVLINK4_NCCL_COMMUNICATOR_BYTES = 1_060 * 10**6

# memory_bytes: what NVML reports as the device's total (nvidia-smi's "MiB" column), which the marketed
# size rounds: T4, A10G, L4, A100 40/80GB, H100, H200 and L40S from the table "Why does an NVIDIA H100 80GB
# card offer 85.52 GB?" (thundergolfer.com/blog/nvidia-gpu-memory-capacity, read via NVML) and public
# nvidia-smi logs (A10G 23,028 MiB, T4 15,360 MiB); V100 32GB: 32,510 MiB, B200: 183,359 MiB and RTX 3090:
# 24,268 MiB from public nvidia-smi outputs (pytorch/pytorch#54564 for the 3090); RTX 4090: 24,564 MiB
# (nvidia-smi in RLinf/RLinf#255), RTX 5090: 32,607 MiB (nvidia-smi in noonghunna/club-3090#1261); H100 NVL:
# 95,830 MiB (nvidia-smi in NVIDIA/gpu-admin-tools#4); GH200 480GB (96 GB of HBM3 beside the Grace CPU's
# 480 GB): 97,871 MiB (nvidia-smi in the sgawe11/rag-on-gh200 README and several other public logs); GH200
# 144G HBM3e: 146,831 MiB (nvidia-smi --query-gpu=memory.total in public host set-up notes).
GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec("v100", (7, 0), 32_510 * _MIB, "Volta V100 32GB", 80),
    GpuSpec("t4", (7, 5), 15_360 * _MIB, "Turing T4 16GB", 40),
    GpuSpec("a100", (8, 0), 81_920 * _MIB, "Ampere A100 80GB", 108),
    GpuSpec("a100-40gb", (8, 0), 40_960 * _MIB, "Ampere A100 40GB", 108),
    GpuSpec("a10g", (8, 6), 23_028 * _MIB, "Ampere A10G 24GB", 80),
    GpuSpec("rtx3090", (8, 6), 24_268 * _MIB, "Ampere GeForce RTX 3090 24GB", 82),
    GpuSpec("l4", (8, 9), 23_034 * _MIB, "Ada L4 24GB", 58),
    GpuSpec("rtx4090", (8, 9), 24_564 * _MIB, "Ada GeForce RTX 4090 24GB", 128),
    GpuSpec("l40s", (8, 9), 46_068 * _MIB, "Ada L40S 48GB", 142),
    GpuSpec("h100", (9, 0), 81_559 * _MIB, "Hopper H100 80GB", 132,
            nccl_communicator_bytes=NVLINK4_NCCL_COMMUNICATOR_BYTES),
    GpuSpec("h200", (9, 0), 143_771 * _MIB, "Hopper H200 141GB", 132,
            nccl_communicator_bytes=NVLINK4_NCCL_COMMUNICATOR_BYTES),
    # PCIe cards joined in pairs by an NVLink bridge: NCCL's PCIe-sized communicator
    GpuSpec("h100-nvl", (9, 0), 95_830 * _MIB, "Hopper H100 NVL 94GB", 132),
    # Grace Hopper: the GPU's own HBM is the device memory; the Grace CPU's LPDDR5X beside it is host memory
    # (reached over NVLink-C2C), so offloading to it frees device memory as on any other host
    GpuSpec("gh200", (9, 0), 97_871 * _MIB, "Grace Hopper GH200 96GB (480GB)", 132),
    GpuSpec("gh200-144gb", (9, 0), 146_831 * _MIB, "Grace Hopper GH200 144GB HBM3e", 132),
    GpuSpec("b200", (10, 0), 183_359 * _MIB, "Blackwell B200 180GB", 148,
            nccl_communicator_bytes=NVLINK4_NCCL_COMMUNICATOR_BYTES),
    GpuSpec("rtx5090", (12, 0), 32_607 * _MIB, "Blackwell GeForce RTX 5090 32GB", 170),
    # NVIDIA DGX Spark: one GB10 Grace Blackwell superchip, 128 GB of LPDDR5x shared by the CPU and the GPU
    # (48 SMs, compute capability 12.1); the operating system and the desktop hold part of it, 10 GiB as a
    # starting guess until measured (--device-memory replaces the total)
    GpuSpec("dgx-spark", (12, 1), 128 * 2**30, "Grace Blackwell GB10 (DGX Spark) 128GB unified", 48,
            system_bytes=10 * 2**30),
)}
# What a training process's CUDA context takes on the device before its first tensor (driver state and the
# kernels it loads lazily since CUDA 11.7): about 300 MB reported in pytorch/pytorch#107667, 300-400 MB in
# #20532. The step's memory is judged against the device's total less this; --cuda-context SIZE sets it.
CUDA_CONTEXT_BYTES = 512 * _MIB
DEFAULT_GPU = "h100"                 # the GPU a prediction is for unless --gpu names another
DEFAULT_TARGET = "cuda"              # what every command predicts unless --target cpu
