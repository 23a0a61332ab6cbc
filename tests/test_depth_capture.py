"""The default capture of a deep model (tracer/depth_capture.py): cut to 4 and 6 blocks, the full depth
synthesized and checked, and every report equal to the full capture's (`full_capture=True`)."""
import dataclasses
import os

import pytest

import tracer
from deep_llama import LLAMA12, deep_llama
from tracer.depth_capture import first_difference
from tracer.reports.json_report import report_json
from tracer.reports.text import render_text

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")
LLAMA6 = os.path.join(FIXTURES, "llama6_debug.py")
MLP_LM = os.path.join(FIXTURES, "mlp_lm.py")
NOTE = ("depth: captured 4 and 6 of 12 blocks of blocks; the 6-block step synthesized from 4 equals its capture op "
        "for op, the 12-block step is synthesized")
HF_TINY = ("num_hidden_layers=12", "hidden_size=32", "intermediate_size=64", "num_attention_heads=2", "vocab_size=128")


def _both(model, **keywords):
    return tracer.analyze(model, **keywords), tracer.analyze(model, full_capture=True, **keywords)


def _assert_same_reports(synthesized, captured, note_start="depth: captured 4 and 6"):
    """Every number of every policy, the JSON report (but the depth note and the names of synthesized
    nodes) and the text report (but the note)."""
    assert synthesized.policies.keys() == captured.policies.keys()
    for label in captured.policies:
        assert first_difference(synthesized.policies[label], captured.policies[label]) is None, label
    a, b = report_json(synthesized), report_json(captured)
    notes = a.pop("capture_notes")
    depth = [n for n in notes if n.startswith(note_start)]
    assert len(depth) == 1 and notes == b.pop("capture_notes") + depth
    for report in (a, b):
        for policy in report["policies"].values():
            policy["peak_op"].pop("name")
    assert a == b
    text = lambda analysis: [line for line in render_text(analysis).splitlines() if "depth:" not in line]  # noqa: E731
    assert text(synthesized) == text(captured)


@pytest.mark.slow
def test_a_deep_model_is_synthesized_and_reports_as_its_full_capture():
    synthesized, captured = _both(LLAMA12, batch=2, seq=16, policies=("eager", "selective", "full"), target="cuda")
    for result in synthesized.policies.values():
        assert result.graph.config.notes.count(NOTE) == 1
        assert sum(1 for op in result.graph.ops if op.module.startswith("blocks.11.")) > 0
    assert not any("depth:" in note for note in captured.graph.config.notes)
    _assert_same_reports(synthesized, captured)


@pytest.mark.slow
@pytest.mark.parametrize("keywords", [dict(accumulate=2, target="cpu"),
                                      dict(shard="fsdp", world_size=4, target="cuda"),
                                      dict(optimizer="adamw8bit", target="cpu")], ids=["accumulate", "fsdp", "adamw8bit"])
def test_micro_batches_and_sharding_report_as_the_full_capture(keywords):
    """adamw8bit on the CPU: bitsandbytes' CPU kernels, traced, make the same temporaries for every block's
    parameters, so block 1's state and temporaries are paired with block 2's."""
    synthesized, captured = _both(LLAMA12, batch=2, seq=16, **keywords)
    assert NOTE in synthesized.graph.config.notes
    _assert_same_reports(synthesized, captured)


@pytest.mark.slow
def test_blocks_that_differ_are_captured_in_full_with_the_reason():
    """Every second block checkpointed: blocks 1 and 2 differ, so the step is captured in full."""
    analysis = tracer.analyze(LLAMA12, batch=1, seq=16, policies=("full",), target="cpu", checkpoint_every=2)
    (note,) = [n for n in analysis.graph.config.notes if n.startswith("depth:")]
    assert note.startswith("depth: captured all 12 blocks of blocks: the 6-block step synthesized from 4 blocks "
                           "differs from its capture (full: ") and "not identical" in note
    assert sum(1 for op in analysis.graph.ops if op.module.startswith("blocks.11.")) > 0


