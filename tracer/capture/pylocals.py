"""Python locals in forward: a tensor bound by `name = ...` stays alive until the name is rebound or the
function returns, even after its last use by an op. The joint graph alone frees it at last use.

From each forward op's user stack (outer -> inner frames, kept whole by the capture) this finds:
  * frame invocations: per depth and per invocation and statement execution of every outer frame, a run
    of ops with the same outer call chain and the same function (two functions of one name in one file,
    the `forward`s of two modules, are two), whose line numbers never go back except inside one loop of
    that function's source (a smaller line outside a loop starts a new call, e.g. the next block of a
    loop in the caller);
  * statement runs: consecutive ops of one invocation on one source statement, in execution order (a
    statement in a loop runs once per iteration; when the loop's body runs no other op, as in
    `for layer in self.layers: h = layer(h)`, a new call of the function it called starts the next
    execution); the value a run binds is the output of its last op;
  * for a statement `name = <expr>` (one plain name; read from the file's AST), the op after which the
    name lets go: the end of the next statement run that assigns or deletes `name` (the same statement
    again in the next loop iteration included), else the last op of the invocation;
  * for `name = f(x)` whose value is f's call: what f returned, followed through f's statements that run
    no op (`outputs = (h,)`, `before = h`, `h = layer_outputs[0]`, `return outputs, height, width`) to the
    values its op-running statements bound, or passed on from the function f's `return` calls; statements
    under an `if` and slices of tuples (`outputs[1:]`) are not followed (they may not run or be empty);
  * for a statement `name.append(<expr>)` (also extend, insert: a local list collecting tensors, e.g.
    one output per step of a recurrent scan), the value is held until `name` lets go the same way;
  * for a statement `a, b, c = <expr>` (plain names) computed in its own function, the run's final values
    (storages no later op of the run reads, in the order they were made) are bound to the names in order
    when there are as many of them as names (`q, k, v = [t.reshape(...) for t in (q, k, v)]`); every name
    holds the one storage when the last op gives views of it (`a, b = x.split(...)`);
  * for `a, b, c = f(x)`: where every tuple `return` of f with that many elements (either side of an
    `x if c else y` included) returns one local at a position (`return h, None, ids`), the name there
    holds what that local held when the call returned (`h = h + pos` inside f); other positions hold none;
  * a statement whose ops run in called functions binds their last op's output only when each call returns
    what its statement made (a `return`, or an assignment to a name it returns): a call that ends with a
    check (`if (m == 0).all(): return None`) binds nothing.
A rebinding statement that runs no aten op is placed at the last op before execution passes its line. Which
lines execution passes is read from the trace (`record_executed_lines`: the model's lines that ran at least
once while the forward was traced): a rebinding in a branch that never ran (`if self.q_lora_rank is None:`,
a scaling the config turns off) lets nothing go.
Limits: attributes, starred targets and other containers are not followed (their values are not held longer);
a branch that runs in some calls of a function and not in others counts as passed in all of them (a
rebinding there that runs no op releases the name early in the calls that skip it); a function called
again from a caller's loop whose first and last ops lie in one of its own loops is taken for one call;
what a call returns is followed by source lines, not by the branches taken (an unconditional no-op
statement above the `return` is taken to have run).
"""
from __future__ import annotations

import ast
import contextlib
import dataclasses
import functools
import sys
import types
from typing import Callable, Sequence

Frame = tuple[str, int, str]          # (file, line, function)


@dataclasses.dataclass
class _Invocation:
    file: str
    depth: int                        # its frame's position in the ops' user stacks (0: outermost)
    function: tuple                   # (file, function name, first line): which function it is a call of
    runs: list[list]                  # [statement line, last op index, op indices] in execution order
    end: int = -1                     # last op index of the invocation


