"""`--levers`: one row per training lever, each a full analysis through the one pipeline (never a formula on
the side): a row equals the analysis of the same settings run on its own."""
import dataclasses
import json
import os

import pytest

from tracer.cli import main
from tracer.levers import LEVERS, fit_levers, lever_options, run_levers
from tracer.pipeline import AnalysisOptions, run_analysis
from tracer.planning import fit_budget

BASE = AnalysisOptions(batch=4, seq=32, target="cpu")
SOME = tuple(lever for lever in LEVERS if lever.name in (
    "baseline", "full checkpointing", "8-bit AdamW", "accumulate 4", "ZeRO-2", "full + pure bf16"))


@pytest.fixture(scope="module")
def table():
    return run_levers("llama-debug", BASE, world_size=4, levers=SOME)


@pytest.mark.slow
def test_each_row_is_the_analysis_of_its_settings_run_alone(table):
    for row in table.rows:
        label = row.options.policy_specs()[0].label
        alone = run_analysis("llama-debug", row.options).policies[label]
        peak = alone.sharded.peak_bytes if alone.sharded is not None else alone.peak_bytes
        assert (row.peak_bytes, row.saved_bytes, row.recompute_flops) == (
            peak, alone.saved.activation_bytes, alone.recompute_flops), row.lever


@pytest.mark.slow
def test_levers_that_change_only_the_policy_or_the_step_around_it_share_one_capture(table):
    # baseline, full, ZeRO-2 and 8-bit AdamW share one joint capture; accumulation (a smaller micro-batch)
    # and pure bf16 need their own
    assert table.captures == 3


@pytest.mark.slow
def test_the_levers_change_what_they_should(table):
    rows = {row.lever: row for row in table.rows}
    base = rows["baseline"]
    assert rows["full checkpointing"].saved_bytes < base.saved_bytes and rows["full checkpointing"].recompute_flops > 0
    assert rows["8-bit AdamW"].state_bytes < base.state_bytes and rows["8-bit AdamW"].saved_bytes == base.saved_bytes
    assert rows["ZeRO-2"].state_bytes < base.state_bytes
    assert rows["accumulate 4"].options.batch == 1 and rows["accumulate 4"].options.accumulate == 4
    assert rows["full + pure bf16"].peak_bytes < rows["full checkpointing"].peak_bytes


@pytest.mark.slow
@pytest.mark.parametrize("fork", [True, False], ids=["forked", "spawned where there is no fork"])
def test_capture_groups_in_worker_processes_give_the_same_rows(table, fork, monkeypatch):
    import tracer.capture.triton_target
    monkeypatch.setattr(tracer.capture.triton_target, "forking_available", lambda: fork)
    parallel = run_levers("llama-debug", BASE, world_size=4, levers=SOME, workers=2)
    assert parallel == table


@pytest.mark.slow
def test_an_error_in_a_worker_process_keeps_its_type_and_hint(tmp_path):
    from tracer.errors import ModelRunError
    model = tmp_path / "broken.py"
    model.write_text("import torch\n\ndef build_model():\n    raise ValueError('no such layer')\n\n"
                     "def example_batch(batch, seq):\n    return (torch.zeros(batch, seq),)\n")
    with pytest.raises(ModelRunError, match="no such layer") as raised:
        run_levers(str(model), BASE, world_size=4, levers=SOME, workers=2)
    assert raised.value.exit_code == ModelRunError.exit_code


def test_a_lever_whose_step_cannot_be_captured_says_why_and_the_others_stand(tmp_path):
    """The model reads its projection's weight itself, which a 4-bit layer's packed weight cannot serve: the
    QLoRA row gives the failure, the baseline's row is made as without it."""
    pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    model = tmp_path / "reads_weight.py"
    model.write_text("import torch\nimport torch.nn.functional as F\nfrom torch import nn\n\n"
                     "class Net(nn.Module):\n"
                     "    def __init__(self):\n"
                     "        super().__init__()\n"
                     "        self.embed, self.proj, self.head = nn.Embedding(64, 32), nn.Linear(32, 32), nn.Linear(32, 64)\n"
                     "    def forward(self, tokens, targets):\n"
                     "        h = F.linear(self.embed(tokens), self.proj.weight.t())\n"
                     "        return F.cross_entropy(self.head(h).flatten(0, 1), targets.flatten())\n\n"
                     "def build_model():\n    return Net()\n\n"
                     "def example_batch(batch, seq):\n"
                     "    return torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))\n")
    levers = tuple(lever for lever in LEVERS if lever.name in ("baseline", "QLoRA: 4-bit base + LoRA r=16"))
    baseline, qlora = run_levers(str(model), BASE, levers=levers).rows
    assert qlora.options is None and "failed" in qlora.reason and qlora.peak_bytes is None
    assert baseline.peak_bytes == run_analysis(str(model), BASE).policies["eager"].peak_bytes


