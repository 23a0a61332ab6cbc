"""Python locals in forward: a tensor bound by `name = ...` stays alive until the name is rebound or the
function returns, even after its last use by an op. The joint graph alone frees it at last use.

From each forward op's user stack (outer -> inner frames, kept whole by the capture) this finds:
  * frame invocations: per depth, a run of ops with the same outer call chain and the same function,
    whose line numbers never go back (a smaller line starts a new call, e.g. the next block in a loop);
  * statements: (invocation, line); the value a statement binds is the output of its last op; a frame's
    line is first taken to its statement's first line, since the lines one statement's ops report can go
    back (`loss = fn(\n a.view(...))` runs the view on the second line, then the call on the first);
  * for a statement `name = <expr>` (one plain name; read from the file's AST), the op after which the
    name lets go: the end of the next statement in the same function that assigns or deletes `name`,
    else the last op of the invocation.
Limits: tuple targets, attributes and containers are not followed (their values are not held longer);
a rebinding statement that runs no aten op is placed at the last op before its line.
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
    statement_last_op: dict[tuple[int, int], int] = {}   # (invocation, line) -> last op index
    outputs: dict[int, tuple[int, ...]] = {}
    next_id = 0
    for index, frames, out_sids in forward_ops:
        outputs[index] = out_sids
        for depth, (file, line, func) in enumerate(frames):
            key = (frames[:depth], file, func)
            line = _statement_line(file, line)
            inv, last_line = current.get(key, (None, -1))
            if inv is None or line < last_line:
                inv, next_id = next_id, next_id + 1
                invocation_frame[inv] = (file, line, func)
            current[key] = (inv, line)
            invocation_end[inv] = index
            statement_last_op[(inv, line)] = index
    lines_by_invocation: dict[int, list[tuple[int, int]]] = {}
    for (inv, line), last in statement_last_op.items():
        lines_by_invocation.setdefault(inv, []).append((line, last))
    holds: dict[int, int] = {}
    for (inv, line), last in statement_last_op.items():
        file = invocation_frame[inv][0]
        name = _bound_name(file, line)
        if name is None:
            continue
        release = _release_op(file, line, name, sorted(lines_by_invocation[inv]), invocation_end[inv])
        for sid in outputs[last]:
            holds[sid] = max(holds.get(sid, -1), release)
    return holds


def _release_op(file: str, line: int, name: str, statements: list[tuple[int, int]], end: int) -> int:
    rebind = _next_rebinding_line(file, line, name)
    if rebind is None:
        return end
    at_or_before = [last for stmt_line, last in statements if stmt_line <= rebind]
    return max(at_or_before) if at_or_before else end


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
    stmt, func = _statement_at(file, line)
    if func is None:
        return None
    lines = []
    for node in ast.walk(func):
        if isinstance(node, ast.Name) and node.id == name and isinstance(node.ctx, (ast.Store, ast.Del)):
            if node.lineno > (stmt.end_lineno or stmt.lineno):
                lines.append(node.lineno)
    return min(lines) if lines else None