@pytest.mark.slow
def test_the_check_decides(monkeypatch):
    """A synthesis that is off by 512 bytes at one op is refused, and the op named."""
    import tracer.passes.depth_graph as depth_graph
    honest = depth_graph.synthesize_depth

    def off_by_one_block(graph, depth, group=1):
        out = honest(graph, depth, group)
        storages = list(out.storages)
        op = next(op for op in out.ops if op.module == "blocks.3.mlp.w1" and op.target == "aten.mm.default")
        sid = op.outputs[0].storage_id
        storages[sid] = dataclasses.replace(storages[sid], nbytes=storages[sid].nbytes + 512)
        return dataclasses.replace(out, storages=tuple(storages))

    monkeypatch.setattr(depth_graph, "synthesize_depth", off_by_one_block)
    analysis = tracer.analyze(LLAMA12, batch=1, seq=16, target="cpu")
    (note,) = [n for n in analysis.graph.config.notes if n.startswith("depth:")]
    assert "differs from its capture (eager: live bytes during op" in note and "blocks.3.mlp.w1" in note


@pytest.mark.slow
def test_compiled_code_that_hands_buffers_on_is_synthesized_in_units_of_its_reach(tmp_path):
    """Inductor's Triton plan gives a block's weight gradient the buffer that the three blocks after it used
    in turn in backward: one-block units differ from the 6-block capture, whose buffers reach 3 blocks, so
    the model is cut again in units of 3 (13 and 19 of its 64 blocks), and every report equals the full
    capture's."""
    path = deep_llama(tmp_path, 64)
    keywords = dict(batch=1, seq=16, policies=("compiled",), target="cuda")
    synthesized, captured = tracer.analyze(path, **keywords), tracer.analyze(path, full_capture=True, **keywords)
    (note,) = [n for n in synthesized.graph.config.notes if n.startswith("depth:")]
    assert note == ("depth: captured 13 and 19 of 64 blocks of blocks; the 19-block step synthesized from 13 in "
                    "units of 3 blocks equals its capture op for op, the 64-block step is synthesized")
    _assert_same_reports(synthesized, captured, note_start="depth: captured 13 and 19")


def _ten_block_mlp(directory) -> str:
    """tests/fixtures/mlp_lm.py with ten blocks (BASE_DEPTH + CHECK_DEPTH, the deepest model captured in
    full), cheap to capture."""
    text = open(MLP_LM).read()
    old = "VOCAB, DIM, HIDDEN, LAYERS = 256, 32, 64, 2\n"
    assert text.count(old) == 1, "mlp_lm.py's sizes line changed"
    path = directory / "mlp10_lm.py"
    path.write_text(text.replace(old, old.replace(", 2\n", ", 10\n")))
    return str(path)


@pytest.mark.parametrize("model", ["mlp", pytest.param("llama", marks=pytest.mark.slow)])
def test_shallow_models_and_full_capture_are_captured_in_full_without_a_note(model, tmp_path):
    """Ten blocks (BASE_DEPTH + CHECK_DEPTH: the two cut captures would cost as much) and six are not deep:
    captured in full, no depth note."""
    path, last = (_ten_block_mlp(tmp_path), 9) if model == "mlp" else (LLAMA6, 5)
    shallow = tracer.analyze(path, batch=1, seq=8, target="cpu")
    assert not any("depth:" in note for note in shallow.graph.config.notes)
    assert any(op.module.startswith(f"blocks.{last}.") for op in shallow.graph.ops)


@pytest.mark.slow
@pytest.mark.parametrize("model,policies,target", [("hf:llama", ("eager", "selective", "full"), "cuda"),
                                                   ("hf:bert", ("eager", "full"), "cpu")])
def test_transformers_models_report_as_their_full_capture(model, policies, target):
    synthesized, captured = _both(model, hf_config=HF_TINY, batch=1, seq=16, policies=policies, target=target)
    (note,) = [n for n in synthesized.graph.config.notes if n.startswith("depth:")]
    assert note.startswith("depth: captured 4 and 6 of 12 blocks of model.")
    _assert_same_reports(synthesized, captured)


