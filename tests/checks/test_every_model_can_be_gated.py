"""Nothing can be saved that cannot be checked: for every model file the tests have and every zoo model,
`--save-baseline` then `tracer check` on the unchanged model exits 0, and `tracer check` on the same model
with one layer made wider (a wrapper file whose build_model hooks the first layer to compute a wider
tensor that backward keeps) exits 1 and names the wrapper's line. A model the tool refuses saves no
baseline at all.

The check of the unchanged model answers from the session's analyses (`shared_analyses`): it reuses the
saved step only when the options the baseline records replay to exactly the options that made it, which is
the property under test; a replay that differs is analysed afresh and compared like any other."""
import glob
import os
import textwrap

import pytest

from tracer.errors import ExitCode
from tracer.models import ZOO

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL_FILES = sorted(glob.glob(os.path.join(TESTS, "fixtures", "*.py"))
                     + glob.glob(os.path.join(TESTS, "reliability", "models", "*.py")))
STEP = ["--target", "cpu", "--batch", "2", "--seq", "16"]

WIDENED = '''
import importlib.util as _util

import torch
from torch import nn

{load}

_LAYERS = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Embedding, nn.RNNBase)


def build_model(*args, **kwargs):
    model = _build(*args, **kwargs)
    layer = next(m for m in model.modules() if isinstance(m, _LAYERS))
    layer.register_forward_hook(_widened)
    return model


def _widened(module, inputs, output):
    first = output[0] if isinstance(output, tuple) else output
    if not (isinstance(first, torch.Tensor) and first.is_floating_point() and first.requires_grad):
        return None
    wide = torch.sigmoid(first.unsqueeze(0).expand(64, *first.shape))      # WIDENED: 64 copies, kept for backward
    first = first + 0 * wide.mean(0)
    return (first, *output[1:]) if isinstance(output, tuple) else first
'''

LOAD_FILE = '''_spec = _util.spec_from_file_location("_gated_original", {path!r})
_original = _util.module_from_spec(_spec)
_spec.loader.exec_module(_original)
globals().update({{k: v for k, v in vars(_original).items() if not k.startswith("__") and k != "build_model"}})
_build = _original.build_model'''

LOAD_ZOO = '''from tracer.models import zoo_entry as _zoo_entry

_entry = _zoo_entry({name!r})
_build, example_batch = _entry.build_model, _entry.example_batch'''


def widened_line(text: str) -> int:
    return next(i for i, line in enumerate(text.splitlines(), 1) if "# WIDENED" in line)


@pytest.mark.slow
@pytest.mark.parametrize("model", [*MODEL_FILES, *sorted(ZOO)],
                         ids=lambda m: os.path.relpath(m, TESTS) if os.sep in m else m)
def test_a_saved_baseline_passes_unchanged_and_fails_on_a_wider_layer(model, tmp_path, run_cli, shared_analyses):
    baseline = tmp_path / "baseline.json"
    code, _, err = run_cli(model, *STEP, "--save-baseline", baseline)
    if code != ExitCode.OK:                     # refused: then nothing was saved
        assert code in (ExitCode.USAGE, ExitCode.ANALYSIS) and not baseline.exists(), err
        return
    code, out, err = run_cli("check", model, "--baseline", baseline)
    assert code == ExitCode.OK, out + err
    load = LOAD_ZOO.format(name=model) if model in ZOO else LOAD_FILE.format(path=model)
    text = textwrap.dedent(WIDENED.format(load=load))
    widened = tmp_path / "widened.py"
    widened.write_text(text)
    code, out, err = run_cli("check", widened, "--baseline", baseline)
    assert code == ExitCode.BUDGET_EXCEEDED, out + err
    assert f"widened.py:{widened_line(text)}" in out


@pytest.fixture
def run_cli(capsys):
    from tracer.cli import main

    def run(*argv):
        code = main([str(a) for a in argv])
        out, err = capsys.readouterr()
        return code, out, err
    return run
