"""The package's import graph has no circle: every import between tracer's modules, at module level and
inside functions, read from the source (ast), draws an arrow, and no arrow path returns to where it
started. Importing a package's submodule from inside that package does not count as importing the package
itself (Python has already imported the parent). tracer/capture/meta.py, what every capture stage reads,
imports nothing of tracer."""
from __future__ import annotations

import ast
import os

import tracer

PACKAGE_DIR = os.path.dirname(tracer.__file__)


def _modules() -> dict[str, str]:
    out = {}
    root = os.path.dirname(PACKAGE_DIR)
    for folder, _, files in os.walk(PACKAGE_DIR):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                module = os.path.relpath(path, root)[:-3].replace(os.sep, ".")
                out[module.removesuffix(".__init__")] = path
    return out


def _imported(node, module: str, is_package: bool, modules) -> list[str]:
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        base = node.module or ""
        if node.level:
            parts = (module if is_package else module.rpartition(".")[0]).split(".")
            base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
        names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
    out = []
    for name in names:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        if name and name != module and not module.startswith(name + "."):
            out.append(name)
    return out


def import_graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for module, path in modules.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        is_package = path.endswith("__init__.py")
        graph[module] = {target for node in ast.walk(tree) if isinstance(node, (ast.Import, ast.ImportFrom))
                         for target in _imported(node, module, is_package, modules)}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, on_stack, stack, found = {}, {}, set(), [], []
    counter = 0
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return found


def test_the_package_has_no_import_circle():
    graph = import_graph()
    assert "tracer.capture.convert" in graph and graph["tracer.capture.convert"]       # the reader reads
    found = circles(graph)
    assert not found, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{a} -> {sorted(graph[a] & set(c))}" for a in c) + ")" for c in found)


def test_the_circle_finder_finds_a_circle():
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert circles({"a": {"b"}, "b": set()}) == []


def test_what_the_capture_stages_share_imports_nothing_of_tracer():
    assert import_graph()["tracer.capture.meta"] == set()


# tracer/capture's spine: each stage imports only the stages before it (and itself). A new module of the
# capture takes its place here.
CAPTURE_STAGES = (
    ("what every stage reads", {"meta", "source", "storages", "precision", "process_state", "target", "pylocals",
                                "kernel_scratch"}),
    ("the model input", {"model_input", "loop_declarations", "lightning_loop", "routing", "device_queries",
                         "process_group"}),
    ("building the model on fake tensors", {"build", "lora", "quantized_base", "float8", "trainer_optimizer"}),
    ("tracing the joint graph", {"eager_kernels", "inplace", "forward_leaves", "python_lifetimes", "joint",
                                 "dynamo_joint", "context_parallel"}),
    ("scheduling: policies, Inductor's plans, compiled blocks", {"schedule", "inductor_plan", "compiled_blocks", "triton_target",
                                                                  "triton_buffer_effects",
                                                                  "eager_rerun", "policies"}),
    ("conversion to ops over storages", {"convert", "splice"}),
    ("eager lifetimes", {"formulas", "calls", "eager_checkpoint", "autocast_cache", "caller_held", "activation_offload"}),
    ("the step around it: optimizer, accumulation, offload", {"optimizer", "optimizer_wrappers", "recorder", "compiled_calls", "bnb8bit", "lion",
                                                              "accumulation", "offload"}),
    ("the dispatch front end and the entry point", {"dispatch", ""}),
)


def test_every_capture_stage_imports_only_earlier_stages():
    stage_of = {(f"tracer.capture.{name}" if name else "tracer.capture"): i
                for i, (_, names) in enumerate(CAPTURE_STAGES) for name in names}
    graph = import_graph()
    capture_modules = {m for m in graph if m == "tracer.capture" or m.startswith("tracer.capture.")}
    assert capture_modules == set(stage_of), (
        f"place these in CAPTURE_STAGES: {sorted(capture_modules - set(stage_of))}; "
        f"gone: {sorted(set(stage_of) - capture_modules)}")
    upward = [f"{m} ({CAPTURE_STAGES[stage_of[m]][0]}) -> {t} ({CAPTURE_STAGES[stage_of[t]][0]})"
              for m in capture_modules for t in graph[m] if t in stage_of and stage_of[t] > stage_of[m]]
    assert not upward, "imports of a later stage: " + "; ".join(sorted(upward))