@contextlib.contextmanager
def record_executed_lines(is_model_file: Callable[[str], bool], root=None):
    """Yields an ExecutedLines that collects (file, line) for every line run in a model file while the
    context is open and, with `root` (an nn.Module), only while its forward runs: the lines are read for
    forward ops' locals alone, and every Python frame entered costs a trace event (the backward's
    fake-tensor machinery would double them). Under another trace function (a debugger, coverage) nothing
    is recorded (`complete` stays False) and every rebinding line counts as passed, as before."""
    recorded = ExecutedLines()
    if sys.gettrace() is not None:
        yield recorded
        return
    lines = recorded.lines

    def in_model_file(frame, event, arg):
        if event == "line":
            lines.add((frame.f_code.co_filename, frame.f_lineno))
        return in_model_file

    def on_call(frame, event, arg):
        return in_model_file if is_model_file(frame.f_code.co_filename) else None

    _RECORDERS.add(on_call)
    hooks = []
    if root is None:
        sys.settrace(on_call)
    else:
        # AOT runs the root's forward twice (its metadata pass, then the joint trace): each call is traced
        hooks = [root.register_forward_pre_hook(lambda *_: sys.settrace(on_call)),
                 root.register_forward_hook(lambda *_: sys.settrace(None), always_call=True)]
    try:
        yield recorded
    finally:
        sys.settrace(None)
        _RECORDERS.discard(on_call)
        for hook in hooks:
            hook.remove()
    recorded.complete = True


_RECORDERS: set = set()            # the trace functions of the open record_executed_lines contexts
# C functions: no Python frame of the model runs inside one, only torch's own dispatch machinery
_C_FUNCTION_TYPES = (types.BuiltinFunctionType, types.MethodDescriptorType, types.WrapperDescriptorType,
                     types.MethodWrapperType)


class UntracedCall:
    """The context a torch function call runs in (a TorchFunctionMode's `func(*args)`): while a C function
    runs, the executed-lines trace is paused, so the Python frames of fake tensors, functionalization and
    proxies under it cost no trace event; a Python function (`F.softmax`, a custom op) may call model code
    and stays traced. Another trace function (a debugger, coverage) is left running. Not traced: a model
    file's own tensor subclass (`__torch_function__` / `__torch_dispatch__`) run under a C function; its
    lines hold no forward local of the model."""

    __slots__ = ("_paused",)

    def __init__(self, func):
        trace = sys.gettrace() if isinstance(func, _C_FUNCTION_TYPES) else None
        self._paused = trace if trace in _RECORDERS else None

    def __enter__(self):
        if self._paused is not None:
            sys.settrace(None)

    def __exit__(self, *exc):
        if self._paused is not None:
            sys.settrace(self._paused)


@dataclasses.dataclass
class ExecutedLines:
    """The (file, line) pairs a traced forward ran in model files; `complete` False: not recorded."""
    lines: set = dataclasses.field(default_factory=set)
    complete: bool = False
    _statements: dict = dataclasses.field(default_factory=dict)   # file -> statement lines that ran

    def statement_ran(self, file: str, statement_line: int) -> bool:
        if not self.complete:
            return True
        if file not in self._statements:
            self._statements[file] = frozenset(_statement_line(f, ln) for f, ln in self.lines if f == file)
        return statement_line in self._statements[file]


