"""Command line: `python -m tracer [SUBCOMMAND] ...`, a thin layer: parse, call the library, render.

    main(argv=None) -> int        the exit code (tracer.errors.ExitCode; see tracer.cli.entry)

`SUBCOMMANDS` maps each name to its module (tracer.cli.<module>), which defines `PROG`, `SUMMARY`,
`parse_args(argv) -> Namespace` and `run(args) -> int`. Without a subcommand name the arguments are the
`analyze` command's (`python -m tracer model.py --seq 1024`). Argument groups shared by the subcommands and
every flag's choices come from the registries (tracer.cli.args); `--help` of any subcommand does not import
torch. Library code never sees argparse.

Exit codes: 0 ok, 1 a memory check failed, 2 usage error (bad flags, missing or invalid model file, unknown
zoo name, unwritable output path), 3 analysis error (the model's code raised or exited, export failed, any
unexpected error), 130 interrupted (Ctrl-C).
"""
from __future__ import annotations

import importlib
import os
import sys

SUBCOMMANDS = {name: f"tracer.cli.{name}" for name in ("analyze", "check", "snapshot", "models")}
DEFAULT_SUBCOMMAND = "analyze"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv[:1] and argv[0] in SUBCOMMANDS else DEFAULT_SUBCOMMAND
    command = importlib.import_module(SUBCOMMANDS[name])
    try:
        args = command.parse_args(argv)
    except SystemExit as exc:                   # --help (0) or a bad flag (2, argparse printed why)
        return int(exc.code or 0)
    from tracer.cli.entry import run_entry_point
    return run_entry_point(lambda: command.run(args), prog="tracer" if name == DEFAULT_SUBCOMMAND else f"tracer {name}",
                           verbose=args.verbose)


def console_main() -> None:
    """`python -m tracer` and the `tracer` script: run `main`, then end the process with its exit code,
    without the interpreter's final collection (`tracer.pipeline.end_without_collecting`). A thread the
    model's code started and left running (not a daemon) would keep the interpreter alive after the
    report; the process then ends without waiting for it, its output flushed first."""
    code = main()
    from tracer.pipeline import end_without_collecting
    end_without_collecting()
    import threading
    if any(t.is_alive() and not t.daemon for t in threading.enumerate() if t is not threading.main_thread()):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)
    sys.exit(code)


def epilog() -> str:
    """The main --help's last lines: the subcommands (from SUBCOMMANDS) and the exit codes."""
    width = max(len(name) for name in SUBCOMMANDS)
    lines = [f"  {name:<{width}}  {importlib.import_module(module).SUMMARY}" for name, module in SUBCOMMANDS.items()]
    return ("subcommands (python -m tracer SUBCOMMAND --help):\n" + "\n".join(lines) + "\n"
            "exit codes: 0 ok, 1 memory check failed, 2 usage error (flags, model file, zoo name, output path),\n"
            "            3 analysis error (the model raised or exited, or an unexpected error), 130 interrupted")


def build_parser():
    """The analyze command's parser (the default command)."""
    from tracer.cli.analyze import build_parser as analyze_parser
    return analyze_parser(epilog())


def analysis_options(args):
    """The analyze command's flags -> tracer.pipeline.AnalysisOptions."""
    from tracer.cli.analyze import analysis_options as options
    return options(args)
