"""A package an option needs (peft for --lora, torchao for --fp8, bitsandbytes for --base, transformers for
hf: models): when it is missing, the one line asks to install it; when it is installed but its import fails,
the line gives the import's own root cause instead, since asking to install a package that is already
there sends the user the wrong way (a torchvision whose C++ operators do not load breaks transformers'
imports, and so peft's)."""
import sys
import textwrap

import pytest

from conftest import TINY, model
from tracer.errors import ExitCode, UsageError

BROKEN_PEFT = textwrap.dedent("""\
    try:
        raise RuntimeError("operator torchvision::nms does not exist")
    except RuntimeError as exc:
        raise ModuleNotFoundError("Could not import module 'BloomPreTrainedModel'.") from exc
""")


def _one_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture
def broken_peft(tmp_path, monkeypatch):
    """A peft that is installed (its package is on the path) and raises on import, as transformers does
    when a package it imports cannot load."""
    (tmp_path / "peft").mkdir()
    (tmp_path / "peft" / "__init__.py").write_text(BROKEN_PEFT)
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in [name for name in sys.modules if name == "peft" or name.startswith("peft.")]:
        monkeypatch.delitem(sys.modules, name)


def test_an_installed_package_that_fails_to_import_names_the_root_cause(run_cli, broken_peft):
    code, out, err = run_cli(model("tiny"), *TINY, "--lora", "4")
    line = _one_line(err)
    assert code == ExitCode.USAGE and out == ""
    assert "--lora: peft installed, but importing failed: RuntimeError: operator torchvision::nms does not exist" \
        in line
    assert "pip install peft" not in line and "python -c 'import peft'" in line


def test_a_missing_package_asks_to_be_installed(monkeypatch):
    from tracer.capture.lora import apply_lora
    from torch import nn
    monkeypatch.setitem(sys.modules, "peft", None)       # `import peft` raises ImportError; not installed
    with pytest.raises(UsageError) as raised:
        apply_lora(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)), 4)
    assert str(raised.value) == "--lora needs peft (pip install peft)"
