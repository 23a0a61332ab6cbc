"""tracer: a static memory tracer for one PyTorch training step.

Public API:
    analyze(model, *, batch, seq, precision="fp32", optimizer="adamw", foreach=True, step="steady",
            zero_grad_set_to_none=True, policies=("eager",), memory_budget=None, blocks=None,
            checkpoint_every=1, save_policy="matmul-attention", save_ops=(), hf_config=(), config_json=None,
            hf_attn="sdpa", hf_task=None, target="cpu", capture="auto") -> Analysis
`model` is a zoo name (see `tracer.models.ZOO`), a path to a model file (README, "Model files"), or
`hf:<model_type>` (a transformers model built from its config: hf_config, config_json, hf_attn, hf_task);
`policies` names any of eager, compiled, selective, full (`analysis.policies[name]`; a compiled policy
with a memory budget is keyed `compiled@<budget>`).
"""
from __future__ import annotations

__version__ = "0.1.0"


def analyze(model: str, *, batch: int = 2, seq: int = 1024, precision: str = "fp32", optimizer: str = "adamw",
            foreach: bool = True, step: str = "steady", zero_grad_set_to_none: bool = True,
            policies: tuple[str, ...] = ("eager",), memory_budget: float | None = None, blocks: str | None = None,
            checkpoint_every: int = 1, save_policy: str = "matmul-attention", save_ops: tuple[str, ...] = (),
            hf_config: tuple[str, ...] = (), config_json: str | None = None, hf_attn: str = "sdpa",
            hf_task: str | None = None, target: str = "cpu", capture: str = "auto"):
    from tracer.capture import CaptureOptions, capture_steps, load_model_source
    from tracer.errors import UsageError
    from tracer.passes.analysis import analyze_graphs
    from tracer.policies import POLICIES, PolicySpec, save_predicate

    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise UsageError(f"unknown policy {unknown[0]!r}", hint=f"valid: {', '.join(POLICIES)}")
    specs = tuple(PolicySpec(name=name, memory_budget=memory_budget if name == "compiled" else None, blocks=blocks,
                             checkpoint_every=checkpoint_every, save=save_policy, save_ops=tuple(save_ops))
                  for name in policies)
    for spec in specs:
        save_predicate(spec)
    options = CaptureOptions(batch=batch, seq=seq, precision=precision, optimizer=optimizer, foreach=foreach,
                             step=step, zero_grad_set_to_none=zero_grad_set_to_none, target=target, capture=capture)
    source = load_model_source(model, hf_config=tuple(hf_config), config_json=config_json, hf_attn=hf_attn,
                               hf_task=hf_task)
    return analyze_graphs(capture_steps(source, options, specs))
