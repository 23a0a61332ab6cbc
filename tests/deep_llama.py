"""tests/fixtures/llama12_debug.py at another depth: the deep models the depth synthesis is checked on."""
import os

LLAMA12 = os.path.join(os.path.dirname(__file__), "fixtures", "llama12_debug.py")


def deep_llama(directory, layers: int) -> str:
    """A copy of llama12_debug.py in `directory` with `layers` blocks; its path."""
    text = open(LLAMA12).read()
    assert text.count("n_layers=12") == 1, "llama12_debug.py's config line changed"
    path = directory / f"llama{layers}_debug.py"
    path.write_text(text.replace("n_layers=12", f"n_layers={layers}"))
    return str(path)
