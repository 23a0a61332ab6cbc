"""The JSON report's schema, pinned by goldens of `report_json` on the hand-built two-block step
(synthetic.py): a renamed, removed or added field fails here. Every number follows from the synthetic sizes
and tracer's own tables (cuBLAS workspace sizes, allocator rounding); none is torch's.

    report_cuda_fsdp.json   CUDA target (a100) with --shard fsdp on 2 ranks: config, policies, device, per_rank
    report_cpu_offload.json cpu target, optimizer state held in host memory: the host section

Regenerate after an intended change: TRACER_UPDATE_GOLDEN=1 python -m pytest -q tests/reports/test_json_report.py
"""
from __future__ import annotations

import dataclasses
import json

from golden_files import check_golden
from synthetic import two_block_step
from tracer.passes.analysis import analyze_graphs
from tracer.pipeline import AnalysisOptions
from tracer.reports.json_report import SCHEMA_VERSION, report_json
from tracer.stepgraph import StorageRole

VERSIONS = {"tracer_version": "0.0.0-golden", "torch_version": "0.0.0-golden"}


def _report(graph, options: AnalysisOptions) -> dict:
    analysis = analyze_graphs({"eager": graph}, device=options.device_setup(), sharding=options.sharding_setup(),
                              settings=options.settings())
    return report_json(analysis, top=3, versions=VERSIONS)


def _as_text(report: dict) -> str:
    return json.dumps(report, indent=2) + "\n"


def test_cuda_report_with_sharding_matches_its_golden():
    options = AnalysisOptions(batch=2, seq=1, optimizer="sgd", target="cuda", gpu="a100", shard="fsdp", world_size=2)
    report = _report(two_block_step(), options)
    assert report["schema_version"] == SCHEMA_VERSION
    assert {"device", "per_rank"} <= set(report["policies"]["eager"])
    check_golden("report_cuda_fsdp.json", _as_text(report))


def test_host_section_matches_its_golden():
    graph = two_block_step()
    on_host = tuple(dataclasses.replace(s, host=True) if s.role is StorageRole.OPTIMIZER_STATE else s
                    for s in graph.storages)
    options = AnalysisOptions(batch=2, seq=1, optimizer="sgd", target="cpu")
    report = _report(dataclasses.replace(graph, storages=on_host), options)
    eager = report["policies"]["eager"]
    assert "host" in eager and "device" not in eager and "per_rank" not in eager
    assert eager["host"]["resident_bytes"]["optimizer_state"] == 2 * 4 * 4 * 4     # two 4x4 fp32 momenta
    check_golden("report_cpu_offload.json", _as_text(report))


def test_the_report_is_plain_json():
    options = AnalysisOptions(batch=2, seq=1, target="cpu")
    report = _report(two_block_step(), options)
    assert json.loads(_as_text(report)) == report             # no tuples, enums or dataclasses left