def local_holds(forward_ops: Sequence[tuple], executed: ExecutedLines | None = None) -> dict[int, int]:
    """forward_ops: (op index, user frames outer->inner, output storage ids[, input storage ids]), in
    execution order; executed: the model lines the trace ran (None: any may have). Returns storage id ->
    index of the last op during which a Python local still holds it."""
    executed = executed or ExecutedLines()
    forward_ops = _below_the_common_frames(forward_ops)
    outputs = {op[0]: op[2] for op in forward_ops}
    inputs = {op[0]: op[3] if len(op) > 3 else () for op in forward_ops}
    frames_of = {op[0]: op[1] for op in forward_ops}
    invocations = _invocations(forward_ops)
    invocation_at = {(inv.depth, index): n for n, inv in enumerate(invocations)
                     for run in inv.runs for index in run[2]}
    bound: list[dict[str, tuple[int, ...]]] = [{} for _ in invocations]    # name -> storages its last binding holds
    bound_at: list[dict[tuple[int, str], tuple[int, ...]]] = [{} for _ in invocations]   # (line, name) -> storages
    returned: list[tuple[int, ...]] = [() for _ in invocations]          # what each call returned, where known
    holds: dict[int, int] = {}
    for n in sorted(range(len(invocations)), key=lambda n: -invocations[n].depth):     # callees first
        inv = invocations[n]
        for k, (line, last, run_ops) in enumerate(inv.runs):
            callee = invocation_at.get((inv.depth + 1, last))
            # the statement's value is a call's (a comprehension or lambda is a part of its statement)
            called = (callee is not None and invocations[callee].end == last
                      and not invocations[callee].function[1].startswith("<"))
            name = _holding_name(inv.file, line)
            if called and _tuple_target_names(inv.file, line):
                # `a, b = f(x)`: by f's `return h, None` (the values f's ops leave unread are not its result)
                inner = _past_wrappers(invocations, invocation_at, callee, last)
                bindings = _returned_tuple_bindings(inv.file, line, frames_of[last][invocations[inner].depth],
                                                    bound[inner])
            elif name is not None and called and returned[callee]:
                bindings = [(name, returned[callee])]      # `out = f(x)`: all f returned (`return h, before, dims`)
            else:
                bindings = _bindings(inv.file, line, outputs[last], _final_values(run_ops, outputs, inputs))
                if bindings and not _callees_return_it(frames_of[last][inv.depth + 1:]):
                    continue               # the call returned something its last op did not make (None, a bool)
                if not bindings and callee is not None:   # `a, b, c = f(x)`: f's `return h, None, ids`
                    inner = _past_wrappers(invocations, invocation_at, callee, last)
                    bindings = _returned_tuple_bindings(inv.file, line, frames_of[last][invocations[inner].depth],
                                                        bound[inner])
            for name, sids in bindings:
                bound[n][name] = bound_at[n][(line, name)] = sids
                release = _release_op(inv.file, line, name, inv.runs[k + 1:], inv.end, executed)
                for sid in sids:
                    holds[sid] = max(holds.get(sid, -1), release)
        last = inv.runs[-1][1]
        callee = invocation_at.get((inv.depth + 1, last))
        passed_on = returned[callee] if callee is not None and invocations[callee].end == last else ()
        returned[n] = _returned_values(inv, bound_at[n], outputs[last], passed_on)
    return holds


def _past_wrappers(invocations: list[_Invocation], invocation_at: dict, callee: int, last: int) -> int:
    """The call whose `return` gives a statement's value: `callee`, or, while the callee ends in `return
    f(*args, **kwargs)` (a decorator's wrapper, `super().__call__`) and that call of f ends where it does,
    the call of f."""
    while True:
        inv = invocations[callee]
        stmt, _ = _statement_at(inv.file, inv.runs[-1][0])
        inner = invocation_at.get((inv.depth + 1, last))
        if not (isinstance(stmt, ast.Return) and isinstance(stmt.value, ast.Call)) or inner is None \
                or invocations[inner].end != last:
            return callee
        callee = inner


def _returned_values(inv: _Invocation, bound_at: dict, last_outputs: tuple[int, ...],
                     passed_on: tuple[int, ...]) -> tuple[int, ...]:
    """The storages the call returns, followed through statements that run no op (`outputs = (h,)`,
    `before = h`, `h = layer_outputs[0]`, `return outputs, height, width`) to the bindings of statements
    that ran ops; when its `return` statement ran the last op, that op's outputs, or all that the function
    it called returned (`passed_on`: `return super().__call__(*args)`). Every `return` after the call's last
    statement counts (an unread early `return tuple(...)` adds nothing new). Empty when unknown."""
    last_line = inv.runs[-1][0]
    _, function = _statement_at(inv.file, last_line)
    if function is None or isinstance(function, ast.Lambda):
        return ()
    run_lines = frozenset(run[0] for run in inv.runs)
    out: dict[int, None] = {}
    for ret in ast.walk(function):
        if not isinstance(ret, ast.Return) or ret.value is None or ret.lineno < last_line:
            continue
        if ret.lineno == last_line:
            out.update(dict.fromkeys(passed_on if isinstance(ret.value, ast.Call) and passed_on else last_outputs))
            continue
        for node in ast.walk(ret.value):
            if isinstance(node, ast.Name):
                out.update(dict.fromkeys(_value_of(inv.file, function, node.id, ret.lineno, bound_at, run_lines)))
    return tuple(out)


