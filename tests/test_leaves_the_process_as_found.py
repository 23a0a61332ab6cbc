"""tracer runs inside other people's processes (a notebook, the pytest marker in a user's test session):
every command's pipeline leaves the process's global torch and Python state as it found it, even when the
model file itself seeds the RNG, changes the default dtype or sets a torch config at import."""
import gc
import os
import random
import sys

import pytest
import torch
import torch._dynamo.config  # noqa: F401  imported before, so their entries are compared
import torch._functorch.config  # noqa: F401
import torch._inductor.config  # noqa: F401
from torch.utils._config_module import ConfigModule

import tracer
from tracer.checks.plugin import check_budget_marker
from tracer.cli import main

# a model file that changes global state at import and while it builds, as real training scripts do
MESSY_MODEL = '''
import random
import torch
import torch.nn as nn

torch.manual_seed(1234)
random.seed(99)
torch._dynamo.config.cache_size_limit = 3
torch.set_float32_matmul_precision("medium")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.fc = nn.Linear(32, 64)

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.fc(self.emb(x)).flatten(0, 1), y.flatten())


def build_model():
    torch.manual_seed(0)
    torch.set_num_threads(1)
    return Net()


def example_batch(batch, seq):
    return torch.randint(0, 64, (batch, seq)), torch.randint(0, 64, (batch, seq))
'''


def process_state() -> dict:
    """What a user's later seeded run depends on, and every torch config entry with its visibility."""
    state = {"torch rng": torch.get_rng_state().tolist(), "python random": random.getstate(),
             "default dtype": torch.get_default_dtype(), "grad mode": torch.is_grad_enabled(),
             "threads": torch.get_num_threads(), "matmul precision": torch.get_float32_matmul_precision(),
             "deterministic": torch.are_deterministic_algorithms_enabled(), "anomaly": torch.is_anomaly_enabled(),
             "excepthook": sys.excepthook, "process group": torch.distributed.is_initialized(),
             "sdpa": torch.nn.functional.scaled_dot_product_attention, "dtensor handlers": _dtensor_handlers(),
             "garbage collector thresholds": gc.get_threshold()}
    for name, module in list(sys.modules.items()):
        if isinstance(module, ConfigModule):
            values = module.get_config_copy()
            state[name] = {key: (entry.hide, values.get(key)) for key, entry in module._config.items()}
    return state


def _dtensor_handlers() -> dict:
    """DTensor's op handlers and torch's context-parallel options, which `--cp` changes while it runs."""
    import dataclasses
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    return {**DTensor._op_dispatcher._custom_op_handlers, "options": dataclasses.astuple(cp._cp_options),
            "dispatch mode": cp._dispatch_mode}


def differences(before: dict, after: dict) -> list[str]:
    found = []
    for key, value in before.items():
        if isinstance(value, dict):
            found += [f"{key}.{entry}" for entry in value if after[key].get(entry) != value[entry]]
        elif after[key] != value:
            found.append(key)
    return found


@pytest.fixture
def messy_model(tmp_path):
    path = tmp_path / "messy_model.py"
    path.write_text(MESSY_MODEL)
    return str(path)


def run_cli(argv):
    """The CLI's exit code (its report goes to stdout: not read here)."""
    return main(argv)


EXPERT_PARALLEL = os.path.join(os.path.dirname(__file__), "fixtures", "expert_parallel_moe.py")
CONTEXT_PARALLEL = os.path.join(os.path.dirname(__file__), "fixtures", "context_parallel_lm.py")

COMMANDS = {
    "tracer.analyze, every policy": lambda model, tmp: tracer.analyze(
        model, seq=16, batch=2, policies=("eager", "compiled", "selective", "full")),
    "the report command": lambda model, tmp: run_cli([model, "--seq", "16", "--quiet"]),
    "--fit": lambda model, tmp: run_cli([model, "--seq", "16", "--fit", "1GiB", "--quiet"]),
    "save a baseline, then tracer check": lambda model, tmp: (
        run_cli([model, "--seq", "16", "--save-baseline", str(tmp / "b.json"), "--quiet"]),
        run_cli(["check", model, "--baseline", str(tmp / "b.json")])),
    "--ep on a model that splits its experts over the ranks": lambda model, tmp: run_cli(
        [EXPERT_PARALLEL, "--seq", "16", "--ep", "2", "--quiet"]),
    "--cp, attention ringed over the ranks": lambda model, tmp: run_cli(
        [CONTEXT_PARALLEL, "--seq", "16", "--cp", "2", "--quiet"]),
    "the memory_budget marker": lambda model, tmp: check_budget_marker(
        (), dict(model=os.path.basename(model), peak="1GiB", seq=16), test_dir=os.path.dirname(model)),
}


@pytest.mark.parametrize("command", COMMANDS)
def test_every_command_leaves_torch_and_python_state_as_it_found_it(command, messy_model, tmp_path, capsys):
    torch.manual_seed(7)
    random.seed(7)
    before = process_state()
    COMMANDS[command](messy_model, tmp_path)
    assert differences(before, process_state()) == []


def test_a_seeded_run_after_an_analysis_draws_what_it_would_have_drawn(messy_model):
    torch.manual_seed(3)
    expected = torch.rand(4)
    torch.manual_seed(3)
    tracer.analyze("llama-debug", seq=64, batch=2)
    assert torch.equal(torch.rand(4), expected)
