"""Every command takes its settings through one pipeline (tracer/pipeline.py): a flag given to the main
command, to --fit, to --by-depth, to `tracer check` or as a marker/`tracer.analyze` keyword reaches the
AnalysisOptions the capture runs with. The pipeline is replaced by a recorder, so nothing is captured."""
import pytest

import tracer.pipeline
from tracer.cli import main
from tracer.errors import ExitCode, UsageError

FLAGS = ["--batch", "3", "--seq", "40", "--precision", "bf16", "--optimizer", "lion", "--no-foreach", "--accumulate", "4",
         "--step", "first", "--zero-grad", "zeros", "--target", "cuda", "--gpu", "a100", "--capture", "export",
         "--hf-attn", "eager", "--moe-routing", "worst", "--lora", "8", "--lora-targets", "wq,wv", "--tp", "4",
         "--sp"]
EXPECTED = dict(precision="bf16", optimizer="lion", accumulate=4, foreach=False, step="first", zero_grad_set_to_none=False,
                target="cuda", gpu="a100", capture="export", hf_attn="eager", moe_routing="worst", lora_rank=8,
                lora_targets=("wq", "wv"), tp=4, sp=True)
MAIN_ONLY = ["--policy", "full", "--blocks", "layers.*", "--checkpoint-every", "2", "--save-policy", "matmul",
             "--hf-config", "n_layer=2", "--hf-task", "causal-lm", "--alloc-conf", "expandable_segments:True",
             "--cublas-workspace-config", ":4096:8", "--cudnn-workspace-cap", "256MiB", "--device-memory", "24GiB",
             "--cuda-context", "300MiB", "--nccl-memory", "1GiB"]
MAIN_EXPECTED = dict(policies=("full",), blocks="layers.*", checkpoint_every=2, save_policy="matmul",
                     hf_config=("n_layer=2",), hf_task="causal-lm", alloc_conf="expandable_segments:True",
                     cublas_workspace_config=":4096:8", cudnn_workspace_cap_bytes=256 * 2**20,
                     device_memory_bytes=24 * 2**30, cuda_context_bytes=300 * 2**20,
                     nccl_memory_bytes=2**30)


class _Reached(UsageError):
    """Raised by the recorder in place of an analysis; the entry points turn it into an exit code."""


@pytest.fixture
def reached(monkeypatch):
    seen = []

    def record(model, options, **kwargs):
        seen.append(options)
        raise _Reached("recorded")

    monkeypatch.setattr(tracer.pipeline, "run_analysis", record)
    # one process: the recorder sees the options here (a command's worker processes get them pickled)
    monkeypatch.setattr(tracer.pipeline, "default_workers", lambda: 1)
    return seen


def _check(options, expected):
    for name, value in expected.items():
        assert getattr(options, name) == value, f"{name}: {getattr(options, name)!r} != {value!r}"


@pytest.mark.parametrize("mode", [[], ["--fit", "1GiB"], ["--by-depth"]], ids=["run", "fit", "by-depth"])
def test_the_main_command_fit_and_by_depth_pass_every_option(reached, mode):
    main(["hf:gpt2", *FLAGS, *MAIN_ONLY, *mode, "--quiet"])      # hf: the --hf-* flags apply to it
    (options,) = reached
    _check(options, {**EXPECTED, **MAIN_EXPECTED})
    if not mode:
        assert (options.batch, options.seq) == (3, 40)
    if mode == ["--by-depth"]:
        assert options.seq == 40


def test_the_main_command_passes_sharding(reached):
    main(["llama-debug", "--shard", "fsdp", "--world-size", "8", "--no-reshard-after-forward",
          "--fsdp-mixed-precision", "--quiet"])
    _check(reached[0], dict(shard="fsdp", world_size=8, reshard_after_forward=False, fsdp_mixed_precision=True))


def test_tracer_check_passes_every_option(reached, tmp_path):
    # --accumulate is refused with --shard: given once without it, once as 1 with it
    main(["check", "hf:gpt2", "--baseline", str(tmp_path / "a.json"), "--update-baseline", *FLAGS])
    _check(reached[0], {**EXPECTED, "batch": 3, "seq": 40})
    main(["check", "hf:gpt2", "--baseline", str(tmp_path / "b.json"), "--update-baseline", *FLAGS,
          "--accumulate", "1", "--policy", "full", "--hf-task", "causal-lm", "--shard", "zero2", "--world-size", "4"])
    _check(reached[1], {**EXPECTED, "accumulate": 1, "batch": 3, "seq": 40, "policies": ("full",),
                        "hf_task": "causal-lm", "shard": "zero2", "world_size": 4})