@pytest.mark.slow
def test_levers_are_synthesized_too():
    from tracer.levers import LEVERS, run_levers
    from tracer.pipeline import AnalysisOptions

    levers = tuple(lever for lever in LEVERS if lever.name in ("baseline", "full checkpointing", "8-bit AdamW"))
    base = AnalysisOptions(batch=2, seq=16, target="cuda")
    synthesized = run_levers(LLAMA12, base, levers=levers)
    captured = run_levers(LLAMA12, dataclasses.replace(base, full_capture=True), levers=levers)
    assert [dataclasses.replace(r, options=None) for r in synthesized.rows] == \
        [dataclasses.replace(r, options=None) for r in captured.rows]


@pytest.mark.slow
def test_a_synthesis_checked_on_another_capture_still_refuses_blocks_that_differ():
    """A capture group synthesized on another group's check (tracer/levers.py) is captured at 4 blocks
    only; blocks 1 and 2 that differ (every second block checkpointed) still send it to the full capture,
    with the reason, and blocks that agree are synthesized with a note naming where the check ran."""
    from tracer.depth_capture import BASE_DEPTH, CutSteps, check_synthesis, find_block_list
    from tracer.pipeline import AnalysisOptions, capture_graphs, load_source
    from tracer.depth_capture import cut_source

    def cut_base(**keywords):
        options = AnalysisOptions(batch=1, seq=16, policies=("full",), target="cpu", **keywords)
        source = load_source(LLAMA12, options)
        blocks = find_block_list(source, precision="fp32", seq=16)
        base = capture_graphs(cut_source(source, BASE_DEPTH, {}), dataclasses.replace(options, full_capture=True))
        return CutSteps(blocks, tuple(base.values()), None, checked_on="a 6-block capture of elsewhere")

    differ = check_synthesis(cut_base(checkpoint_every=2), analyze=None, count=1)
    assert differ.graphs == (None,) and differ.note.startswith(
        "depth: captured all 12 blocks of blocks: the step cut to 4 blocks cannot be synthesized (full: ")
    agree = check_synthesis(cut_base(), analyze=None, count=1)
    (graph,) = agree.graphs
    assert agree.note is None and any(op.module.startswith("blocks.11.") for op in graph.ops)
    assert graph.config.notes[-1] == ("depth: captured 4 of 12 blocks of blocks, the 12-block step is synthesized; "
                                      "the synthesis was checked op for op against a 6-block capture of elsewhere")


def test_two_processes_give_the_answer_of_one():
    """workers=2: the CHECK_DEPTH-block capture runs in a forked child while this one captures
    BASE_DEPTH blocks and prepares the synthesis; the analysis is that of the one-process run."""
    keywords = dict(batch=1, seq=16, policies=("eager", "full"), target="cpu")
    one, two = tracer.analyze(LLAMA12, **keywords), tracer.analyze(LLAMA12, workers=2, **keywords)
    for label in one.policies:
        assert NOTE in two.policies[label].graph.config.notes
        assert first_difference(two.policies[label], one.policies[label]) is None, label
    assert report_json(two) == report_json(one)


def test_a_platform_without_fork_captures_the_check_in_a_spawned_process(monkeypatch):
    """Without fork(), the CHECK_DEPTH-block capture runs in a spawned process that loads the model by its
    name, with the same answer."""
    from tracer.capture import triton_target
    monkeypatch.setattr(triton_target, "forking_available", lambda: False)
    keywords = dict(batch=1, seq=16, policies=("eager",), target="cpu")
    two = tracer.analyze(LLAMA12, workers=2, **keywords)
    assert NOTE in two.graph.config.notes
    assert report_json(two) == report_json(tracer.analyze(LLAMA12, **keywords))


def test_a_forked_check_that_dies_is_captured_here(monkeypatch):
    """A forked child that ends without an answer (killed, out of memory): the check's capture is made in
    this process, with the same answer."""
    from tracer.capture import triton_target
    start = triton_target.start_forked

    def dying(work):
        def die():
            os._exit(1)
        return start(die)

    monkeypatch.setattr(triton_target, "start_forked", dying)
    keywords = dict(batch=1, seq=16, policies=("eager",), target="cpu")
    analysis = tracer.analyze(LLAMA12, workers=2, **keywords)
    assert NOTE in analysis.graph.config.notes
    assert report_json(analysis) == report_json(tracer.analyze(LLAMA12, **keywords))