def _value_of(file: str, function: ast.AST, name: str, before: int, bound_at: dict, run_lines: frozenset,
              depth: int = 0) -> tuple[int, ...]:
    """The storages `name` holds at line `before`, from the last statement above it that assigns it: its
    binding when that statement ran ops, else the names its value is made of (no op: aliases, tuples,
    subscripts of locals)."""
    stmt = _last_assignment(function, name, before, run_lines)
    if stmt is None or depth > 16:
        return ()
    if (stmt.lineno, name) in bound_at:
        return bound_at[(stmt.lineno, name)]
    if stmt.lineno in run_lines or stmt.value is None:
        return ()                          # it ran ops but bound nothing known
    names = _names_in(stmt.value)
    if isinstance(stmt, ast.AugAssign):   # `outputs += (attn,)`
        names.add(name)
    out: dict[int, None] = {}
    for other in sorted(names):
        out.update(dict.fromkeys(_value_of(file, function, other, stmt.lineno, bound_at, run_lines, depth + 1)))
    return tuple(out)


def _names_in(expr: ast.AST) -> set[str]:
    """The locals an expression's value may hold; a slice of a tuple (`outputs[1:]`, often empty) holds
    none that is known."""
    if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Slice):
        return set()
    if isinstance(expr, ast.Name):
        return {expr.id}
    return set().union(*(_names_in(child) for child in ast.iter_child_nodes(expr)))


@functools.lru_cache(maxsize=256)
def _under_an_if(function: ast.AST) -> frozenset[int]:
    return frozenset(id(node) for branch in ast.walk(function) if isinstance(branch, ast.If)
                     for stmt in branch.body + branch.orelse for node in ast.walk(stmt))


def _last_assignment(function: ast.AST, name: str, before: int, run_lines: frozenset) -> ast.stmt | None:
    """The last statement above `before` that assigns `name`, leaving out those under an `if` that ran no op
    (they may not have run: `if output_attentions: outputs += (attn,)`)."""
    conditional = _under_an_if(function)
    found = None
    for node in ast.walk(function):
        if (isinstance(node, (ast.Assign, ast.AugAssign, ast.AnnAssign)) and node.lineno < before
                and (id(node) not in conditional or node.lineno in run_lines) and name in _assigned_names(node)
                and (found is None or node.lineno > found.lineno)):
            found = node
    return found


def _below_the_common_frames(forward_ops: Sequence[tuple]) -> list[tuple]:
    """The ops with the frames every op shares (same file, line and function) cut off: those statements
    (a script's or test's `graph, analysis = predict(...)`, the wrapper calling the model) enclose the whole
    forward, so nothing they bind is let go before it ends, and what they bind is not the model's."""
    if not forward_ops:
        return []
    common = min(len(op[1]) for op in forward_ops)
    first = forward_ops[0][1]
    for op in forward_ops:
        while common and op[1][:common] != first[:common]:
            common -= 1
    common = min(common, min(len(op[1]) for op in forward_ops) - 1)    # an op's own frame is never cut
    return [(op[0], op[1][max(common, 0):], *op[2:]) for op in forward_ops]


