"""Progress lines on stderr: on a terminal or with --progress, never with --quiet, never on stdout; they
follow the capture's stages (which capture path is tried) and every analysis of --fit and --by-depth."""
import io
import os

import pytest

import tracer.planning
from graph_builder import GraphBuilder
from tracer.cli import main
from tracer.cli.analyze import parse_args
from tracer.cli.progress import Progress
from tracer.passes.analysis import analyze_graph
from tracer.stepgraph import StorageRole

MLP_LM = os.path.join(os.path.dirname(__file__), "..", "fixtures", "mlp_lm.py")


class _Stderr(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("flags, tty, shown", [
    ([], True, True), ([], False, False), (["--progress"], False, True),
    (["--quiet"], True, False), (["--quiet", "--progress"], True, False),
])
def test_progress_is_shown_on_a_terminal_or_when_asked(monkeypatch, flags, tty, shown):
    stderr = _Stderr(tty)
    monkeypatch.setattr("sys.stderr", stderr)
    progress = Progress.from_args(parse_args(["llama-debug", *flags]))
    progress("capturing ...")
    assert ("capturing ..." in stderr.getvalue()) == shown


def test_the_capture_stages_are_reported(capsys):
    """On the two-block MLP of tests/fixtures (a quarter of llama-debug's capture time): a full capture
    goes through the same stages for every model: the eager-only command runs the step op by op, a capture
    of the graph traces it and simulates each policy."""
    assert main([MLP_LM, "--seq", "8", "--target", "cpu", "--progress"]) == 0
    out, err = capsys.readouterr()
    lines = [line.split("] ", 1)[1] for line in err.splitlines()]
    assert lines == [f"capturing {MLP_LM} (batch 2, seq 8) under fake tensors ...",
                     "running the step op by op on fake tensors ...", "analysing ...", "done"]
    assert "] " not in out.splitlines()[0] and "peak:" in out
    assert main([MLP_LM, "--seq", "8", "--target", "cpu", "--progress", "--capture", "export"]) == 0
    out, err = capsys.readouterr()
    lines = [line.split("] ", 1)[1] for line in err.splitlines()]
    assert lines == [f"capturing {MLP_LM} (batch 2, seq 8) under fake tensors ...",
                     "tracing the joint graph from the module ...", "simulating eager ...", "analysing ...", "done"]


def _linear_step(batch: int, seq: int):
    """A parameter of 1,024 B and an activation of 256 B per example: the peak is 1,024 + 256 x batch."""
    b = GraphBuilder()
    w = b.storage(1024, StorageRole.PARAMETER, preexisting=True, persistent=True)
    a = b.storage(256 * batch)
    b.op("forward", [w], [a])
    b.op("backward", [a], [])
    return b.build(batch=batch, seq=seq)


def test_every_fit_analysis_is_reported(monkeypatch):
    def analyze(model, *, batch, seq, policies, **options):
        return analyze_graph(_linear_step(batch, seq))

    monkeypatch.setattr(tracer.planning, "analyze_model", analyze)
    said = []
    report = tracer.planning.fit_budget("linear", 1024 + 256 * 7, seq=1, policies=("eager",), on_progress=said.append)
    assert report.results["eager"].largest == 7
    assert len(said) == report.analyses_run
    assert said[0] == f"fit: analysis 1 at batch {report.sample_sizes[0]} (eager) ..."
