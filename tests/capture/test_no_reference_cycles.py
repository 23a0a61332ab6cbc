"""The capture's code makes no reference cycle that could hold a model's or an optimizer's tensors: a nested
function that calls itself is one (the function and its closure cell), and what it closes over lives until
a garbage collection. The command spaces collections out (tracer.pipeline.space_collections), so a tensor
held so outlives the moment the real step frees it (the CS336 AdamW's replaced moments did, by a whole set
of moments in the optimizer phase: tests/accuracy/test_replaced_optimizer_state.py)."""
import ast
import pathlib

import tracer

CAPTURE = pathlib.Path(tracer.__file__).parent / "capture"

# nested functions that call themselves and close over no tensor: fx nodes, Inductor IR, syntax trees, and
# the autocast kernel's cast, which lives as long as the kernel (its cache is the point)
HOLD_NO_TENSORS = {
    ("inductor_plan.py", "_unnamed_outputs", "walk"),
    ("policies.py", "_tag_regions", "leaves_region"),
    ("pylocals.py", "_statements_by_line", "visit"),
    ("target.py", "_autocast_kernel", "cast"),
}


def _self_calling_nested_functions(path: pathlib.Path):
    tree = ast.parse(path.read_text())
    for outer in ast.walk(tree):
        if not isinstance(outer, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for inner in ast.walk(outer):
            if inner is not outer and isinstance(inner, ast.FunctionDef) and any(
                    isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == inner.name
                    for node in ast.walk(inner)):
                yield path.name, outer.name, inner.name


def test_no_nested_function_of_the_capture_calls_itself():
    found = {hit for path in sorted(CAPTURE.glob("*.py")) for hit in _self_calling_nested_functions(path)}
    assert found <= HOLD_NO_TENSORS, sorted(found - HOLD_NO_TENSORS)


def test_the_check_finds_one(tmp_path):
    path = tmp_path / "probe.py"
    path.write_text("def outer(x):\n    def walk(v):\n        return walk(v)\n    return walk(x)\n")
    assert list(_self_calling_nested_functions(path)) == [("probe.py", "outer", "walk")]
