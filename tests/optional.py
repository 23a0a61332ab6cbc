"""`needs("transformers", ...)`: a skip mark for tests that need optional packages, decided with
importlib.util.find_spec, which imports nothing. pytest.importorskip at module level would import the
package while collecting, so even the fast tier (which deselects those modules) paid for importing
transformers."""
import importlib.util

import pytest


def needs(*packages: str, reason: str) -> pytest.MarkDecorator:
    missing = [name for name in packages if importlib.util.find_spec(name) is None]
    return pytest.mark.skipif(bool(missing), reason=f"{', '.join(missing)} not installed: {reason}")
