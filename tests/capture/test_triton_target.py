"""How a compiled step for a CUDA target is planned by Inductor's Triton scheduling on this CPU-only build
(tracer.capture.triton_target): in a forked child, with the `--gpu` model's properties, nothing compiled,
and pad_mm's timed decisions planned both ways. No GPU checks these plans here; what is tested is that the
plan is Triton's (not the C++ plan), that it follows the GPU model, and that nothing leaks into the parent."""
import os

import pytest
import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_step, load_model_source
from tracer.capture import triton_target
from tracer.capture.triton_target import device_properties, in_forked_process, install_cuda_planning
from tracer.choices import GPUS
from tracer.errors import UsageError

FIXTURES = os.path.join(os.path.dirname(__file__), "..", "fixtures")
BIAS_ROWS = os.path.join(FIXTURES, "bias_gradient_rows.py")
UNALIGNED_VOCAB = os.path.join(FIXTURES, "unaligned_vocab_head.py")
CHANNELS_LAST_CONV = os.path.join(FIXTURES, "conv_channels_last_input.py")
TIMES_ZERO = os.path.join(FIXTURES, "unused_parameters_times_zero.py")
LIBRARY_OPTIMIZER = os.path.join(FIXTURES, "library_optimizer_net.py")

pytestmark = pytest.mark.skipif(triton_target.triton_unavailable() is not None,
                                reason=f"no Triton plan here: {triton_target.triton_unavailable()}")


def _compiled(model, *, gpu="h100", seq=64, policy="compiled", **options):
    return capture_step(load_model_source(model), CaptureOptions(seq=seq, target=f"cuda:{gpu}", **options),
                        PolicySpec(name=policy))


def _planned_storages(graph) -> list[tuple[tuple[int, ...], str]]:
    """(shape, dtype) of every buffer the compiled graphs allocate, in plan order."""
    return [(s.shape, s.dtype) for s in graph.storages if s.name.startswith("inductor ")]


def test_the_forked_child_returns_its_answer_and_raises_its_errors():
    assert in_forked_process(lambda: {"pid": os.getpid()})["pid"] != os.getpid()

    def refuse():
        raise UsageError("a refused model", hint="fix it")
    with pytest.raises(UsageError, match="a refused model") as refused:
        in_forked_process(refuse)
    assert refused.value.hint == "fix it"

    def bug():
        return {}["missing"]
    with pytest.raises(KeyError) as raised:
        in_forked_process(bug)
    assert "in the planning process" in "".join(getattr(raised.value, "__notes__", []))


def test_the_child_sees_the_gpu_model_and_the_parent_is_left_as_it_was():
    """Inductor reads the SM count that sizes split reductions through DeviceProperties.create."""
    def seen():
        install_cuda_planning(GPUS["t4"], pad_decision=True)
        from torch._inductor.runtime.hints import DeviceProperties
        props = DeviceProperties.create(torch.device("cuda", 0))
        with torch._subclasses.fake_tensor.FakeTensorMode():
            x = torch.empty(4, 8, device="cuda")
            indexed = tuple((~(x > 0))[1:, :3].shape)         # C++ device guards on a fake cuda tensor
        return torch.cuda.is_available(), props.multi_processor_count, props.cc, indexed

    assert in_forked_process(seen) == (True, 40, 75, (3, 3))
    assert not torch.cuda.is_available()
    assert device_properties(GPUS["h100"]).multi_processor_count == 132


@pytest.fixture(scope="module")
def bias_rows_plans():
    """The bias-gradient model (64 sums over 65,536 rows) planned for two GPUs with Triton, and with C++."""
    triton = {gpu: _compiled(BIAS_ROWS, gpu=gpu, seq=32768) for gpu in ("h100", "t4")}
    available = triton_target.triton_unavailable
    triton_target.triton_unavailable = lambda: "a test asks for the C++ plan"
    try:
        cpp = _compiled(BIAS_ROWS, seq=32768)
    finally:
        triton_target.triton_unavailable = available
    return triton, cpp


