"""capture_step_requests: the steps of several settings from one joint capture (the levers' groups)."""
import dataclasses

import tracer.capture as capture
from tracer.capture import CaptureOptions, capture_step, capture_step_requests, load_model_source
from tracer.policies import PolicySpec

PLAIN = CaptureOptions(batch=2, seq=32)


def test_settings_around_the_optimizer_step_share_its_recording_and_equal_their_own_captures(monkeypatch):
    """Accumulation and offloading change what surrounds the optimizer step, not the step: asked for beside
    the plain step, they splice the one recording, and each step graph is the one its own capture makes.
    Another optimizer is a recording of its own."""
    source = load_model_source("llama-debug")
    settings = (PLAIN, dataclasses.replace(PLAIN, accumulate=2), dataclasses.replace(PLAIN, offload="optimizer"),
                dataclasses.replace(PLAIN, optimizer="adafactor"))
    alone = tuple(capture_step(source, options) for options in settings)
    recorded = []
    honest = capture.record_optimizer_step

    def counted(*args, **kwargs):
        recorded.append(kwargs["optimizer_name"])
        return honest(*args, **kwargs)

    monkeypatch.setattr(capture, "record_optimizer_step", counted)
    together = capture_step_requests(source, tuple((options, PolicySpec(name="eager")) for options in settings))
    assert recorded == ["adamw", "adafactor"]
    assert tuple(map(_numbered_nodes, together[:3])) == tuple(map(_numbered_nodes, alone[:3]))


def _numbered_nodes(graph):
    """`graph` with its autograd node ids numbered in order of appearance (each capture draws fresh ones)."""
    number: dict = {}
    ops = tuple(op if op.autograd_node is None else
                dataclasses.replace(op, autograd_node=number.setdefault(op.autograd_node, len(number)))
                for op in graph.ops)
    return dataclasses.replace(graph, ops=ops)