def test_a_model_of_8_to_10_blocks_is_cut_when_its_deeper_cut_runs_beside(tmp_path, monkeypatch):
    """With a second core and no compiled policy, a model of 9 blocks (captured in full by one process:
    4 + 6 blocks one after the other cost more) is cut to 4 and 6 blocks, the 6 in a forked child at once,
    and reports as its full capture."""
    from tracer.capture import triton_target
    monkeypatch.setattr(triton_target, "usable_cores", lambda: 2)
    path = deep_llama(tmp_path, 9)
    keywords = dict(batch=1, seq=16, policies=("eager", "full"), target="cpu")
    synthesized = tracer.analyze(path, workers=2, **keywords)
    assert ("depth: captured 4 and 6 of 9 blocks of blocks; the 6-block step synthesized from 4 equals its capture "
            "op for op, the 9-block step is synthesized") in synthesized.graph.config.notes
    _assert_same_reports(synthesized, tracer.analyze(path, **keywords))


@pytest.mark.parametrize("cores, policies, layers", [(1, ("eager",), 9), (2, ("eager", "compiled"), 9),
                                                     (2, ("eager",), 7)],
                         ids=["one core", "a compiled policy", "7 blocks"])
def test_a_shallow_model_is_captured_in_full_where_cutting_it_would_not_pay(tmp_path, monkeypatch, cores, policies,
                                                                           layers):
    """One core (the two cuts would run one after the other), a compiled policy (Inductor plans the whole
    model: its full capture is made anyway) or 7 blocks (its deeper cut costs about its depth): in full."""
    from tracer.capture import triton_target
    from tracer.pipeline import AnalysisOptions, _cut_beside_deeper_than, block_list, load_source

    monkeypatch.setattr(triton_target, "usable_cores", lambda: cores)
    path = deep_llama(tmp_path, layers)
    options = AnalysisOptions(batch=1, seq=16, policies=policies, target="cpu")
    deeper_than = _cut_beside_deeper_than(options.policy_specs())
    assert block_list(load_source(path, options), options, deeper_than=deeper_than) is None


def test_a_forked_child_models_its_parents_threads():
    """The child runs its few real ops on one thread, and sizes per-thread kernel scratch for the parent's
    count (`intra_op_threads`), as the parent's own capture would."""
    import torch
    from tracer.capture.triton_target import in_forked_process, intra_op_threads

    def seen():
        return torch.get_num_threads(), intra_op_threads()

    assert in_forked_process(seen) == (1, torch.get_num_threads())
    assert intra_op_threads() == torch.get_num_threads()


def test_a_pool_that_cannot_start_captures_the_check_here(monkeypatch):
    """A script without `if __name__ == "__main__":` cannot spawn (where the check would run in a spawned
    process: no fork): the check's capture is made in this process, with the same answer."""
    import concurrent.futures
    from concurrent.futures.process import BrokenProcessPool

    from tracer.capture import triton_target
    monkeypatch.setattr(triton_target, "forking_available", lambda: False)

    class Broken:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, *args, **kwargs):
            future = concurrent.futures.Future()
            future.set_exception(BrokenProcessPool("no process"))
            return future

    monkeypatch.setattr(concurrent.futures, "ProcessPoolExecutor", Broken)
    keywords = dict(batch=1, seq=16, policies=("eager",), target="cpu")
    analysis = tracer.analyze(LLAMA12, workers=2, **keywords)
    assert NOTE in analysis.graph.config.notes
    assert report_json(analysis) == report_json(tracer.analyze(LLAMA12, **keywords))