def test_a_lever_that_does_not_apply_says_why():
    zero2 = next(lever for lever in LEVERS if lever.name == "ZeRO-2")
    accumulate = next(lever for lever in LEVERS if lever.name == "accumulate 4")
    assert lever_options(zero2, BASE) == (None, "give --world-size N")
    options, reason = lever_options(accumulate, dataclasses.replace(BASE, batch=6))
    assert options is None and "does not split into 4 micro-batches" in reason
    offload = next(lever for lever in LEVERS if lever.name == "offload optimizer")
    options, reason = lever_options(offload, dataclasses.replace(BASE, accumulate=2))
    assert options is None and "--offload with --accumulate" in reason          # AnalysisOptions' own refusal


@pytest.mark.slow
def test_fit_levers_gives_the_planners_answer_per_lever():
    levers = tuple(lever for lever in LEVERS if lever.name in ("baseline", "full checkpointing"))
    fits = fit_levers("llama-debug", "6MiB", BASE, levers=levers)
    for fit, policy in zip(fits, ("eager", "full")):
        report = fit_budget("llama-debug", "6MiB", seq=32, policies=(policy,), target="cpu")
        assert fit.largest_batch == report.results[policy].largest > 0
    assert fits[1].largest_batch > fits[0].largest_batch


def test_fit_levers_in_worker_processes_gives_the_same_answers():
    """Each lever's fit is independent: made in two processes, every lever's answer (and the reason of one
    that does not apply) is the one made in this process."""
    levers = tuple(lever for lever in LEVERS if lever.name in ("baseline", "full checkpointing", "8-bit AdamW",
                                                                "accumulate 4", "ZeRO-2"))
    alone = fit_levers("llama-debug", "6MiB", BASE, levers=levers)
    assert fit_levers("llama-debug", "6MiB", BASE, levers=levers, workers=2) == alone
    assert [fit.largest_batch is None for fit in alone] == [False, False, False, False, True]   # ZeRO-2: no ranks


