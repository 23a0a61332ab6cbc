"""tracer: a static memory tracer for one PyTorch training step.

Public API:
    analyze(model, *, batch, seq, precision="fp32", optimizer="adamw", foreach=True, step="steady",
            zero_grad_set_to_none=True) -> Analysis
`model` is a zoo name (see `tracer.models.ZOO`) or a path to a model file (README, "Model files").
"""
from __future__ import annotations

__version__ = "0.1.0"


def analyze(model: str, *, batch: int = 2, seq: int = 1024, precision: str = "fp32", optimizer: str = "adamw",
            foreach: bool = True, step: str = "steady", zero_grad_set_to_none: bool = True):
    from tracer.capture import CaptureOptions, capture_step, load_model_source
    from tracer.passes.analysis import analyze_graph

    options = CaptureOptions(batch=batch, seq=seq, precision=precision, optimizer=optimizer, foreach=foreach,
                             step=step, zero_grad_set_to_none=zero_grad_set_to_none)
    return analyze_graph(capture_step(load_model_source(model), options))