def test_the_processes_of_a_capture_pool_share_the_cores():
    """A capture process beside others plans each compiled graph pair in one process: a forked planner
    beside it would only take a core another capture process is using."""
    from tracer.capture.triton_target import planning_cores, usable_cores
    from tracer.pipeline import capture_processes
    shared = max(1, usable_cores() // 2)
    assert planning_cores() == usable_cores()
    with capture_processes(1) as pool:
        assert pool.submit(planning_cores).result() == shared
        assert planning_cores() == shared
    assert planning_cores() == usable_cores()


@pytest.mark.slow
def test_a_shallow_models_compiled_policy_is_captured_beside_the_others():
    """workers=2 on a model captured in full: the compiled policy here, the others in a spawned process;
    the analysis is that of the one-process run."""
    keywords = dict(batch=1, seq=16, policies=("eager", "compiled", "full"), target="cpu")
    one, two = tracer.analyze(LLAMA6, **keywords), tracer.analyze(LLAMA6, workers=2, **keywords)
    for label in one.policies:
        assert first_difference(two.policies[label], one.policies[label]) is None, label
    assert report_json(two) == report_json(one)


@pytest.mark.slow
def test_a_compiled_plan_for_a_cuda_target_is_cut_in_units_of_2_at_once(tmp_path, monkeypatch):
    """Beside eager, in two processes: the compiled policy planned for a CUDA target is left out of the
    cuts in units of one block (Inductor's Triton plan hands buffers on across blocks) and cut in units of
    2 at once, and never captured at 4 or 6 blocks; its 12-block cut is started first, beside eager's cuts.
    Every number of both policies equals the full capture's, and the eager policy is analysed while the
    compiled one's deeper cut is captured."""
    from tracer.pipeline import AnalysisOptions, _cut_ahead

    path = deep_llama(tmp_path, 64)
    options = AnalysisOptions(batch=1, seq=16, policies=("eager", "compiled"), target="cuda")
    assert _cut_ahead(options, options.policy_specs(), (0, 1)) == {1: 2}
    assert _cut_ahead(dataclasses.replace(options, target="cpu"), options.policy_specs(), (0, 1)) == {}
    blocks = dataclasses.replace(options, policies=("compiled-blocks", "compiled+full"))
    assert _cut_ahead(blocks, blocks.policy_specs(), (0, 1)) == {1: 2}      # a block's own plan hands nothing on

    import tracer.pipeline
    analysed_early, cuts = [], []
    analyze_early, cut_in_two = tracer.pipeline._analyze_early, tracer.pipeline._cut_in_two_processes

    def spy(early, label, graph, options):
        analysed_early.append(label)
        analyze_early(early, label, graph, options)

    def cut_spy(*args, **kwargs):
        cut = cut_in_two(*args, **kwargs)
        cuts.append((cut.group, tuple(graph is not None for graph in cut.base),
                     tuple(graph is not None for graph in cut.check)))
        return cut

    import sys
    import tracer.capture.triton_target
    forked_cuts, start_forked = [], tracer.capture.triton_target.start_forked

    def fork_spy(work):
        if sys._getframe(1).f_code.co_name == "fork":        # a cut capture (not a plan) forked by the pipeline
            forked_cuts.append(sys._getframe(1).f_locals["depth"])
        return start_forked(work)

    monkeypatch.setattr(tracer.pipeline, "_analyze_early", spy)
    monkeypatch.setattr(tracer.pipeline, "_cut_in_two_processes", cut_spy)
    monkeypatch.setattr(tracer.capture.triton_target, "start_forked", fork_spy)
    keywords = dict(batch=1, seq=16, policies=("eager", "compiled"), target="cuda")
    synthesized = tracer.analyze(path, workers=2, **keywords)
    captured = tracer.analyze(path, full_capture=True, **keywords)
    for label in captured.policies:
        assert first_difference(synthesized.policies[label], captured.policies[label]) is None, label
    (note,) = [n for n in synthesized.policies["compiled"].graph.config.notes if n.startswith("depth:")]
    assert note.startswith("depth: captured 8 and 12 of 64 blocks of blocks")
    # units of one: eager alone at 4 and 6 blocks; units of 2: the compiled policy alone
    assert cuts == [(1, (True, False), (True, False)), (2, (True,), (True,))]
    # the compiled policy's 12-block cut was forked first, before the 6-block one, and not again
    assert forked_cuts == [12, 6]
    # eager, final before the cut in units of 2, was analysed while the 12-block capture ran elsewhere
    assert analysed_early == ["eager"]


def test_a_compiled_policy_whose_cut_in_units_of_2_does_not_pay_is_captured_in_full_saying_why():
    """At 20 blocks the deeper cut in units of 2 (12 blocks) would capture more than half of the model: the
    compiled policy planned for a CUDA target, left out of the cut in units of one, is captured in full
    with that reason (and not with a comparison it never had); at 24 blocks it is cut in units of 2."""
    from tracer.depth_capture import BlockList, CutSteps, check_synthesis, cut_pays

    assert cut_pays(24, 2) and not cut_pays(23, 2) and cut_pays(36, 3) and not cut_pays(35, 3)
    why = "compiled: not cut in units of 1 block: ..."
    from tracer.depth_capture import PreparedSynthesis
    cut = CutSteps(BlockList("blocks", 20), (None,), (None,), prepared=PreparedSynthesis((None,), (None,), (why,)),
                   ahead={0: 2})
    deep = check_synthesis(cut, lambda i, graph: None, count=1)
    assert deep.graphs == (None,) and deep.retry is None
    assert deep.note == f"depth: captured all 20 blocks of blocks: {why}"     # no comparison was made
    cut = dataclasses.replace(cut, blocks=BlockList("blocks", 24))
    assert check_synthesis(cut, lambda i, graph: None, count=1).retry.group == 2


def test_a_retry_whose_check_asks_for_larger_units_cuts_again(monkeypatch):
    """A cut in units of 2 whose check differs and shows buffers reaching 3 blocks is cut again in units
    of 3; the graphs that check synthesizes replace the missing ones."""
    import tracer.depth_capture
    from tracer.depth_capture import BlockList, DeepCapture, Retry
    from tracer.pipeline import _retried

    blocks = BlockList("blocks", 64)
    cuts = []

    def cut_again(cut_blocks, indices, group):
        cuts.append((indices, group))
        return group

    def check_synthesis(cut, analyze, count):
        if cut == 2:
            return DeepCapture((None,) * count, "units of 2 differ", retry=Retry(blocks, 3))
        return DeepCapture(("synthesized",) * count, None)

    monkeypatch.setattr(tracer.depth_capture, "check_synthesis", check_synthesis)
    deep = DeepCapture(("eager", None), "compiled: not checked in units of 1 block", retry=Retry(blocks, 2))
    again = _retried(None, deep, (1,), None, None, None, cut_again=cut_again)
    assert cuts == [((1,), 2), ((1,), 3)]
    assert again.graphs == ("eager", "synthesized") and again.note is None


def test_a_retry_hands_each_final_graph_on_once_while_the_deeper_cut_is_made(monkeypatch):
    """`meanwhile(i, graph)` is called from inside `cut_again` (where this process would wait for the
    other), once per graph that is final by then: the first cut's eager graph during the first retry, and
    a graph the first retry made final during the second."""
    import tracer.depth_capture
    from tracer.depth_capture import BlockList, DeepCapture, Retry
    from tracer.pipeline import _retried

    blocks = BlockList("blocks", 64)
    handed, during = [], []

    def cut_again(cut_blocks, indices, group, meanwhile=None):
        before = len(handed)
        meanwhile()
        during.append((group, handed[before:]))
        return group

    def check_synthesis(cut, analyze, count):
        if cut == 2:            # the first of the two missing graphs checks in units of 2, the other asks for 3
            return DeepCapture(("selective", None), "units of 2 differ", retry=Retry(blocks, 3))
        return DeepCapture(("compiled",), None)

    monkeypatch.setattr(tracer.depth_capture, "check_synthesis", check_synthesis)
    deep = DeepCapture(("eager", None, None), "not checked in units of 1 block", retry=Retry(blocks, 2))
    again = _retried(None, deep, (1, 2), None, None, None, cut_again=cut_again,
                     meanwhile=lambda i, graph: handed.append((i, graph)))
    assert again.graphs == ("eager", "selective", "compiled")
    assert during == [(2, [(0, "eager")]), (3, [(1, "selective")])]