@pytest.mark.slow
def test_the_command_line_prints_every_lever_and_writes_json(tmp_path, capsys):
    path = tmp_path / "levers.json"
    assert main(["llama-debug", "--seq", "16", "--batch", "4", "--target", "cpu", "--levers", "--world-size", "2",
                 "--json", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    for lever in LEVERS:
        assert lever.name in out
    data = json.loads(path.read_text())
    assert [row["lever"] for row in data["levers"]] == [lever.name for lever in LEVERS]
    assert all(row["applies"] for row in data["levers"])


def test_every_flag_reaches_each_levers_analysis(monkeypatch):
    import tracer.cli
    import tracer.levers
    from test_every_option_reaches_the_analysis import EXPECTED, FLAGS

    seen = []

    def record(source, variants, **kwargs):
        seen.append(variants[0])
        raise RuntimeError("recorded")

    monkeypatch.setattr(tracer.levers, "capture_variants", record)
    with pytest.raises(RuntimeError, match="recorded"):
        run_levers("hf:gpt2", tracer.cli.analysis_options(tracer.cli.build_parser().parse_args(
            ["hf:gpt2", "--hf-config", "n_layer=2", *FLAGS])))      # two blocks: captured whole
    for name, value in EXPECTED.items():
        assert getattr(seen[0], name) == value, name


DEEP = os.path.join(os.path.dirname(__file__), "fixtures", "llama12_debug.py")   # 12 blocks: synthesized from 4


def _numbers(table):
    return [(row.lever, row.reason, row.options, row.peak_bytes, row.saved_bytes, row.state_bytes, row.host_bytes,
             row.recompute_flops, row.out_of_memory) for row in table.rows]


@pytest.mark.slow
def test_a_deep_models_cut_captures_in_worker_processes_give_the_same_rows():
    """Each capture group of a deep model cut to 4 and to 6 blocks in two worker processes, checked and
    synthesized in this one: every number of every row as capture_deep in one process gives it, on a CUDA
    target (the device view's OOM) with sharding and accumulation."""
    base = dataclasses.replace(BASE, target="cuda")
    alone = run_levers(DEEP, base, world_size=4, levers=SOME)
    parallel = run_levers(DEEP, base, world_size=4, levers=SOME, workers=2)
    assert _numbers(parallel) == _numbers(alone) and parallel.captures == alone.captures == 3
    assert all(row.peak_bytes for row in alone.rows)


UNIFORM = tuple(lever for lever in LEVERS if lever.name in (
    "baseline", "full checkpointing", "pure bf16", "accumulate 4", "LoRA r=16", "full + pure bf16"))


@pytest.mark.slow
def test_groups_that_change_every_block_alike_reuse_the_baselines_depth_check(monkeypatch):
    """Pure bf16, a micro-batch and LoRA change every block the same way: their groups are captured cut to
    4 blocks only (the 6-block check ran on the baseline's group) and every row equals its full capture."""
    import tracer.levers
    from tracer.depth_capture import BASE_DEPTH, CHECK_DEPTH

    depths = []
    honest = tracer.levers._capture_cut

    def recording(model, base, variants, depth):
        depths.append((variants[0].precision, variants[0].batch, variants[0].lora_rank or 0, depth))
        return honest(model, base, variants, depth)

    monkeypatch.setattr(tracer.levers, "_capture_cut", recording)
    synthesized = run_levers(DEEP, BASE, levers=UNIFORM)
    assert sorted(depths) == sorted([("fp32", 4, 0, CHECK_DEPTH), ("fp32", 4, 0, BASE_DEPTH),
                                     ("bf16-pure", 4, 0, BASE_DEPTH), ("fp32", 1, 0, BASE_DEPTH),
                                     ("fp32", 4, 16, BASE_DEPTH)])
    captured = run_levers(DEEP, dataclasses.replace(BASE, full_capture=True), levers=UNIFORM)
    assert [dataclasses.replace(r, options=None) for r in synthesized.rows] == \
        [dataclasses.replace(r, options=None) for r in captured.rows]


@pytest.mark.slow
def test_a_failed_baseline_check_captures_every_group_as_the_full_capture_does(monkeypatch):
    """The baseline group's rows are made before its depth check's verdict; when the check fails, they are
    dropped: every group is captured again as capture_deep does it, in full with the note saying why, and
    every row equals the full capture's."""
    import tracer.depth_capture
    import tracer.levers

    in_full = []
    honest = tracer.levers.capture_variants

    def recording(source, variants, **keywords):
        graphs = honest(source, variants, **keywords)
        in_full.extend((v.precision, v.batch, v.lora_rank) for v, graph in zip(variants, graphs)
                       if any(note.startswith("depth: captured all") for note in graph.config.notes))
        return graphs

    monkeypatch.setattr(tracer.levers, "capture_variants", recording)
    monkeypatch.setattr(tracer.depth_capture, "first_difference", lambda synthesized, captured: "forced to differ")
    failed = run_levers(DEEP, BASE, levers=UNIFORM)
    assert set(in_full) == {("fp32", 4, None), ("bf16-pure", 4, None), ("fp32", 1, None), ("fp32", 4, 16)}
    captured = run_levers(DEEP, dataclasses.replace(BASE, full_capture=True), levers=UNIFORM)
    assert [dataclasses.replace(r, options=None) for r in failed.rows] == \
        [dataclasses.replace(r, options=None) for r in captured.rows]


SHALLOW = os.path.join(os.path.dirname(__file__), "fixtures", "llama8_debug.py")   # 8 blocks: one capture in full


def _without_options(table) -> list:
    """The rows' numbers (their options differ in `full_capture` alone)."""
    return [dataclasses.replace(row, options=None) for row in table.rows]


def _cut_depths_recorded(monkeypatch) -> list:
    """(variant options, depth) of every cut capture `run_levers` makes from now on in this process."""
    import tracer.levers

    depths = []
    honest = tracer.levers.capture_cut_variants

    def recording(source, variants, depth, **keywords):
        depths.extend((v, depth) for v in variants)
        return honest(source, variants, depth, **keywords)

    monkeypatch.setattr(tracer.levers, "capture_cut_variants", recording)
    return depths


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_a_shallow_models_uniform_groups_are_cut_and_checked_on_the_baselines_full_capture(monkeypatch, workers):
    """A model of 8 blocks is captured in full (cutting it to 4 and 6 blocks would cost as much), but the
    groups that change every block alike are captured cut to 4 blocks only: the baseline's step cut to 4
    blocks, under each policy those groups use, is synthesized to 8 and compared op for op with the
    baseline's full capture. Every row equals its full capture, in one process or with worker processes."""
    from tracer.depth_capture import BASE_DEPTH

    depths = _cut_depths_recorded(monkeypatch)
    synthesized = run_levers(SHALLOW, BASE, levers=UNIFORM, workers=workers)
    if workers == 1:                          # (a worker process's cut captures are not seen from here)
        assert sorted((v.precision, v.batch, v.lora_rank or 0, v.policies[0], depth) for v, depth in depths) == sorted([
            ("fp32", 4, 0, "eager", BASE_DEPTH), ("fp32", 4, 0, "full", BASE_DEPTH),        # the baseline's check
            ("bf16-pure", 4, 0, "eager", BASE_DEPTH), ("bf16-pure", 4, 0, "full", BASE_DEPTH),
            ("fp32", 1, 0, "eager", BASE_DEPTH), ("fp32", 4, 16, "eager", BASE_DEPTH)])
    captured = run_levers(SHALLOW, dataclasses.replace(BASE, full_capture=True), levers=UNIFORM)
    assert _without_options(synthesized) == _without_options(captured)


@pytest.mark.slow
@pytest.mark.parametrize("model", [SHALLOW, DEEP])
def test_a_check_that_fails_under_one_policy_recaptures_only_the_groups_that_use_it(monkeypatch, model):
    """The baseline's check is read per policy: when the synthesis under full checkpointing differs from
    its capture, the groups with a fully checkpointed row are captured again (in full, or with a check of
    their own), while the groups that only run eager keep their synthesized rows; the baseline's own group
    is made from the cut captures its check already has. Every row equals its full capture."""
    import tracer.depth_capture
    import tracer.levers

    honest_difference = tracer.depth_capture.first_difference

    def full_differs(synthesized, captured):
        return "forced to differ" if synthesized.graph.config.policy == "full" else \
            honest_difference(synthesized, captured)

    again = []
    honest_rows = tracer.levers._group_rows

    def recording(model, base, job, on_progress=None, cut=None, **keywords):
        if cut is None:                       # captured without the cut captures made for it
            again.append(tuple(name for _, name, _ in job))
        return honest_rows(model, base, job, on_progress, cut, **keywords)

    monkeypatch.setattr(tracer.depth_capture, "first_difference", full_differs)
    monkeypatch.setattr(tracer.levers, "_group_rows", recording)
    checked = run_levers(model, BASE, levers=UNIFORM)
    assert again == [("pure bf16", "full + pure bf16")]         # (the baseline's group reuses its own cut captures)
    captured = run_levers(model, dataclasses.replace(BASE, full_capture=True), levers=UNIFORM)
    assert _without_options(checked) == _without_options(captured)


LIBRARY_UNIFORM = tuple(lever for lever in LEVERS if lever.name in (
    "baseline", "FP8 (torchao, tensorwise)", "QLoRA: 4-bit base + LoRA r=16", "offload activations (save_on_cpu)",
    "context parallel (a rank of --world-size)"))


@pytest.mark.slow
def test_float8_a_4bit_base_offloaded_activations_and_context_parallelism_change_every_block_alike(monkeypatch):
    """torchao's float8 linears, bitsandbytes' 4-bit base under LoRA, save_on_cpu and attention's ring over
    the ranks each change every block the same way: their groups are cut to 4 blocks with the baseline's
    check, and every row equals its full capture."""
    from tracer.depth_capture import BASE_DEPTH

    for library in ("torchao", "bitsandbytes", "peft"):
        pytest.importorskip(library)
    depths = _cut_depths_recorded(monkeypatch)
    synthesized = run_levers(SHALLOW, BASE, world_size=2, levers=LIBRARY_UNIFORM)
    assert all(row.options is not None for row in synthesized.rows), [row.reason for row in synthesized.rows]
    cut = {(v.fp8, v.quantized_base, v.offload, v.cp) for v, depth in depths if depth == BASE_DEPTH}
    assert cut == {(None, None, None, 1), ("tensorwise", None, None, 1), (None, "4bit", None, 1),
                   (None, None, "activations", 1), (None, None, None, 2)}
    captured = run_levers(SHALLOW, dataclasses.replace(BASE, full_capture=True), world_size=2, levers=LIBRARY_UNIFORM)
    assert _without_options(synthesized) == _without_options(captured)


@pytest.mark.slow
def test_the_baselines_cut_in_larger_units_runs_beside_a_worker_and_equals_one_process():
    """When the baseline's check asks for units of 2 blocks (a compiled plan handing buffers on), its
    deeper cut is captured in this process and the shallower in a worker: the same steps as one process
    makes one after the other."""
    from tracer.depth_capture import cut_depths, find_block_list, first_difference
    from tracer.levers import _cut_again_beside, _variants
    from tracer.pipeline import analyze_one, capture_cut_variants, capture_processes, load_source

    job = tuple((i, lever.name, lever_options(lever, BASE)[0]) for i, lever in enumerate(UNIFORM[:2]))
    source = load_source(DEEP, BASE)
    blocks = find_block_list(source, precision="fp32", seq=BASE.seq)
    variants = tuple(_variants(job).values())
    with capture_processes(1) as pool:
        cut = _cut_again_beside(pool, DEEP, BASE, job, source.name, lambda message: None)(blocks, (1,), 2)
    assert cut.error is None and cut.group == 2
    for depth, graphs in zip(cut_depths(blocks.depth, 2), (cut.base, cut.check)):
        (alone,) = capture_cut_variants(source, variants[1:], depth)
        assert first_difference(analyze_one(graphs[0], variants[1]), analyze_one(alone, variants[1])) is None


COMPILED = tuple(lever for lever in LEVERS if lever.name in ("baseline", "full checkpointing", "torch.compile"))


@pytest.mark.slow
def test_a_deep_models_compiled_lever_is_cut_in_units_of_2_at_once_and_equals_its_full_capture(tmp_path,
                                                                                               monkeypatch):
    """On a CUDA target Inductor's Triton plan hands buffers on across blocks: the torch.compile row leaves
    the baseline group's cuts in units of one block (4 and 6 blocks: eager and full checkpointing alone) and
    is cut in units of 2 at once (8 and 12 of 24 blocks), never planned at 4 or 6 blocks. In one process and
    with two workers, every row equals its full capture."""
    from deep_llama import deep_llama
    from tracer.depth_capture import BASE_DEPTH, CHECK_DEPTH

    path = deep_llama(tmp_path, 24)
    base = dataclasses.replace(BASE, batch=1, seq=16, target="cuda")
    depths = _cut_depths_recorded(monkeypatch)
    alone = run_levers(path, base, levers=COMPILED)
    cut = sorted((v.policies[0], depth) for v, depth in depths)
    assert cut == [("compiled", 8), ("compiled", 12), ("eager", BASE_DEPTH), ("eager", CHECK_DEPTH),
                   ("full", BASE_DEPTH), ("full", CHECK_DEPTH)]
    parallel = run_levers(path, base, levers=COMPILED, workers=2)
    captured = run_levers(path, dataclasses.replace(base, full_capture=True), levers=COMPILED)
    assert _without_options(alone) == _without_options(parallel) == _without_options(captured)
    assert all(row.peak_bytes for row in alone.rows)


def test_the_calling_process_runs_the_queued_groups_no_worker_has_started_while_it_waits():
    """While it waits for a worker's result, the calling process takes back the groups still queued, the
    last first, and runs them itself: each group's result is the same whichever process ran it."""
    import multiprocessing
    import time
    from concurrent.futures import ProcessPoolExecutor

    from tracer.levers import _Queued, _run_queued_here

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("fork")) as pool:
        awaited = pool.submit(time.sleep, 3)             # the baseline's group: the one worker is busy
        queued = [_Queued(pool, os.getpid) for _ in range(4)]
        _run_queued_here(queued, awaited)
        assert not awaited.done()
        pids = [job.result() for job in queued]
        awaited.result()
    assert pids[-1] == pids[-2] == os.getpid()           # taken back, the last submitted first
    assert all(isinstance(pid, int) for pid in pids)
