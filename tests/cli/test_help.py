"""`--help` of every subcommand: fast, without torch, with every flag's choices read from its registry; an
old spelling still works with a deprecation note."""
import os
import resource
import subprocess
import sys

import pytest

from tracer.cli import SUBCOMMANDS, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# python -m tracer --help takes ~0.25 s of CPU without torch; importing torch alone takes ~1.4 s. CPU time, not
# wall time: the machine may be shared
HELP_CPU_SECONDS = 1.0

_NO_TORCH = """
import sys
from tracer.cli import main
code = main(sys.argv[1:])
assert code == 0, code
heavy = sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules)
print("IMPORTED:" + ",".join(heavy))
"""


def _help_run(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", _NO_TORCH, *argv, "--help"], capture_output=True, text=True,
                          cwd=ROOT)


@pytest.mark.parametrize("subcommand", [(), *((name,) for name in SUBCOMMANDS)], ids=lambda s: s[0] if s else "main")
def test_help_imports_no_torch(subcommand):
    proc = _help_run(*subcommand)
    assert proc.returncode == 0, proc.stderr
    assert "usage: python -m tracer" in proc.stdout
    assert proc.stdout.rstrip().endswith("IMPORTED:"), proc.stdout[-200:]


def _children_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def test_help_is_fast():
    before = _children_cpu_seconds()
    proc = subprocess.run([sys.executable, "-m", "tracer", "--help"], capture_output=True, text=True, cwd=ROOT)
    seconds = _children_cpu_seconds() - before
    assert proc.returncode == 0
    assert seconds < HELP_CPU_SECONDS, f"python -m tracer --help took {seconds:.2f} s of CPU"


def test_choices_come_from_the_registries(capsys, monkeypatch):
    from tracer.choices import GPUS, OPTIMIZERS
    from tracer.models.hf_tasks import TASKS
    from tracer.passes.sharding import STRATEGIES
    from tracer.policies import POLICIES, SAVE_POLICIES

    monkeypatch.setenv("COLUMNS", "10000")                # argparse wraps long lines (at hyphens too)
    assert main(["--help"]) == 0
    text = capsys.readouterr().out
    for names in (POLICIES, OPTIMIZERS, tuple(sorted(GPUS)), tuple(STRATEGIES)):
        assert "{" + ",".join(names) in text
    for name in (*TASKS, *SAVE_POLICIES):
        assert name in text


def test_the_main_help_lists_every_subcommand(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in SUBCOMMANDS:
        assert f"\n  {name} " in out


def test_analyze_is_the_default_subcommand():
    from tracer.cli.analyze import parse_args

    explicit = vars(parse_args(["llama-debug", "--seq", "8"]))
    assert main(["analyze", "--help"]) == 0
    assert explicit["model"] == "llama-debug" and explicit["seq"] == 8


def test_an_old_spelling_works_with_a_note(capsys):
    from tracer.cli.analyze import parse_args

    args = parse_args(["llama-debug", "--snapshot", "out.pickle"])
    assert args.export_snapshot == "out.pickle"
    assert "--snapshot is deprecated, use --export-snapshot" in capsys.readouterr().err
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    assert "--export-snapshot" in help_text and "--snapshot " not in help_text


def test_a_bad_flag_is_exit_2(capsys):
    assert main(["llama-debug", "--policy", "nope"]) == 2
    assert "invalid choice: 'nope'" in capsys.readouterr().err


def test_models_lists_the_zoo(capsys):
    from tracer.models import DEFAULT_MODEL, ZOO

    assert main(["models"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split()[0] for line in lines) == sorted(ZOO)
    assert any(line.startswith(DEFAULT_MODEL + " ") and line.endswith("(default)") for line in lines)
