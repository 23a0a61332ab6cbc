"""benchmarks/wild.py (the corpus sweep) loaded as the module `wild_sweep`, for the tests of its rules and rows."""
import importlib.util
import os
import sys

ROOT = os.path.join(os.path.dirname(__file__), "..")


def wild_sweep():
    if "wild_sweep" in sys.modules:
        return sys.modules["wild_sweep"]
    spec = importlib.util.spec_from_file_location("wild_sweep", os.path.join(ROOT, "benchmarks", "wild.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules["wild_sweep"] = module         # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module
