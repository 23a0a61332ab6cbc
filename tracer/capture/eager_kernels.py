"""Ops whose traced decomposition allocates where the eager kernel does not; while a graph is traced,
they are made to run as eager runs them.

`dropout_as_in_eager()`: `dropout(x, p=0)` (or not training) returns `x` itself in eager (ATen's C++
kernel, CPU and CUDA), but tracing runs torch's Python decomposition of aten.dropout
(torch/_decomp/decompositions.py), which returns `x.clone()`: a copy eager never makes. Where autograd
saves both sides (T5's relu -> dropout -> wo saves the relu output and the copy) the prediction saved one
extra tensor per dropout. For the duration, dropout with p=0 or not training returns its input; p > 0
keeps torch's decomposition. Eager runs never reach these Python kernels (no Python dispatcher), so they
are unchanged. Limit: it swaps the op's Python kernels (`py_kernels`, a private torch structure), so a
torch upgrade may need it revisited; tests/accuracy/test_hf.py (T5) fails if it stops working.
"""
from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def dropout_as_in_eager():
    from torch._C import DispatchKey
    op = torch.ops.aten.dropout.default
    keys = [k for k in (DispatchKey.CompositeImplicitAutograd, DispatchKey.Autograd) if k in op.py_kernels]
    saved = {k: op.py_kernels[k] for k in keys}

    def as_in_eager(decomposed):
        def dropout(input, p, train):
            return input if not train or p == 0 else decomposed(input, p, train)
        return dropout

    op.py_kernels.update({k: as_in_eager(saved[k]) for k in keys})
    op._dispatch_cache.clear()
    try:
        yield
    finally:
        op.py_kernels.update(saved)
        op._dispatch_cache.clear()


# aten op -> positions of inputs that eager autograd saves although the traced backward reads only their
# shape: index_add's source gradient is `grad.index_select(dim, index).expand_as(source)` (derivatives.yaml),
# so eager keeps `source` until its node runs; the traced backward has only an expand to its shape.
SAVED_FOR_SHAPE = {"aten.index_add.default": (3,)}
