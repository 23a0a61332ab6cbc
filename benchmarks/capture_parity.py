"""Benchmark: the eager report of the joint graph against another capture path's, model by model: which
numbers differ, and each path's time.

    python benchmarks/capture_parity.py [models ...] [--seq 64] [--batch 2] [--show 4] [--paths export,auto]

Without models: every model file in tests/fixtures. Each model is analysed twice by the CLI, both at once
(eager only, the default target, `--no-cache`), once per `--capture` path of `--paths` (default
`export,auto`: the joint graph against the default command, which runs the step op by op where that run
vouches for the graph's numbers and captures the graph elsewhere; `export,dispatch` holds the op-by-op run
itself against the graph everywhere), and the two `--json` reports are compared field by field, leaving
out what names the path rather than the step: the capture's notes and label, and the peak op's name (the
graph names an op by its node, the op-by-op run by its phase and index). Each line says which path the
second one took. The seconds are each process's, started side by side. A model either path refuses is
listed with the error. The summary counts the models whose reports differ in a number: with the default
`--paths` it must be 0 (the eager-only command's numbers are the graph's wherever it runs op by op).
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import time

SKIPPED_KEYS = ("notes", "capture_notes", "capture", "capture_path", "versions")


def _plain(report: dict):
    def walk(value):
        if isinstance(value, dict):
            return {k: walk(v) for k, v in value.items() if k not in SKIPPED_KEYS}
        if isinstance(value, list):
            return [walk(v) for v in value]
        return value
    return walk(json.loads(json.dumps(report, default=str)))


def differences(a, b, path: str = "") -> list[str]:
    """Each field where the two reports differ, as "path: a vs b" (the peak op's name left out)."""
    if path.endswith(".peak_op.name"):
        return []
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b)):
            if key not in a or key not in b:
                out.append(f"{path}.{key}: only in the {'graph' if key in a else 'op-by-op'} report")
            else:
                out += differences(a[key], b[key], f"{path}.{key}")
        return out
    if isinstance(a, list) and isinstance(b, list):
        out = [f"{path}: {len(a)} entries against {len(b)}"] if len(a) != len(b) else []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [f"{path}: {str(a)[:60]} against {str(b)[:60]}"]


def compare(model: str, batch: int, seq: int, paths=("export", "auto")) -> tuple[list[str] | str, float, float, str]:
    """(the differing fields, or the error of the path that refused it; each path's seconds as a process; the
    capture path the second report names).
    Each path runs as the CLI (`python -m tracer ... --json`), both at once: a line is attributed as a
    user's command sees it (called from a script of one's own, the autograd engine's ops would be
    attributed to that script's line by the op-by-op run)."""
    import subprocess
    import sys
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    def run(capture: str, folder: str):
        out = os.path.join(folder, f"{capture}.json")
        command = [sys.executable, "-m", "tracer", model, "--batch", str(batch), "--seq", str(seq), "--capture",
                   capture, "--json", out, "--no-cache"]
        start = time.perf_counter()
        proc = subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        if proc.returncode != 0:
            return f"{capture}: exit {proc.returncode}: {lines[-1][:100] if lines else ''}", "", \
                time.perf_counter() - start
        raw = json.loads(pathlib.Path(out).read_text())
        return _plain(raw), _capture_path(raw), time.perf_counter() - start

    with tempfile.TemporaryDirectory() as folder, ThreadPoolExecutor(2) as threads:
        done = [threads.submit(run, capture, folder) for capture in paths]
        (graph, _, graph_s), (other, other_path, other_s) = (future.result() for future in done)
    if isinstance(graph, str) or isinstance(other, str):
        return next(r for r in (graph, other) if isinstance(r, str)), graph_s, other_s, other_path
    return differences(graph, other), graph_s, other_s, other_path


def _capture_path(report: dict) -> str:
    """The capture path a --json report names (its eager policy's)."""
    found = []

    def walk(value):
        if isinstance(value, dict):
            if isinstance(value.get("capture_path"), str):
                found.append(value["capture_path"])
            for v in value.values():
                walk(v)
        elif isinstance(value, list):
            for v in value:
                walk(v)
    walk(report)
    return found[0] if found else "?"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("models", nargs="*")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--show", type=int, default=4, help="differing fields printed per model")
    p.add_argument("--paths", default="export,auto", help="the two --capture paths compared (default export,auto)")
    args = p.parse_args()
    paths = tuple(args.paths.split(","))
    fixtures = pathlib.Path(__file__).resolve().parent.parent / "tests" / "fixtures"
    models = args.models or sorted(str(f) for f in fixtures.glob("*.py"))
    differing = refused = 0
    for model in models:
        found, graph_s, other_s, other_path = compare(model, args.batch, args.seq, paths)
        name = pathlib.Path(model).name if model.endswith(".py") else model
        if isinstance(found, str):
            refused += 1
            print(f"{name}: refused ({found})", flush=True)
            continue
        differing += bool(found)
        verdict = f"{len(found)} fields differ" if found else "the same numbers"
        print(f"{name}: {verdict} ({paths[0]} {graph_s:.1f} s, {paths[1]} {other_s:.1f} s, which took "
              f"{other_path})", flush=True)
        for line in found[:args.show]:
            print(f"    {line}", flush=True)
    print(f"{differing} of {len(models) - refused} models differ in a number; {refused} refused by a path")


if __name__ == "__main__":
    main()