def _bindings(file: str, line: int, last_outputs: tuple[int, ...], finals: list[int]):
    """(name, storage ids it holds) for each local the statement at `line` binds."""
    name = _holding_name(file, line)
    if name is not None:
        return [(name, last_outputs)]
    names = _tuple_target_names(file, line)
    if names and len(names) == len(finals):
        return [(n, (sid,)) for n, sid in zip(names, finals)]
    if names and len(finals) == 1 and set(last_outputs) == set(finals):
        return [(n, tuple(finals)) for n in names]       # `a, b = x.split(...)`: views of one storage
    return []


def _returned_tuple_bindings(file: str, line: int, callee_frame: Frame, callee_bound: dict) -> list:
    """`a, b, c = f(x)` where every `return` of f with as many elements returns the same local at a position
    (`return embeddings, mask, ids`): the target name there holds what that local held when f returned (its
    last binding in that call). Positions returning anything else (None, an expression) bind nothing."""
    names = _tuple_target_names(file, line)
    if not names:
        return []
    returned = _returned_tuple_names(callee_frame[0], callee_frame[1], len(names))
    return [(name, callee_bound[local]) for name, local in zip(names, returned)
            if local is not None and local in callee_bound]


@functools.lru_cache(maxsize=4096)
def _returned_tuple_names(file: str, line: int, arity: int) -> tuple[str | None, ...]:
    """Per position, the local every `arity`-element tuple `return` of the function around `line` returns
    there (None where they differ or return no plain name)."""
    _, function = _statement_at(file, line)
    if function is None:
        return (None,) * arity
    values = [r.value for r in ast.walk(function) if isinstance(r, ast.Return)]
    values += [branch for v in values if isinstance(v, ast.IfExp) for branch in (v.body, v.orelse)]
    tuples = [v.elts for v in values if isinstance(v, ast.Tuple) and len(v.elts) == arity]
    out = []
    for position in range(arity):
        ids = {e[position].id if isinstance(e[position], ast.Name) else None for e in tuples}
        out.append(ids.pop() if len(ids) == 1 else None)
    return tuple(out)


def _final_values(run_ops: list[int], outputs: dict, inputs: dict) -> list[int]:
    """Storages the run's ops make that no later op of the run reads (a view continues its base), in order."""
    pending: dict[int, None] = {}
    for index in run_ops:
        for sid in inputs[index]:
            pending.pop(sid, None)
        for sid in outputs[index]:
            pending.pop(sid, None)
            pending[sid] = None
    return list(pending)


def _invocations(forward_ops) -> list[_Invocation]:
    current: dict[tuple, tuple[int, int]] = {}          # frame key -> (invocation id, last line)
    invocations: list[_Invocation] = []
    for index, frames, *_ in forward_ops:
        # an invocation's key: its function, its callers' frames and, per caller, the invocation and the
        # statement execution (run) it is in: a call made by another execution is another call
        outer_ids: tuple[tuple[int, int], ...] = ()
        for depth, (file, line, func) in enumerate(frames):
            line = _statement_line(file, line)
            key = _frame_key(outer_ids, frames, depth, line)
            inv_id, last_line = current.get(key, (None, -1))
            if inv_id is None or _restarts(file, line, last_line):
                inv_id = len(invocations)
                invocations.append(_Invocation(file=file, depth=depth, function=key[-1], runs=[]))
            current[key] = (inv_id, line)
            inv = invocations[inv_id]
            if inv.runs and inv.runs[-1][0] == line and not _calls_again(inv_id, inv, line, frames, depth, outer_ids, current):
                inv.runs[-1][1] = index
                inv.runs[-1][2].append(index)
            else:
                inv.runs.append([line, index, [index]])
            inv.end = index
            outer_ids += ((inv_id, len(inv.runs) - 1),)
    return invocations


def _frame_key(outer_ids: tuple, frames, depth: int, line: int) -> tuple:
    file, _, func = frames[depth]
    # two functions of one file with one name (the `forward`s of two modules) are two functions
    return outer_ids, frames[:depth], (file, func, _function_line(file, line))


def _restarts(file: str, line: int, last_line: int) -> bool:
    """Does a function whose last statement ran at `last_line` start a new call at `line`? A smaller line
    outside a loop of the function."""
    return line < last_line and not _in_one_loop(file, last_line, line)


