"""Unknown names are usage errors naming the valid values (one validation in AnalysisOptions for every
entry point), and valid models that used to crash are refused with one line."""
import pytest

import tracer
from conftest import TINY, model
from tracer.errors import ExitCode, ModelRunError, UsageError


@pytest.mark.parametrize("keywords, needle", [
    (dict(batch=0), "batch must be a positive integer"),
    (dict(seq=-1), "seq must be a positive integer"),
    (dict(batch=True), "batch must be a positive integer"),
    (dict(precision="fp8"), "precision must be one of fp32, bf16, bf16-pure, fp16"),
    (dict(step="warm"), "step must be one of steady, first"),
    (dict(optimizer="adam8bit"), "optimizer must be one of adamw, adam, sgd, sgd-momentum"),
    (dict(accumulate=0), "accumulate must be a positive integer"),
    (dict(offload="params"), "offload must be one of optimizer, optimizer+params, activations or None"),
    (dict(capture="magic"), "capture must be one of"),
    (dict(hf_attn="flash"), "hf_attn must be one of sdpa, eager"),
    (dict(gpu="gtx"), "gpu must be one of"),
    (dict(foreach="yes"), "foreach must be None (the default), True or False"),
    (dict(policies=("eager", "lazy")), "unknown policy 'lazy'"),
    (dict(memory_budget=1.5), "memory_budget=1.5"),
    (dict(save_ops=("mn",)), "'mn' is not an aten op"),
    (dict(save_ops="mm"), "save_ops='mm' is not valid"),
    (dict(save_policy="most"), "unknown save policy 'most'"),
    (dict(target="tpu"), "tpu"),
    (dict(world_size=8), "--world-size needs --shard"),
    (dict(shard="zero9", world_size=2), "unknown sharding strategy"),
    (dict(device_memory_bytes=-1), "device_memory_bytes"),
    (dict(checkpoint_every=0), "--checkpoint-every"),
    (dict(colour="red"), "unknown option 'colour'"),
])
def test_analyze_refuses_unknown_values_before_any_capture(keywords, needle, no_analysis):
    with pytest.raises(UsageError) as info:
        tracer.analyze(model("tiny"), **keywords)
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_save_ops_names_close_aten_ops(run_cli, no_analysis):
    code, out, err = run_cli(model("tiny"), *TINY, "--policy", "selective", "--save-ops", "mm,mn")
    assert code == ExitCode.USAGE and "'mn' is not an aten op" in err and "close names:" in err
    from tracer.pipeline import AnalysisOptions
    AnalysisOptions(save_ops=("mm", "aten.bmm.default", "_scaled_dot_product_flash_attention"))


@pytest.mark.parametrize("name, code, needle", [
    ("optimizer_none", ExitCode.USAGE, "make_optimizer(params) returned NoneType, not an optimizer"),
    ("batch_requires_grad", ExitCode.USAGE, "returned a tensor with requires_grad=True (argument 0)"),
    ("all_frozen", ExitCode.ANALYSIS, "no parameter gets a gradient"),
    ("loss_under_no_grad", ExitCode.ANALYSIS, "no parameter gets a gradient"),
    ("no_parameters", ExitCode.ANALYSIS, "no parameter gets a gradient"),
])
@pytest.mark.parametrize("capture", ["auto", "dispatch"])
def test_models_that_crashed_are_refused_with_one_line(run_cli, name, code, needle, capture):
    got, out, err = run_cli(model(name), *TINY, "--optimizer", "none", "--capture", capture)
    assert got == code and needle in err and len(err.strip().splitlines()) == 1 and out == ""


def test_the_refusals_are_tracer_errors_in_the_api():
    with pytest.raises(ModelRunError, match="no parameter gets a gradient"):
        tracer.analyze(model("all_frozen"), batch=1, seq=8, target="cpu")