def _partial_sums(graph) -> list[int]:
    """Bytes of the compiled graphs' buffers other than the layer's (65,536, 64) output: the bias gradient's
    partial sums (Inductor's buffers with no tensor of the graph behind them have a byte shape)."""
    return [s.nbytes for s in graph.storages if s.name.startswith("inductor ") and s.shape != (65536, 64)]


def test_a_cuda_target_is_planned_by_triton_and_the_report_says_so(bias_rows_plans):
    triton, cpp = bias_rows_plans
    assert any(note.startswith("compiled plan: Inductor's Triton scheduling for the Hopper H100 80GB (132 SMs")
               for note in triton["h100"].config.notes)
    assert any("Inductor's C++ scheduling stands in for Triton's, which CUDA runs: a test asks for the C++ plan"
               in note for note in cpp.config.notes)
    assert _planned_storages(triton["h100"]) != _planned_storages(cpp)


def test_the_split_reduction_follows_the_gpus_sm_count(bias_rows_plans):
    """Triton splits the bias gradient's 65,536-row sum into partial sums, 64 fp32 per split, with more
    splits on the H100's 132 SMs than on the T4's 40; the C++ plan sums it in one kernel."""
    triton, cpp = bias_rows_plans
    splits = {gpu: max(_partial_sums(graph)) // (64 * 4) for gpu, graph in triton.items()}
    assert all(max(_partial_sums(graph)) % (64 * 4) == 0 for graph in triton.values())
    assert splits["h100"] > splits["t4"] > 1
    assert _partial_sums(cpp) == []


def test_a_timed_pad_mm_decision_is_planned_both_ways():
    """GPT-2's 50,257-token head: Inductor times padding on the GPU; the step is the padded plan and the note
    gives the unpadded plan's own peaks, which differ."""
    graph = _compiled(UNALIGNED_VOCAB, seq=256)
    note = next(n for n in graph.config.notes if n.startswith("pad_mm:"))
    assert "planned padded" in note
    numbers = [int(word.replace(",", "")) for word in note.replace("(", " ").split() if word[:1].isdigit()]
    unpadded, padded = numbers[-4:-2], numbers[-2:]
    assert unpadded != padded


def test_a_channels_last_convolution_keeps_its_layout_in_the_triton_plan():
    """PVT's and SegFormer's spatial reduction views a sequence as a channels_last image, convolves it and views
    the output as a sequence again: cuDNN, like the CPU kernel the capture traced, keeps the channels_last
    layout that view needs. Without cuDNN in this build ATen would give the fake cuda convolution its slow
    kernel's contiguous output, and the plan failed ("Cannot view a tensor with shape ...")."""
    graph = _compiled(CHANNELS_LAST_CONV, seq=64)
    assert any(note.startswith("compiled plan: Inductor's Triton scheduling") for note in graph.config.notes)
    assert any(op.target.startswith("aten.convolution") for op in graph.ops)


def test_a_product_with_zero_is_folded_on_the_cpu():
    """DDP users add every parameter times 0 to the loss; Inductor's constant folder replaces each product
    with a one-element zero it makes with `torch.full(..., device=<the node's device>)`, a factory that
    initialises CUDA before any dispatch mode sees it (this build has no CUDA: the plan failed with "Torch
    not compiled with CUDA enabled"). The factory runs on the CPU; the zero keeps its cuda device."""
    graph = _compiled(TIMES_ZERO, seq=64)
    assert any(note.startswith("compiled plan: Inductor's Triton scheduling") for note in graph.config.notes)
    assert not torch.cuda.is_available()


def test_the_planning_child_records_the_optimizer_step_as_the_capture_sees_the_machine(tmp_path):
    """bitsandbytes' 8-bit AdamW takes its CUDA path when torch.cuda says a GPU is there at its first import.
    The planning child answers torch.cuda's queries for Inductor; the optimizer step it records sees this CPU
    build, as the capturing process does (the plan failed: "module 'torch._C' has no attribute
    '_cuda_getCurrentRawStream'"), and the compiled step keeps the eager step's optimizer state. A fresh
    process: bitsandbytes is first imported in the planning child, as in a user's run."""
    import importlib.util
    import json
    import subprocess
    import sys
    if importlib.util.find_spec("bitsandbytes") is None:
        pytest.skip("bitsandbytes is not installed")
    report = tmp_path / "report.json"
    run = subprocess.run([sys.executable, "-m", "tracer", LIBRARY_OPTIMIZER, "--seq", "64", "--policy", "all",
                          "--no-cache", "--json", str(report)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    policies = json.loads(report.read_text())["policies"]
    state = {name: policies[name]["by_category_at_peak"]["optimizer_state"] for name in ("eager", "compiled")}
    assert state["eager"] > 0 and state["compiled"] == state["eager"]


def test_an_aligned_model_needs_no_timed_decision():
    graph = _compiled(BIAS_ROWS, seq=64)
    assert not any(n.startswith("pad_mm:") for n in graph.config.notes)


@pytest.mark.parametrize("policy", ["compiled+full", "compiled-blocks+full"])
def test_checkpointed_random_ops_replay_from_the_generator_state(policy):
    """On CUDA the partitioner replays a recomputed dropout from the generator's cloned state, a graph input
    on the host: no RNG state tensor is saved (the C++ plan saves the CPU generator's 5,056 B state)."""
    graph = _compiled("gpt2-debug", seq=32, policy=policy)
    assert any(op.target.endswith("_scaled_dot_product_efficient_attention.default") and op.recomputed
               for op in graph.ops)
    assert not [s for s in graph.storages if s.nbytes == torch.get_rng_state().numel()]


@pytest.mark.parametrize("model,policy", [("gpt2-debug", "compiled"), ("gpt2-debug", "compiled+selective"),
                                          ("gpt2-debug", "compiled-blocks+full"),
                                          (UNALIGNED_VOCAB, "compiled")])
def test_the_forward_planned_beside_the_backward_is_the_plan_made_after_it(model, policy, monkeypatch, tmp_path):
    """With two cores the planning child lowers the forward in a forked child of its own while it plans the
    backward; the step is the one planned one graph after the other, to the last field."""
    starts = tmp_path / "starts"               # one line per forked child, written by whichever process forks
    start = triton_target.start_forked

    def counted(work):
        with open(starts, "a") as log:
            log.write(f"{os.getpid()}\n")
        return start(work)

    monkeypatch.setattr(triton_target, "start_forked", counted)
    monkeypatch.setattr(triton_target, "usable_cores", lambda: 1)
    one_after_the_other = _compiled(model, seq=128, policy=policy)
    forks_alone = len(starts.read_text().split())
    starts.unlink()
    monkeypatch.setattr(triton_target, "usable_cores", lambda: 2)
    side_by_side = _compiled(model, seq=128, policy=policy)
    assert len(starts.read_text().split()) > forks_alone       # each planning child forked its forward's
    assert side_by_side.ops and _numbered_alike(side_by_side) == _numbered_alike(one_after_the_other)


def _numbered_alike(graph):
    """`graph` without its autograd node ids, which a process numbers on from one capture to the next."""
    import dataclasses
    return dataclasses.replace(graph, ops=tuple(dataclasses.replace(op, autograd_node=None) for op in graph.ops))


def test_the_other_policies_are_built_while_the_compiled_one_is_planned():
    """capture_steps starts the compiled policy's planning child before it builds the other policies: each
    policy's report equals the one captured alone (the graph's: eager alone would run op by op, whose ops
    are named otherwise)."""
    import tracer
    from tracer.reports.json_report import policy_json
    names = ("eager", "compiled", "selective")
    together = tracer.analyze("gpt2-debug", seq=64, policies=names)
    for name in names:
        alone = tracer.analyze("gpt2-debug", seq=64, policies=(name,), capture="export")
        assert policy_json(together.policies[name], top=10) == policy_json(alone.policies[name], top=10), name


def test_a_planning_child_whose_answer_is_not_wanted_is_stopped_and_reaped():
    import time
    started = triton_target.start_forked(lambda: time.sleep(60))
    began = time.monotonic()
    started.abandon()
    assert time.monotonic() - began < 10
    with pytest.raises(ChildProcessError):
        os.waitpid(started._pid, os.WNOHANG)


def test_a_memory_budget_sweep_plans_one_compiled_policy_at_a_time(monkeypatch):
    """Each budget of a sweep is a compiled policy of its own; their planning processes run one after
    another, not all at once (each holds a copy of the capture and Inductor's state)."""
    import tracer
    running, most = [0], [0]
    start = triton_target.start_forked

    class Counted:
        def __init__(self, forked):
            self.forked = forked
            running[0] += 1
            most[0] = max(most[0], running[0])

        def result(self):
            try:
                return self.forked.result()
            finally:
                running[0] -= 1

        def abandon(self):
            self.forked.abandon()

    from tracer.pipeline import AnalysisOptions, run_analysis
    monkeypatch.setattr(triton_target, "start_forked", lambda work: Counted(start(work)))
    options = AnalysisOptions(seq=32, policies=("eager", "compiled"), memory_budgets=(None, 0.5, 0.0))
    analysis = run_analysis("gpt2-debug", options)
    assert len([name for name in analysis.policies if name.startswith("compiled")]) == 3
    assert most == [1]


def test_a_child_forked_before_a_value_is_made_receives_it_once_it_is_sent():
    handed = triton_target.HandOver()
    child = triton_target.start_forked(lambda: handed.received())
    handed.send({"recorded": [1, 2, 3]})
    assert child.result() == {"recorded": [1, 2, 3]}
    handed.close()


def test_a_child_forked_after_the_value_was_sent_inherits_it_and_none_sent_is_none():
    handed, nothing = triton_target.HandOver(), triton_target.HandOver()
    handed.send(("made", "before"))
    nothing_child = triton_target.start_forked(lambda: nothing.received())
    nothing.send(None)
    assert triton_target.start_forked(lambda: handed.received()).result() == ("made", "before")
    assert nothing_child.result() is None
    handed.close()
    nothing.close()


def test_a_value_that_cannot_travel_is_made_by_the_child_itself():
    handed = triton_target.HandOver()
    child = triton_target.start_forked(lambda: handed.received())
    handed.send(lambda: "not picklable")
    assert child.result() is None
    handed.close()


def test_the_planning_child_splices_the_optimizer_step_the_capturing_process_recorded(monkeypatch, tmp_path):
    """A compiled policy's planning child needs the optimizer step only once its plan is made: the capturing
    process records it meanwhile (here it has no other policy to record it for) and hands it over, and the
    step is the one the child makes when it records the optimizer step itself, to the last field."""
    import tracer.capture as capture
    recorded_in = tmp_path / "recorded_in"     # one line per recording, written by the process that makes it
    record = capture.record_optimizer_step

    def logged(*args, **kwargs):
        with open(recorded_in, "a") as log:
            log.write(f"{os.getpid()}\n")
        return record(*args, **kwargs)

    monkeypatch.setattr(capture, "record_optimizer_step", logged)
    handed_over = _compiled(BIAS_ROWS, seq=64)
    assert recorded_in.read_text().split() == [str(os.getpid())]
    recorded_in.unlink()
    send = triton_target.HandOver.send
    monkeypatch.setattr(triton_target.HandOver, "send", lambda self, value: send(self, None))
    recorded_alone = _compiled(BIAS_ROWS, seq=64)
    recorders = recorded_in.read_text().split()
    assert str(os.getpid()) in recorders and len(recorders) == 2      # its own, then the child's
    assert _numbered_alike(handed_over) == _numbered_alike(recorded_alone)
