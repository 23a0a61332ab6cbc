"""Turn a model argument (a zoo name, `hf:<name>`, or a path to a model file) into a `ModelSource`.

A model file defines:
  build_model() -> nn.Module          required; forward returns the scalar loss, a mapping with a "loss"
                                      (dict, transformers' ModelOutput), a tuple holding it (nanoGPT's
                                      (logits, loss)), or (with loss_fn) the output
  example_batch(batch, seq) -> tuple  required for files; the positional args of forward, or a dict of
                                      its keyword args
  loss_index = <int>                  optional; the loss's position in a returned tuple (default: its only
                                      0-dim floating tensor)
  loss_fn(output, target) -> loss     optional; then forward gets example_batch(...)[:-1] and the last
                                      element is the target
  make_optimizer(params) -> Optimizer optional; otherwise --optimizer picks one
  save_policy(ctx, op, *args, **kwargs) optional; --policy selective's policy (torch's selective-checkpointing
      -> CheckpointPolicy | bool      signature), unless --save-policy or --save-ops is given
  extra_resident_bytes, keep_outputs, optional; what the training loop holds besides the model: resident
  keep_alive(outputs), retain_graph   bytes, forward outputs it keeps, backward(retain_graph=True)
                                      (tracer/capture/caller_held.py)
  create_graph = True                 optional; the loop calls loss.backward(create_graph=True), as a
                                      second-order optimizer (SophiaH, AdaHessian) needs: the step is run op
                                      by op (dispatch.py), since the optimizer differentiates the gradients
Outputs besides the loss are taken as dropped when the loss is taken (`loss = model(**batch).loss`).
The file is imported as a fresh module (its top level runs) with `sys.argv` set to just its path, so a
file that parses the command line at import sees no tracer flags; nothing else is executed here.

`running_user_code(name)` wraps every call into the user's code (import here; build, forward, optimizer in
tracer.pipeline): its `print()` output goes to stderr, so the tool's report on stdout stays clean, and a
`sys.exit(...)` or a `KeyboardInterrupt` the code raises itself becomes a `ModelRunError` (the model's
failure, exit 3): it can never end the process with the model's exit code. `sys.exit`, `exit` and `quit`
raise `ModelCalledExit` (an ordinary exception) meanwhile, so every capture path unwinds as for any
error; a bare `raise SystemExit`, a model's own KeyboardInterrupt or any other exception outside
Exception's tree (GeneratorExit, a class of its own) is still caught here and becomes a ModelRunError
naming the line that raised it, but may leave torch tracing state behind in the process (torch's tracing
cleans up after an Exception only; the CLI exits right after). A real Ctrl-C (SIGINT, seen by
a handler installed for the duration when on the main thread) stays a KeyboardInterrupt. Output written
to file descriptor 1 directly (C extensions, os.write) is not redirected.
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import importlib
import importlib.util
import inspect
import os
import re
import signal
import sys
import threading
import traceback
from typing import Callable

from tracer.capture.process_state import process_state_kept
from tracer.errors import ModelInputError, ModelRunError, UsageError
from tracer.models import ZOO, zoo_entry


@dataclasses.dataclass(frozen=True)
class ModelSource:
    name: str                                   # zoo name or file path as given
    path: str | None                            # absolute path of the model file (None for zoo models)
    build_model: Callable
    example_batch: Callable[[int, int], tuple]
    loss_fn: Callable | None = None
    make_optimizer: Callable | None = None
    failure_hint: str | None = None             # what to do when building or running it fails, where the code
                                                # is a library's (hf:), not the user's to fix
    loss_index: int | None = None               # position of the loss in a tuple the forward returns
    save_policy: Callable | None = None         # torch's selective-checkpointing policy_fn, for --policy selective
    notes: tuple[str, ...] = ()                 # assumptions the example batch makes that the model does not state
    keep: Callable | None = None                # outputs -> ((label, tensor), ...) the loop keeps (caller_held.py)
    extra_resident_bytes: int | Callable | None = None   # bytes the loop holds besides the model (or f(batch, seq))
    retain_graph: bool = False                  # the loop calls loss.backward(retain_graph=True)
    create_graph: bool = False                  # the loop calls loss.backward(create_graph=True)


def load_model_source(model: str, *, hf_config: tuple[str, ...] = (), config_json: str | None = None,
                      hf_attn: str = "sdpa", hf_task: str | None = None,
                      model_args: tuple[str, ...] = ()) -> ModelSource:
    """A zoo name, `hf:<name>` (a transformers model built from a config; `hf_task` picks its head, None: the
    architecture's default, see tracer/models/hf.py), a model file path, or a module (`pkg.module`, or
    `pkg.module:factory` whose factory replaces the module's build_model). `model_args` ("KEY=VALUE", the
    value read as a Python literal, else as text) are passed to build_model (or the factory) as keywords."""
    if model_args and (model.startswith("hf:") or model in ZOO):
        raise UsageError(f"--model-arg applies to a model file or module, not to {model}",
                         hint="hf: models take --hf-config KEY=VALUE; a zoo model takes no arguments")
    keywords = parse_model_args(model_args)
    hf_flags = [flag for flag, given in (("--hf-config", hf_config), ("--config-json", config_json),
                                         ("--hf-task", hf_task), ("--hf-attn", hf_attn != "sdpa")) if given]
    if hf_flags and not model.startswith("hf:"):
        raise UsageError(f"{', '.join(hf_flags)} applies to hf:<model_type> models, not to {model}",
                         hint="drop the flag" + (", or pass --model-arg KEY=VALUE to a model file's build_model"
                                                  if "--hf-config" in hf_flags else ""))
    if model.startswith("hf:"):
        from tracer.models.hf import (build_hf_model, hf_batch_notes, hf_example_batch, hf_failure_hint, hf_spec,
                                      parse_overrides)
        spec = hf_spec(model[3:], overrides=parse_overrides(hf_config), config_json=config_json,
                       attn_implementation=hf_attn, task=hf_task)
        return ModelSource(name=model, path=None, build_model=lambda: build_hf_model(spec),
                           example_batch=lambda batch, seq: hf_example_batch(spec, batch, seq),
                           failure_hint=hf_failure_hint(spec), notes=hf_batch_notes(spec))
    if model in ZOO:
        entry = zoo_entry(model)
        return ModelSource(name=model, path=None, build_model=entry.build_model, example_batch=entry.example_batch)
    if model.endswith(".py") or os.sep in model or (os.altsep or os.sep) in model or os.path.isfile(model):
        return _load_file(model, keywords)
    if MODULE_NAME.fullmatch(model):
        return _load_module(model, keywords)
    raise ModelInputError(f"unknown model {model!r}: not a file, not a zoo name and not a module name",
                          hint=f"valid zoo names: {', '.join(sorted(ZOO))}; a module is named pkg.module "
                               "or pkg.module:factory")


# `pkg.module` or `pkg.module:factory`: the module:attribute convention of uvicorn and gunicorn
MODULE_NAME = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*(:[A-Za-z_]\w*)?")


def parse_model_args(model_args: tuple[str, ...]) -> dict:
    """("layers=4", "name=gpt", "dropout=0.1") -> {"layers": 4, "name": "gpt", "dropout": 0.1}: a value that
    reads as a Python literal is that literal, anything else is text. Raises UsageError naming a bad one."""
    keywords = {}
    for text in model_args:
        key, sep, value = text.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise UsageError(f"--model-arg {text!r} is not KEY=VALUE", hint="e.g. --model-arg n_layers=4")
        if key in keywords:
            raise UsageError(f"--model-arg {key} is given twice")
        try:
            keywords[key] = ast.literal_eval(value.strip())
        except (ValueError, SyntaxError, RecursionError, MemoryError):
            keywords[key] = value
    return keywords


def _load_file(path: str, keywords: dict) -> ModelSource:
    abspath = os.path.abspath(path)
    if not os.path.isfile(abspath):
        raise ModelInputError(f"model file not found: {path}", hint="pass a path to a .py file or a zoo name")
    package, root = _package_of(abspath)
    stem = os.path.splitext(os.path.basename(abspath))[0]
    module_name = "_tracer_user_model_" + re.sub(r"\W", "_", stem) if package is None else f"{package}.{stem}"
    if root not in sys.path:
        # the folder above the top package, or the file's own folder: where `python -m pkg.model` and
        # `python model.py` look for the file's imports (pytest's prepend mode does the same)
        sys.path.insert(0, root)
    spec = importlib.util.spec_from_file_location(module_name, abspath)
    module = importlib.util.module_from_spec(spec)
    argv = sys.argv
    try:
        with running_user_code(f"{path} (at import)"):
            sys.argv = [abspath]
            if package is not None:
                importlib.import_module(package)        # its __init__ runs, as it does for `import pkg.model`
            sys.modules[module_name] = module           # a fresh module each load: the file may have changed
            spec.loader.exec_module(module)
    except ModelRunError:
        raise
    except Exception as exc:
        raise ModelRunError(f"{_user_location(exc, abspath)}: importing the model file raised "
                            f"{type(exc).__name__}: {exc}", hint="fix the model file") from exc
    finally:
        sys.argv = argv
    return _module_source(module, path, abspath, None, keywords)


def _package_of(abspath: str) -> tuple[str | None, str]:
    """(the dotted package holding the file, the folder above its top package): a file whose folder has an
    `__init__.py` is imported as part of its package, so its relative imports work. (None, folder) for a
    file outside any package, or in folders whose names are not importable."""
    parts, folder = [], os.path.dirname(abspath)
    while os.path.isfile(os.path.join(folder, "__init__.py")) and os.path.basename(folder).isidentifier():
        parts.insert(0, os.path.basename(folder))
        folder = os.path.dirname(folder)
    return (".".join(parts) or None), folder


def _load_module(name: str, keywords: dict) -> ModelSource:
    """`pkg.module[:factory]`: imported from the installed packages or the current directory."""
    module_name, _, factory = name.partition(":")
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())          # as uvicorn's --app-dir default and `python -m` do
    try:
        with running_user_code(f"{module_name} (at import)"):
            module = importlib.import_module(module_name)
    except ModelRunError:
        raise
    except ModuleNotFoundError as exc:
        if exc.name and module_name.startswith(exc.name) and module_name[len(exc.name):][:1] in ("", "."):
            raise ModelInputError(f"model {name!r}: no module named {exc.name!r}",
                                  hint="name an installed module or one under the current directory, "
                                       "or pass a path to a .py file") from exc
        raise ModelRunError(f"{_user_location(exc, '')}: importing {module_name} raised "
                            f"{type(exc).__name__}: {exc}", hint="fix the module") from exc
    except Exception as exc:
        path = os.path.abspath(getattr(sys.modules.get(module_name), "__file__", None) or module_name)
        raise ModelRunError(f"{_user_location(exc, path)}: importing {module_name} raised "
                            f"{type(exc).__name__}: {exc}", hint="fix the module") from exc
    path = getattr(module, "__file__", None)
    return _module_source(module, name, os.path.abspath(path) if path else None, factory or None, keywords)


def _module_source(module, name: str, abspath: str | None, factory: str | None, keywords: dict) -> ModelSource:
    """The ModelSource of an imported model file or module: its build_model (or `factory`) with the
    `keywords`, example_batch, and the optional names the module docstring lists."""
    build_name = factory or "build_model"
    build = getattr(module, build_name, None)
    if not callable(build):
        raise ModelInputError(f"{name} defines no {build_name}()",
                              hint="define build_model() returning an nn.Module whose forward returns the loss"
                              if factory is None else f"name a function of {module.__name__} that returns an nn.Module")
    batch = getattr(module, "example_batch", None)
    if not callable(batch):
        raise ModelInputError(f"{name} defines no example_batch(batch, seq)",
                              hint="define example_batch(batch, seq) returning the tuple of forward's arguments")
    if keywords:
        _check_keywords(build, keywords, name, build_name)
        build = functools.partial(build, **keywords)
    return ModelSource(name=name, path=abspath, build_model=build, example_batch=batch,
                       loss_fn=getattr(module, "loss_fn", None), make_optimizer=getattr(module, "make_optimizer", None),
                       loss_index=getattr(module, "loss_index", None), save_policy=_save_policy(module, name),
                       **_caller_held(module, name))


def _check_keywords(build: Callable, keywords: dict, name: str, build_name: str) -> None:
    """UsageError when `build` cannot take the --model-arg keywords (its signature, where it has one)."""
    try:
        inspect.signature(build).bind(**keywords)
    except TypeError as exc:
        raise UsageError(f"--model-arg: {name}'s {build_name}() does not take {', '.join(keywords)}: {exc}",
                         hint=f"give {build_name}() keyword parameters for them") from exc
    except ValueError:
        pass                                    # no signature to read (a builtin): the call will say


def _caller_held(module, path: str) -> dict:
    """What the model file declares its training loop holds (tracer/capture/caller_held.py)."""
    from tracer.capture.loop_declarations import keep_function
    extra = getattr(module, "extra_resident_bytes", None)
    if extra is not None and not callable(extra) and (not isinstance(extra, int) or isinstance(extra, bool)
                                                      or extra < 0):
        raise ModelInputError(f"{path}: extra_resident_bytes is {extra!r}",
                              hint="a number of bytes (int >= 0), or a function (batch, seq) -> int")
    flags = {}
    for flag in ("retain_graph", "create_graph"):
        flags[flag] = getattr(module, flag, False)
        if not isinstance(flags[flag], bool):
            raise ModelInputError(f"{path}: {flag} is {flags[flag]!r}", hint=f"{flag} = True or False")
    return {"keep": keep_function(getattr(module, "keep_outputs", None), getattr(module, "keep_alive", None), path),
            "extra_resident_bytes": extra, **flags}


def _save_policy(module, path: str):
    policy = getattr(module, "save_policy", None)
    if policy is not None and not callable(policy):
        raise ModelInputError(f"{path}: save_policy is a {type(policy).__name__}, not a function",
                              hint="define save_policy(ctx, op, *args, **kwargs) returning a CheckpointPolicy or bool")
    return policy


class ModelCalledExit(Exception):
    """What `sys.exit(...)`, `exit()` and `quit()` raise while the user's code runs: an ordinary exception,
    so every capture path unwinds and restores its state as for any error in the model."""

    def __init__(self, code):
        super().__init__(f"the model called sys.exit({code!r})")
        self.code = code


def _exit_as_exception(code=None):
    raise ModelCalledExit(code)


@contextlib.contextmanager
def running_user_code(name: str):
    """Run the user's code of model `name` inside: stdout to stderr; its SystemExit or its own
    KeyboardInterrupt -> ModelRunError. Nests (each level sees the SIGINT through the one inside it)."""
    sigint_seen = []
    installed = False
    if threading.current_thread() is threading.main_thread():
        previous = signal.getsignal(signal.SIGINT)

        def on_sigint(signum, frame):
            sigint_seen.append(signum)
            if callable(previous):
                previous(signum, frame)
            raise KeyboardInterrupt

        if previous is not signal.SIG_IGN and previous is not None:
            signal.signal(signal.SIGINT, on_sigint)
            installed = True
    import builtins
    exits = sys.exit, getattr(builtins, "exit", None), getattr(builtins, "quit", None)
    sys.exit = builtins.exit = builtins.quit = _exit_as_exception
    try:
        with contextlib.redirect_stdout(sys.stderr), process_state_kept():
            yield
    except ModelCalledExit as exc:
        raise ModelRunError(f"{name}: {exc}", hint="a model file must not exit; the step was not analysed") from exc
    except SystemExit as exc:
        raise ModelRunError(f"{name} called sys.exit({exc.code!r}) while being traced",
                            hint="a model file must not exit; the step was not analysed") from exc
    except KeyboardInterrupt as exc:
        if sigint_seen:
            raise
        raise ModelRunError(f"{name} raised KeyboardInterrupt while being traced",
                            hint="the model's own KeyboardInterrupt is its failure; the step was not analysed") from exc
    except Exception:
        raise
    except BaseException as exc:             # GeneratorExit, a model's own BaseException subclass
        raise ModelRunError(f"{_user_location(exc, '')}: the model raised {type(exc).__name__}"
                            + (f": {exc}" if str(exc) else ""),
                            hint="an exception outside Exception's tree is the model's failure; "
                                 "the step was not analysed") from exc
    finally:
        sys.exit, builtins.exit, builtins.quit = exits
        if installed:
            signal.signal(signal.SIGINT, previous)


def _user_location(exc: BaseException, path: str) -> str:
    """'file:line' of the innermost frame of `exc` inside `path`, else the innermost frame at all; a
    SyntaxError's own file and line (its traceback ends in importlib, not in the file)."""
    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{exc.filename}:{exc.lineno}"
    frames = traceback.extract_tb(exc.__traceback__)
    inside = [f for f in frames if os.path.abspath(f.filename) == path]
    frame = (inside or frames or [None])[-1]
    return f"{frame.filename}:{frame.lineno}" if frame else path


def with_gradient_checkpointing(source: ModelSource, *, reentrant: bool) -> ModelSource:
    """`source` whose build calls the model's own `gradient_checkpointing_enable` (transformers' models; on
    an `hf:` model, the wrapped model's), as `Trainer(gradient_checkpointing=True)` does. A model without
    the method is refused: its checkpointing is written in its code, or given by --policy full."""
    build = source.build_model

    def build_checkpointed():
        model = build()
        owner = next((m for m in (model, getattr(model, "model", None))
                      if callable(getattr(m, "gradient_checkpointing_enable", None))), None)
        if owner is None:
            raise UsageError(f"{source.name}: --gradient-checkpointing calls the model's gradient_checkpointing_enable(), "
                             f"which {type(model).__name__} does not define",
                             hint="use --policy full (tracer checkpoints each block), or checkpoint in the model's code")
        owner.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        return model
    return dataclasses.replace(source, build_model=build_checkpointed)
