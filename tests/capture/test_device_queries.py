"""The capture runs on the CPU whatever the target: lines of the model's own code that ask about the device
(tracer/capture/device_queries.py) are named in a note for a CUDA target, with the answer they got."""
import os

import torch

from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
from tracer.capture.device_queries import device_queries_observed

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures",
                       "device_branches.py")


def _notes(target):
    graphs = capture_steps(load_model_source(FIXTURE), CaptureOptions(batch=2, seq=8, target=target),
                           (PolicySpec(name="eager"),))
    return [n for n in graphs["eager"].config.notes if n.startswith("the model's code asked about the device")]


def test_a_cuda_target_names_the_lines_that_branch_on_the_device():
    (note,) = _notes("cuda:h100")
    assert "device_branches.py:11 (tensor.is_cuda answered False)" in note
    assert "device_branches.py:23 (torch.cuda.is_available() answered False)" in note


def test_a_cpu_target_gets_the_answers_it_runs_with():
    assert _notes("cpu") == []


def test_torch_is_as_it_was_after_the_capture():
    """Calls from files outside torch and installed libraries are recorded (this test's two), and the queries
    are torch's own again after."""
    original = torch.cuda.is_available
    with device_queries_observed() as asked:
        assert torch.zeros(1).is_cuda is False
        assert torch.cuda.is_available() is False           # one line, one entry
    assert sorted(what for what in asked.values()) == ["tensor.is_cuda answered False",
                                                       "torch.cuda.is_available() answered False"]
    assert torch.cuda.is_available is original and "is_cuda" not in torch.Tensor.__dict__
    assert torch.zeros(1).is_cuda is False