def _calls_again(inv_id: int, inv: _Invocation, line: int, frames, depth: int, outer_ids: tuple,
                 current: dict) -> bool:
    """Does this op start the next execution of the statement at `line` that `inv`'s last run is running?
    A statement in a loop whose body runs no other op (`for layer in self.layers: h = layer(h)`) gives one
    run of consecutive ops; a new call of the function it called before ends the previous iteration."""
    if depth + 1 >= len(frames) or _innermost_loop(inv.file, line, line) is None:
        return False
    callee_file, callee_line, _ = frames[depth + 1]
    callee_line = _statement_line(callee_file, callee_line)
    this_run = outer_ids + ((inv_id, len(inv.runs) - 1),)
    _, last_line = current.get(_frame_key(this_run, frames, depth + 1, callee_line), (None, -1))
    return _restarts(callee_file, callee_line, last_line)


def _callees_return_it(frames: Sequence[Frame]) -> bool:
    """Does each called function (outer -> inner) return what its statement at the frame's line made: a
    `return` statement, or an assignment to a name the function returns (`x = self.fc2(x)` ... `return x`)?
    A condition (`if (m == 0).all():`) or an expression statement makes a value the call does not return.
    Comprehensions and lambdas are parts of their statement."""
    for file, line, func in frames:
        if func.startswith("<"):
            continue
        stmt, function = _statement_at(file, line)
        if stmt is None or isinstance(stmt, ast.Return):
            continue
        names = _assigned_names(stmt)
        if not names or not names & _returned_names(function):
            return False
    return True


