"""tracer: a static memory tracer for one PyTorch training step.

Public API:
    analyze(model, *, batch, seq, precision="fp32", optimizer="adamw", foreach=None, step="steady",
            zero_grad="none", policies=("eager",), memory_budget=None, blocks=None,
            checkpoint_every=1, save_policy=None, save_ops=(), hf_config=(), config_json=None,
            hf_attn="sdpa", hf_task=None, target="cuda", gpu=None, capture="auto", moe_routing="balanced", alloc_conf="",
            cublas_workspace_config=None, device_memory_bytes=None, workers=1) -> Analysis
`model` is a zoo name (see `tracer.models.ZOO`), a path to a model file (docs/guides/model-files.md), or
`hf:<model_type>` (a transformers model built from its config: hf_config, config_json, hf_attn, hf_task); `policies` names any of eager, compiled, selective, full (`analysis.policies[name]`; a
compiled policy with a memory budget is keyed `compiled@<budget>`). The default target is a CUDA step on
the default GPU (h100): each policy then carries `.device` (requested, allocated and reserved peaks);
`target="cpu"` predicts a CPU step. `moe_routing` (balanced, worst or a JSON file of per-expert token counts)
sizes what mixture-of-experts routing decides at run time (tracer/capture/routing.py). Every keyword is a field of `tracer.pipeline.AnalysisOptions`,
except `zero_grad` ("none": set_to_none=True, or "zeros"; spelled as `--zero-grad`), the field zero_grad_set_to_none,
and `workers`: with 2 or more (the CLI passes one per CPU core), a deep model's two cut captures run at once,
the deeper in a forked child (a spawned process where there is no fork), and a model of 8 to 10 blocks is cut
too when a second core is free and no policy is compiled (the answer is the same).
"""
from __future__ import annotations

__version__ = "0.1.0"


def analyze(model, *, memory_budget: float | None = None, workers: int = 1, **options):
    from tracer.pipeline import options_from_keywords, run_analysis

    if "zero_grad_set_to_none" in options:
        import warnings
        warnings.warn("tracer.analyze(zero_grad_set_to_none=...) is deprecated: use zero_grad='none' or 'zeros', "
                      "as --zero-grad", DeprecationWarning, stacklevel=2)
    return run_analysis(model, options_from_keywords(memory_budget=memory_budget, **options), workers=workers)


def _show_analyses_in_notebooks() -> None:
    """In a Jupyter kernel (IPython running when tracer is imported), an Analysis displays itself as the
    report's summary, timeline plot, policy table and top lines (`tracer.reports.html_report.notebook_html`)."""
    import sys
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None and hasattr(ipython, "get_ipython") else None
    if shell is None or not hasattr(shell, "display_formatter"):
        return
    html = shell.display_formatter.formatters.get("text/html")
    if html is not None:
        html.for_type_by_name("tracer.passes.analysis", "Analysis", _notebook_html)


def _notebook_html(analysis) -> str:
    from tracer.reports.html_report import notebook_html
    return notebook_html(analysis)


_show_analyses_in_notebooks()