def test_the_python_api_and_the_marker_keywords_reach_the_pipeline(reached):
    from tracer.checks.plugin import check_budget_marker

    marker = {k: v for k, v in EXPECTED.items() if k != "zero_grad_set_to_none"}
    with pytest.raises(_Reached):
        tracer.analyze("hf:gpt2", batch=3, seq=40, zero_grad="zeros", **marker)
    _check(reached[0], EXPECTED)
    check_budget_marker((), dict(model="hf:gpt2", peak="1GiB", zero_grad="zeros", **marker), test_dir=".")
    _check(reached[1], EXPECTED)


def test_zero_grad_has_one_spelling_and_the_old_keyword_still_works(reached):
    with pytest.raises(_Reached):
        tracer.analyze("llama-debug", zero_grad="zeros")
    with pytest.warns(DeprecationWarning, match="zero_grad='none' or 'zeros'"), pytest.raises(_Reached):
        tracer.analyze("llama-debug", zero_grad_set_to_none=False)
    assert [o.zero_grad_set_to_none for o in reached] == [False, False]
    with pytest.raises(UsageError, match="zero_grad='sometimes' is not valid"):
        tracer.analyze("llama-debug", zero_grad="sometimes")
    with pytest.warns(DeprecationWarning), pytest.raises(UsageError, match="both given"):
        tracer.analyze("llama-debug", zero_grad="none", zero_grad_set_to_none=True)


def test_an_unknown_keyword_is_a_usage_error():
    with pytest.raises(UsageError, match="unknown option 'precison'"):
        tracer.analyze("llama-debug", precison="bf16")
    assert main(["llama-debug", "--world-size", "8", "--quiet"]) == ExitCode.USAGE


def test_the_levers_reach_the_capture_and_the_analysis(monkeypatch):
    """--lora reaches the capture's options (the build applies it), --tp/--sp the analysis of the graphs."""
    import tracer.capture
    import tracer.passes.analysis
    seen = {}

    def capture(source, options, specs, **progress):
        seen["capture"] = options
        return {spec.label: None for spec in specs}

    def analyze(graphs, device=None, **kwargs):
        seen["analysis"] = kwargs
        raise _Reached("recorded")

    monkeypatch.setattr(tracer.capture, "capture_steps", capture)
    monkeypatch.setattr(tracer.passes.analysis, "analyze_graphs", analyze)
    with pytest.raises(_Reached):
        tracer.analyze("llama-debug", lora_rank=4, lora_targets="wq, wv", tp=2, sp=True)
    assert (seen["capture"].lora_rank, seen["capture"].lora_targets) == (4, ("wq", "wv"))
    setup = seen["analysis"]["tensor_parallel"]
    assert (setup.tp, setup.sp) == (2, True)
    recorded = seen["analysis"]["settings"]                  # the JSON report's config
    assert {k: recorded[k] for k in ("lora_rank", "lora_targets", "tp", "sp")} == {
        "lora_rank": 4, "lora_targets": ["wq", "wv"], "tp": 2, "sp": True}


@pytest.mark.parametrize("keywords, match", [
    (dict(sp=True), "--sp needs --tp"), (dict(lora_targets=("wq",)), "--lora-targets needs --lora"),
    (dict(tp=0), "tp=0 is not valid"), (dict(lora_rank=0), "lora_rank=0 is not valid")])
def test_lever_settings_are_checked_before_any_capture(keywords, match):
    with pytest.raises(UsageError, match=match):
        tracer.analyze("llama-debug", **keywords)


def test_full_capture_reaches_tracer_check_the_api_and_the_marker(reached, tmp_path):
    from tracer.checks.plugin import check_budget_marker

    main(["check", "llama-debug", "--baseline", str(tmp_path / "a.json"), "--update-baseline", "--full-capture"])
    with pytest.raises(_Reached):
        tracer.analyze("llama-debug", full_capture=True)
    check_budget_marker((), dict(model="llama-debug", peak="1GiB", full_capture=True), test_dir=".")
    assert [options.full_capture for options in reached] == [True, True, True]


def test_the_main_command_passes_full_capture(reached):
    main(["llama-debug", "--full-capture", "--quiet"])
    assert reached[0].full_capture is True


@pytest.mark.parametrize("full_capture", [False, True])
def test_full_capture_skips_the_depth_synthesis(monkeypatch, full_capture):
    """The first capture stage reached: the depth synthesis, or the full capture (stopped there, so the
    test captures nothing)."""
    import tracer.capture
    import tracer.depth_capture
    tried = []

    def recorder(name):
        def record(*args, **kwargs):
            tried.append(name)
            raise _Reached(name)
        return record

    monkeypatch.setattr(tracer.depth_capture, "capture_deep", recorder("synthesis"))
    monkeypatch.setattr(tracer.capture, "capture_steps", recorder("full capture"))
    with pytest.raises(_Reached):
        tracer.analyze("llama-debug", seq=8, full_capture=full_capture, target="cpu")
    assert tried == ["full capture" if full_capture else "synthesis"]
