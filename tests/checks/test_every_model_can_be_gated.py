"""Nothing can be saved that cannot be checked: every model file the tests have and every zoo model is
loaded by a model file of its own (`gated.py`, which re-exports it); `--save-baseline` then `tracer check`
on it unchanged exits 0, and after one edit of that file that makes a layer wider (its build_model hooks
the first layer to run that has parameters and a float output, to compute from its weight a tensor 64
times the size of the layer's output or input, which backward keeps) `tracer check` exits 1 and names the
edited line. A zoo model's name round-trips too (saved and checked by name;
the debug sizes, whose names load the same way as the full sizes').
A model the tool refuses saves no baseline at all.

The check of an unchanged model answers from the session's analyses (`shared_analyses`): it reuses the
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

_WIDEN = {widen}


def build_model(*args, **kwargs):
    model = _build(*args, **kwargs)
    if _WIDEN:
        state = {{}}
        model.register_forward_pre_hook(lambda module, inputs: state.clear())
        for layer in model.modules():       # the first layer with parameters of its own and a float output
            if any(p.requires_grad for p in layer.parameters(recurse=False)):
                layer.register_forward_hook(lambda module, inputs, output: _widened(module, inputs, output, state))
    return model


def _widened(module, inputs, output, state):
    first = output[0] if isinstance(output, (tuple, list)) else output
    if state or not (isinstance(first, torch.Tensor) and first.is_floating_point() and first.requires_grad):
        return None
    state["widened"] = module
    weight = next(p for p in module.parameters(recurse=False) if p.requires_grad)
    elements = 64 * max(t.numel() for t in (first, *inputs) if isinstance(t, torch.Tensor))
    wide = torch.sigmoid(weight.reshape(-1)[:1].expand(elements))      # WIDENED: 64 times the layer, kept for backward
    first = first + 0 * wide.sum().to(first.dtype)
    return (first, *output[1:]) if isinstance(output, (tuple, list)) else first
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
    load = LOAD_ZOO.format(name=model) if model in ZOO else LOAD_FILE.format(path=model)
    gated, baseline = tmp_path / "gated.py", tmp_path / "baseline.json"
    gated.write_text(textwrap.dedent(WIDENED.format(load=load, widen=False)))
    if outside_exceptions_tree(model):
        code, err = save_in_a_subprocess(gated, baseline)
        assert code == ExitCode.ANALYSIS and not baseline.exists(), err
        return
    code, _, err = run_cli(gated, *STEP, "--save-baseline", baseline)
    if code != ExitCode.OK:                     # refused: then nothing was saved
        assert code in (ExitCode.USAGE, ExitCode.ANALYSIS) and not baseline.exists(), err
        return
    code, out, err = run_cli("check", gated, "--baseline", baseline)
    assert code == ExitCode.OK, out + err
    text = textwrap.dedent(WIDENED.format(load=load, widen=True))
    gated.write_text(text)
    code, out, err = run_cli("check", gated, "--baseline", baseline)
    assert code == ExitCode.BUDGET_EXCEEDED, out + err
    assert f"gated.py:{widened_line(text)}" in out


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(name for name in ZOO if name.endswith("-debug")))
def test_a_zoo_models_name_round_trips_through_a_baseline(name, tmp_path, run_cli, shared_analyses):
    baseline = tmp_path / "baseline.json"
    code, _, err = run_cli(name, *STEP, "--save-baseline", baseline)
    assert code == ExitCode.OK, err
    code, out, err = run_cli("check", name, "--baseline", baseline)
    assert code == ExitCode.OK, out + err


def outside_exceptions_tree(model: str) -> bool:
    """A model file that raises KeyboardInterrupt or another exception outside Exception's tree: it unwinds
    through torch's tracing, which cleans up after an Exception only, so it runs in a process of its own."""
    if model in ZOO:
        return False
    text = open(model).read()
    return any(name in text for name in ("KeyboardInterrupt", "GeneratorExit", "BaseException"))


def save_in_a_subprocess(model, baseline) -> tuple[int, str]:
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "tracer", str(model), *STEP, "--save-baseline", str(baseline)],
                          cwd=os.path.dirname(TESTS), capture_output=True, text=True, timeout=600)
    return proc.returncode, proc.stderr
