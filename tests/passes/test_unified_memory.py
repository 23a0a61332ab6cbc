"""A GPU whose memory the CPU shares (the DGX Spark, `--gpu dgx-spark`): "fits" is judged against its 128 GiB
less the CUDA context and what the operating system holds (10 GiB, a stated assumption), what the step holds
"on the host" comes out of the same memory, and offloading is not offered as a lever."""
import tracer
from tracer.choices import CUDA_CONTEXT_BYTES, GPUS
from tracer.levers import LEVERS, lever_options
from tracer.pipeline import AnalysisOptions

SPARK = GPUS["dgx-spark"]


def test_the_capacity_is_the_unified_memory_less_the_context_and_the_systems_share():
    device = tracer.analyze("llama-debug", batch=1, seq=16, gpu="dgx-spark").policies["eager"].device
    assert SPARK.unified and not GPUS["h100"].unified
    assert device.capacity_bytes == 128 * 2**30 - CUDA_CONTEXT_BYTES - 10 * 2**30
    assert device.system_bytes == 10 * 2**30


def test_what_is_offloaded_to_the_host_still_takes_the_same_memory():
    on_spark = tracer.analyze("llama-debug", batch=1, seq=16, gpu="dgx-spark", offload="optimizer").policies["eager"]
    on_h100 = tracer.analyze("llama-debug", batch=1, seq=16, gpu="h100", offload="optimizer").policies["eager"]
    assert on_spark.host.peak_bytes > 0
    assert on_spark.device.capacity_bytes == 128 * 2**30 - CUDA_CONTEXT_BYTES - 10 * 2**30 - on_spark.host.peak_bytes
    assert on_h100.device.capacity_bytes == GPUS["h100"].memory_bytes - CUDA_CONTEXT_BYTES


def test_offloading_is_no_lever_on_unified_memory():
    offload = next(lever for lever in LEVERS if dict(lever.settings).get("offload"))
    options, why = lever_options(offload, AnalysisOptions(batch=2, seq=64, gpu="dgx-spark"))
    assert options is None and "share one memory" in why
    options, why = lever_options(offload, AnalysisOptions(batch=2, seq=64, gpu="h100"))
    assert options is not None and why == ""


def test_grace_hopper_keeps_its_hbm_apart_from_the_grace_cpus_memory():
    """GH200: the CPU's LPDDR5X is reached over NVLink-C2C but is not the GPU's HBM, so the device is judged
    against the HBM total nvidia-smi reports (97,871 MiB; 146,831 MiB for the 144 GB HBM3e part) and
    offloading to the host frees device memory, as on a card in a PCIe slot."""
    mib = 2**20
    assert [GPUS[name].memory_bytes for name in ("gh200", "gh200-144gb", "h100-nvl")] == [
        97_871 * mib, 146_831 * mib, 95_830 * mib]
    on_gh200 = tracer.analyze("llama-debug", batch=1, seq=16, gpu="gh200", offload="optimizer").policies["eager"]
    assert not GPUS["gh200"].unified and on_gh200.host.peak_bytes > 0
    assert on_gh200.device.capacity_bytes == 97_871 * mib - CUDA_CONTEXT_BYTES
    offload = next(lever for lever in LEVERS if dict(lever.settings).get("offload"))
    options, why = lever_options(offload, AnalysisOptions(batch=2, seq=64, gpu="gh200"))
    assert options is not None and why == ""
