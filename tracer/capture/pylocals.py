"""Python locals in forward: a tensor bound by `name = ...` stays alive until the name is rebound or the
function returns, even after its last use by an op. The joint graph alone frees it at last use.

From each forward op's user stack (outer -> inner frames, kept whole by the capture) this finds:
  * frame invocations: per depth, a run of ops of one function called from one caller invocation and call
    line, whose lines never go back (a smaller line starts a new call, e.g. the next block in a loop),
    except where a `for` / `while` body in that function covers both lines: then it is the loop's next
    iteration, in the same call;
  * statement runs: consecutive ops of one invocation on one statement; a frame's line is first taken to
    its statement's first line, since the lines one statement's ops report can go back
    (`loss = fn(\\n a.view(...))` runs the view on the second line, then the call on the first); the value
    a statement binds is the output of its run's last op;
  * for a statement `name = <expr>` (one plain name; read from the file's AST), the op after which the
    name lets go: the end of the next run of a statement in the same function that assigns or deletes
    `name` (in a loop, the same statement in the next iteration), else the last op of the invocation.
Limits: tuple targets, attributes and containers are not followed (their values are not held longer);
a rebinding statement that runs no aten op is placed at the last op before its line; a loop whose body is
one statement (`for b in blocks: x = b(x)`) is one run, so only its last iteration's value is held; a
function whose every op sits in one loop, called twice in a row from one line, reads as one call.
"""
from __future__ import annotations

import ast
import functools
from typing import Sequence

Frame = tuple[str, int, str]          # (file, line, function)


def local_holds(forward_ops: Sequence[tuple[int, tuple[Frame, ...], tuple[int, ...]]]) -> dict[int, int]:
    """forward_ops: (op index, user frames outer->inner, output storage ids), in execution order.
    Returns storage id -> index of the last op during which a Python local still holds it."""
    current: dict[tuple, tuple[int, int]] = {}          # frame key -> (invocation id, last line)
    invocation_end: dict[int, int] = {}
    invocation_frame: dict[int, Frame] = {}
    runs: dict[int, list[list[int]]] = {}               # invocation -> [statement line, last op] in order
    outputs: dict[int, tuple[int, ...]] = {}
    next_id = 0
    for index, frames, out_sids in forward_ops:
        outputs[index] = out_sids
        parent = None
        for depth, (file, line, func) in enumerate(frames):
            # a call is known by its caller's invocation and call line: a new caller invocation, a new call
            key = (parent, frames[depth - 1][1] if depth else None, file, func)
            line = _statement_line(file, line)
            inv, last_line = current.get(key, (None, -1))
            if inv is None or (line < last_line and not _in_one_loop(file, line, last_line)):
                inv, next_id = next_id, next_id + 1
                invocation_frame[inv] = (file, line, func)
                runs[inv] = []
            current[key] = (inv, line)
            invocation_end[inv] = index
            if runs[inv] and runs[inv][-1][0] == line:
                runs[inv][-1][1] = index
            else:
                runs[inv].append([line, index])
            parent = inv
    holds: dict[int, int] = {}
    for inv, statements in runs.items():
        file = invocation_frame[inv][0]
        for position, (line, last) in enumerate(statements):
            name = _bound_name(file, line)
            if name is None:
                continue
            release = _release_op(file, line, name, statements[position:], invocation_end[inv])
            for sid in outputs[last]:
                holds[sid] = max(holds.get(sid, -1), release)
    return holds


def _release_op(file: str, line: int, name: str, statements: list[list[int]], end: int) -> int:
    """statements: the binding statement's run, then the runs after it in execution order. The name lets
    go at the end of the next run of a statement that assigns or deletes it (in a loop, the same statement
    in the next iteration); a rebinding statement that runs no op ends at the last op before its line."""
    stores = _storing_lines(file, line, name)
    rebind = _next_rebinding_line(file, line, name)
    for (stmt_line, last), (previous_line, previous_last) in zip(statements[1:], statements):
        if stmt_line in stores:
            return last
        if rebind is not None and previous_line <= rebind < stmt_line:
            return previous_last
    return end


@functools.lru_cache(maxsize=64)
def _parse(file: str) -> ast.Module | None:
    try:
        with open(file) as f:
            return ast.parse(f.read(), filename=file)
    except (OSError, SyntaxError, ValueError):
        return None


@functools.lru_cache(maxsize=4096)
def _statement_at(file: str, line: int) -> tuple[ast.stmt | None, ast.AST | None]:
    """The innermost simple statement covering `line`, and its enclosing function."""
    tree = _parse(file)
    best: tuple[ast.stmt | None, ast.AST | None] = (None, None)

    def visit(node: ast.AST, func: ast.AST | None) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            inner = child if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)) else func
            if isinstance(child, ast.stmt) and child.lineno <= line <= (child.end_lineno or child.lineno):
                if best[0] is None or child.lineno >= best[0].lineno:
                    best = (child, inner)
            visit(child, inner)

    if tree is not None:
        visit(tree, None)
    return best


def _statement_line(file: str, line: int) -> int:
    """The first line of the simple statement covering `line` (the line itself when the file is unreadable)."""
    stmt, _ = _statement_at(file, line)
    return stmt.lineno if stmt is not None else line


def _bound_name(file: str, line: int) -> str | None:
    stmt, _ = _statement_at(file, line)
    if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
        return stmt.targets[0].id
    if isinstance(stmt, ast.AnnAssign) and stmt.value is not None and isinstance(stmt.target, ast.Name):
        return stmt.target.id
    return None


def _next_rebinding_line(file: str, line: int, name: str) -> int | None:
    stmt, _ = _statement_at(file, line)
    lines = [store for store in _storing_lines(file, line, name) if store > (stmt.end_lineno or stmt.lineno)]
    return min(lines) if lines else None


@functools.lru_cache(maxsize=4096)
def _storing_lines(file: str, line: int, name: str) -> frozenset[int]:
    """The first lines of the statements, in the function around `line`, that assign or delete `name`."""
    _, func = _statement_at(file, line)
    if func is None:
        return frozenset()
    return frozenset(_statement_line(file, node.lineno) for node in ast.walk(func)
                     if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, (ast.Store, ast.Del)))


@functools.lru_cache(maxsize=4096)
def _in_one_loop(file: str, earlier: int, later: int) -> bool:
    """Some `for` / `while` statement's body covers both lines: going back from `later` to `earlier` may be
    the loop's next iteration rather than a new call."""
    tree = _parse(file)
    if tree is None:
        return False
    return any(isinstance(node, (ast.For, ast.AsyncFor, ast.While)) and node.body
               and node.body[0].lineno <= earlier and later <= (node.body[-1].end_lineno or node.body[-1].lineno)
               for node in ast.walk(tree))
