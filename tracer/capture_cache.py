"""A content-addressed cache of captured steps: the StepGraphs of one capture, keyed by everything that can
change them, so a second run of the same command (or `tracer check` on an unchanged model) skips the
capture and gives the same report byte for byte.

The key is a SHA-256 of:
  * tracer's own source (every file of the package) and the Python version;
  * every installed distribution's name and version (torch, transformers, triton, ...);
  * the model: a model file's text and that of every module it imported from outside the installed
    packages and the standard library (a sibling `layers.py`), or a module name / zoo name / `hf:` name
    (their code is in tracer or in an installed distribution, already in the key);
  * the analysis options (all of them: a flag that does not change the capture misses too, never hits
    wrongly), the intra-op thread count (it sizes CPU attention scratch), the working directory (lines
    are named relative to it) and the TRACER_/TORCH/CUDA environment variables;
  * whether Inductor's Triton plan can be made here (triton_target.triton_unavailable).

Entries are pickles under `$TRACER_CACHE_DIR` (default `~/.cache/tracer/steps`), written to a temporary
name and renamed, so a concurrent run never reads half an entry; an entry that cannot be read, or whose
stored key differs from the one asked for, is ignored and removed (a miss), never trusted. `--no-cache`
(or `TRACER_NO_CACHE=1`) bypasses it; the test suite runs with it off. Not cached: captures of a
`ModelSource` given as an object (no text to key it by).
"""
from __future__ import annotations

import hashlib
import os
import pickle
import sys

FORMAT = 1                       # bumped when the entry layout changes


def cache_enabled() -> bool:
    return os.environ.get("TRACER_NO_CACHE", "") in ("", "0")


def cache_dir() -> str:
    root = os.environ.get("TRACER_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tracer")
    return os.path.join(root, "steps")


def step_key(model: str, source_path: str | None, options_plain: dict) -> str:
    """The key of a capture of `model` (its name as given, its file when it is one) with these options."""
    import torch

    from tracer.capture.triton_target import triton_unavailable

    digest = hashlib.sha256()

    def add(label: str, value) -> None:
        digest.update(f"{label}\0{value}\0".encode("utf-8", "surrogatepass"))

    add("format", FORMAT)
    add("python", sys.version)
    add("tracer", _package_digest())
    add("distributions", _distributions())
    add("model", model)
    if source_path is not None:
        for path in [source_path, *_user_modules(exclude=source_path)]:
            add("file", path)
            add("text", _file_digest(path))
    add("options", repr(sorted(options_plain.items())))
    add("threads", torch.get_num_threads())
    add("cwd", os.getcwd())                             # reports name model lines relative to it
    add("environment", repr(sorted((k, v) for k, v in os.environ.items()
                                   if k.startswith(("TRACER_", "TORCH", "CUDA", "CUBLAS", "PYTORCH"))
                                   and k not in ("TRACER_CACHE_DIR", "TRACER_NO_CACHE"))))
    add("triton", triton_unavailable())
    return digest.hexdigest()


def load(key: str):
    """The cached value of `key`, or None (a miss: no entry, or one that cannot be trusted, removed)."""
    path = os.path.join(cache_dir(), f"{key}.pkl")
    try:
        with open(path, "rb") as f:
            stored_key, fmt, value = pickle.load(f)
    except FileNotFoundError:
        return None
    except Exception:                                   # noqa: BLE001 - a corrupt entry is a miss
        _remove(path)
        return None
    if stored_key != key or fmt != FORMAT:
        _remove(path)
        return None
    return value


def store(key: str, value) -> None:
    """Writes the entry atomically; a cache that cannot be written is skipped (the run is unaffected)."""
    directory = cache_dir()
    path = os.path.join(directory, f"{key}.pkl")
    partial = f"{path}.{os.getpid()}.partial"
    try:
        os.makedirs(directory, exist_ok=True)
        with open(partial, "wb") as f:
            pickle.dump((key, FORMAT, value), f, protocol=pickle.HIGHEST_PROTOCOL)
        os.replace(partial, path)
    except OSError:
        _remove(partial)


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass


_PACKAGE_DIGEST: list = []


def _package_digest() -> str:
    """SHA-256 over tracer's source files (paths and contents), once per process."""
    if not _PACKAGE_DIGEST:
        root = os.path.dirname(os.path.abspath(__file__))
        digest = hashlib.sha256()
        for folder, dirs, files in sorted(os.walk(root)):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".md", ".json", ".txt")):
                    path = os.path.join(folder, name)
                    digest.update(os.path.relpath(path, root).encode())
                    digest.update(_file_digest(path).encode())
        _PACKAGE_DIGEST.append(digest.hexdigest())
    return _PACKAGE_DIGEST[0]


def _distributions() -> str:
    from importlib.metadata import distributions
    return repr(sorted({(d.metadata["Name"] or "").lower(): d.version for d in distributions()}.items()))


def _file_digest(path: str) -> str:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return "unreadable"


def _user_modules(exclude: str) -> list[str]:
    """Files of imported modules that are neither tracer's, the standard library's nor an installed
    distribution's: the model file's own imports."""
    import sysconfig
    installed = {os.path.realpath(p) for p in {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib",
                                                                                 "purelib", "platlib")}}
    installed |= {os.path.realpath(sys.prefix), os.path.realpath(sys.base_prefix)}
    tracer_root = os.path.realpath(os.path.dirname(os.path.abspath(__file__)))
    out = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if not path or not path.endswith(".py"):
            continue
        real = os.path.realpath(path)
        if real == os.path.realpath(exclude) or real.startswith(tracer_root + os.sep):
            continue
        if any(real.startswith(root + os.sep) for root in installed):
            continue
        out.add(real)
    return sorted(out)
