"""tracer/capture/TORCH_INTERNALS.md lists every private torch module capture imports: a torch upgrade
breaks there first, so the list must be complete."""
import os
import re

CAPTURE = os.path.join(os.path.dirname(__file__), "..", "..", "tracer", "capture")
PRIVATE_IMPORT = re.compile(r"(?:from|import)\s+(torch(?:\.[A-Za-z_]+)*\._[A-Za-z_]+(?:\.[A-Za-z_]+)*)")


def _private_modules_imported() -> set[str]:
    found = set()
    for name in os.listdir(CAPTURE):
        if name.endswith(".py"):
            with open(os.path.join(CAPTURE, name), encoding="utf-8") as f:
                found.update(PRIVATE_IMPORT.findall(f.read()))
    return found


def test_every_private_torch_module_capture_imports_is_in_the_inventory():
    with open(os.path.join(CAPTURE, "TORCH_INTERNALS.md"), encoding="utf-8") as f:
        inventory = f.read()
    imported = _private_modules_imported()
    assert "torch._subclasses.fake_tensor" in imported          # the scan finds imports at all
    listed = set(re.findall(r"`(torch[\w.]+)`", inventory))
    # `from torch._inductor import config` imports torch._inductor: a listed submodule of it names it
    missing = sorted(m for m in imported if not any(entry == m or entry.startswith(m + ".") for entry in listed))
    assert not missing, f"private torch modules missing from TORCH_INTERNALS.md: {missing}"
