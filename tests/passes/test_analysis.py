"""The analysis of several policies (tracer/passes/analysis.py): each policy's graph is analysed alone
(`analyze_step`), so an analysis made earlier with the same arguments stands for its policy's."""
from graph_builder import GraphBuilder

from tracer.passes.analysis import analyze_graphs, analyze_step
from tracer.passes.device import DeviceSetup
from tracer.stepgraph import StorageRole


def _graph(activation_bytes: int):
    b = GraphBuilder()
    w = b.storage((4, 4), StorageRole.PARAMETER, preexisting=True)
    x = b.storage(64, StorageRole.INPUT, preexisting=True)
    h = b.storage(activation_bytes)
    loss = b.storage(4)
    b.op("forward", [x, w], [h])
    b.op("forward", [h], [loss])
    b.op("backward", [h, loss], [])
    return b.build(model="two-op")


def test_policies_are_analysed_alone_and_an_earlier_analysis_stands_for_its_policy():
    graphs = {"eager": _graph(256), "full": _graph(1024)}
    device = DeviceSetup("cuda:test")
    together = analyze_graphs(graphs, device)
    for label, graph in graphs.items():
        alone = analyze_step(graph, label, device)
        assert alone.peak_bytes == together.policies[label].peak_bytes
        assert alone.device == together.policies[label].device
    earlier = analyze_step(graphs["full"], "full", device)
    given = analyze_graphs(graphs, device, analysed={"full": earlier})
    assert given.policies["full"] is earlier
    assert given.policies["eager"].peak_bytes == together.policies["eager"].peak_bytes