def _assigned_names(stmt: ast.stmt) -> set[str]:
    targets = (stmt.targets if isinstance(stmt, ast.Assign)
               else [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else [])
    return {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}


def _returned_names(function: ast.AST | None) -> set[str]:
    if function is None:
        return set()
    return {n.id for r in ast.walk(function) if isinstance(r, ast.Return) and r.value is not None
            for n in ast.walk(r.value) if isinstance(n, ast.Name)}


def _release_op(file: str, line: int, name: str, later_runs: list[list[int]], end: int,
                executed: ExecutedLines) -> int:
    """The last op of the first later run that rebinds `name`; when execution passes a rebinding line
    (one that ran) without running an op there, the last op before it; else the invocation's end."""
    stores = frozenset(ln for ln in _store_lines(file, line, name) if executed.statement_ran(file, ln))
    previous_line, previous_last = line, None
    for run_line, run_last, _ in later_runs:
        if run_line in stores:
            return run_last
        if previous_last is not None and _passes_any(file, previous_line, run_line, stores):
            return previous_last
        previous_line, previous_last = run_line, run_last
    return end


def _passes_any(file: str, from_line: int, to_line: int, lines: frozenset[int]) -> bool:
    """Does execution going from statement `from_line` to statement `to_line` pass one of `lines`?
    Forward: the lines between; backward (the next iteration of a loop): the rest of the loop's body
    after `from_line`, its header, and its body before `to_line`."""
    if from_line < to_line:
        return any(from_line < ln < to_line for ln in lines)
    loop = _innermost_loop(file, from_line, to_line)
    if loop is None:
        return False
    return any(from_line < ln <= loop[1] or loop[0] <= ln < to_line for ln in lines)


@functools.lru_cache(maxsize=64)
def _parse(file: str) -> ast.Module | None:
    try:
        with open(file) as f:
            return ast.parse(f.read(), filename=file)
    except (OSError, SyntaxError, ValueError):
        return None


def is_assertion(file: str, line: int) -> bool:
    """The statement running at `file:line` is an `assert`."""
    return isinstance(_statement_at(file, line)[0], ast.Assert)


def passing_truth(file: str, line: int) -> bool:
    """The truth value that lets the `assert` at `file:line` pass, when the value it reads is its test under
    `not`s (`assert (x == 0).all()`: True; `assert not x.isnan().any()`: False); True for any other test."""
    test = getattr(_statement_at(file, line)[0], "test", None)
    negated = False
    while isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        test, negated = test.operand, not negated
    return not negated


def assertion_note(line: str) -> str:
    """The report's note for an `assert` at `line` (`file.py:N`) whose truth value reads a tensor."""
    return (f"the assertion at {line} reads a tensor's value: taken as passing (fake tensors have no data; the "
            "step predicted is one that runs)")


@functools.lru_cache(maxsize=4096)
def _statement_at(file: str, line: int) -> tuple[ast.stmt | None, ast.AST | None]:
    """The innermost simple statement covering `line`, and its enclosing function."""
    return _statements_by_line(file).get(line, (None, None))


@functools.lru_cache(maxsize=64)
def _statements_by_line(file: str) -> dict[int, tuple[ast.stmt, ast.AST | None]]:
    """line -> (the innermost statement covering it, its enclosing function), from one walk of the file:
    of the statements covering a line, the one that starts last (the last visited, among equals) wins."""
    tree = _parse(file)
    by_line: dict[int, tuple[ast.stmt, ast.AST | None]] = {}

    def visit(node: ast.AST, func: ast.AST | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else func
            if isinstance(child, ast.stmt):
                for line in range(child.lineno, (child.end_lineno or child.lineno) + 1):
                    best = by_line.get(line)
                    if best is None or child.lineno >= best[0].lineno:
                        by_line[line] = (child, inner)
            visit(child, inner)

    if tree is not None:
        visit(tree, None)
    return by_line


def _function_line(file: str, line: int) -> int | None:
    """The first line of the function (or lambda) whose body holds `line`."""
    _, function = _statement_at(file, line)
    return None if function is None else function.lineno


def _statement_line(file: str, line: int) -> int:
    """The first line of the statement covering `line` (ops of one multi-line statement share it)."""
    stmt, _ = _statement_at(file, line)
    return line if stmt is None else stmt.lineno


@functools.lru_cache(maxsize=64)
def _loops(file: str) -> tuple[tuple[int, int], ...]:
    """(first line, last line) of every for/while loop in the file."""
    tree = _parse(file)
    if tree is None:
        return ()
    return tuple((node.lineno, node.end_lineno or node.lineno) for node in ast.walk(tree)
                 if isinstance(node, (ast.For, ast.AsyncFor, ast.While)))


def _innermost_loop(file: str, a: int, b: int) -> tuple[int, int] | None:
    inside = [loop for loop in _loops(file) if loop[0] <= min(a, b) and max(a, b) <= loop[1]]
    return min(inside, key=lambda loop: loop[1] - loop[0]) if inside else None


def _in_one_loop(file: str, a: int, b: int) -> bool:
    return _innermost_loop(file, a, b) is not None


_COLLECTING_METHODS = frozenset({"append", "extend", "insert"})


def _holding_name(file: str, line: int) -> str | None:
    """The local name that holds the value the statement at `line` computes, if any."""
    stmt, _ = _statement_at(file, line)
    if isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call):
        method = stmt.value.func
        if (isinstance(method, ast.Attribute) and method.attr in _COLLECTING_METHODS
                and isinstance(method.value, ast.Name)):
            return method.value.id
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
        return stmt.target.id
    return None


def _tuple_target_names(file: str, line: int) -> tuple[str, ...] | None:
    stmt, _ = _statement_at(file, line)
    if not (isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], (ast.Tuple, ast.List))):
        return None
    elts = stmt.targets[0].elts
    return tuple(e.id for e in elts) if all(isinstance(e, ast.Name) for e in elts) else None


@functools.lru_cache(maxsize=4096)
def _store_lines(file: str, line: int, name: str) -> frozenset[int]:
    """Statement lines of the function around `line` that assign or delete `name` (itself included)."""
    _, func = _statement_at(file, line)
    if func is None:
        return frozenset()
    return frozenset(_statement_line(file, node.lineno) for node in ast.walk(func)
                     if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, (ast.Store, ast.Del)))
