"""Python-local lifetimes from user stacks + the source AST, on hand-written frames and a temp file."""
import textwrap

from tracer.capture.pylocals import local_holds

SOURCE = textwrap.dedent('''\
    def forward(x):
        h = f(x)
        y = g(h)
        h = k(y)
        return h


    def block(x):
        x = x + 1
        return x


    def loss_of(x):
        h = f(x)
        loss = g(
            h.view(-1),
        )
        return loss


    def stages(x):
        for stage in stages:
            out = stage(x)
            x = out.contiguous()
        return x
''')


def _write(tmp_path):
    path = tmp_path / "model.py"
    path.write_text(SOURCE)
    return str(path)


def test_local_is_held_until_rebound(tmp_path):
    f = _write(tmp_path)
    ops = [
        (0, ((f, 2, "forward"),), (10,)),       # h = f(x)
        (1, ((f, 3, "forward"),), (11,)),       # y = g(h): last use of h
        (2, ((f, 3, "forward"),), (12,)),
        (3, ((f, 4, "forward"),), (13,)),       # h = k(y): old h released here
        (4, ((f, 5, "forward"),), (14,)),
    ]
    holds = local_holds(ops)
    assert holds[10] == 3                        # first h lives until the rebinding statement ends
    assert holds[12] == 4                        # y (last op of line 3) lives until forward returns
    assert holds[13] == 4


def test_each_call_in_a_loop_is_its_own_invocation(tmp_path):
    f = _write(tmp_path)
    outer = (f, 99, "caller")
    ops = [
        (0, (outer, (f, 9, "block")), (20,)),    # block 0: x = x + 1
        (1, (outer, (f, 10, "block")), (21,)),
        (2, (outer, (f, 9, "block")), (22,)),    # block 1 starts: the line goes back
        (3, (outer, (f, 10, "block")), (23,)),
    ]
    holds = local_holds(ops)
    assert holds[20] == 1 and holds[22] == 3     # not held across into the next call


def test_a_statement_over_several_lines_is_one_statement(tmp_path):
    """The ops of `loss = g(\n h.view(-1))` report the view's line (16), then the call's (15): the line
    going back inside one statement starts no new call, so `h` is still held until the function returns."""
    f = _write(tmp_path)
    ops = [
        (0, ((f, 14, "loss_of"),), (30,)),       # h = f(x)
        (1, ((f, 16, "loss_of"),), (31,)),       # h.view(-1): last use of h
        (2, ((f, 15, "loss_of"),), (32,)),       # g(...): binds loss
        (3, ((f, 18, "loss_of"),), (33,)),
    ]
    holds = local_holds(ops)
    assert holds[30] == 3                        # h lives until loss_of returns
    assert holds[32] == 3                        # loss is the output of the statement's last op
    assert 31 not in holds                       # the view's output is bound to no name


def test_a_loop_iteration_is_no_new_call_and_holds_until_the_next_binding(tmp_path):
    """`out = stage(x); x = out.contiguous()` in a loop: the line going back from 24 to 23 is the loop's next
    iteration; `out` lets go when the next iteration's `out = stage(x)` ends, not when its own ends."""
    f = _write(tmp_path)
    outer = (f, 99, "caller")
    ops = [
        (0, (outer, (f, 23, "stages"), (f, 9, "block")), (40,)),    # out = stage(x), inside stage
        (1, (outer, (f, 24, "stages")), (41,)),                    # x = out.contiguous()
        (2, (outer, (f, 23, "stages"), (f, 9, "block")), (42,)),    # next iteration: a new call of stage
        (3, (outer, (f, 24, "stages")), (43,)),
        (4, (outer, (f, 25, "stages")), (44,)),
    ]
    holds = local_holds(ops)
    assert holds[40] == 2                        # the first `out` until the second `out = stage(x)` ends
    assert holds[41] == 3                        # the first `x` until the second `x = ...` ends
    assert holds[42] == 4 and holds[43] == 4     # the last iteration's values until stages returns


LOOP_SOURCE = textwrap.dedent('''\
    def scan(x):
        u = f(x)
        state = g(x)
        outs = []
        for t in range(n):
            state = u * state
            outs.append(k(state))
        y = stack(outs)
        return y
''')


def test_a_loop_inside_one_call_is_one_invocation(tmp_path):
    path = tmp_path / "scan.py"
    path.write_text(LOOP_SOURCE)
    f = str(path)
    ops = [
        (0, ((f, 2, "scan"),), (30,)),           # u = f(x)
        (1, ((f, 3, "scan"),), (31,)),           # state = g(x)
        (2, ((f, 6, "scan"),), (32,)),           # iteration 0: state = u * state (last use of the first state)
        (3, ((f, 7, "scan"),), (33,)),           #              outs.append(k(state))
        (4, ((f, 6, "scan"),), (34,)),           # iteration 1: the line goes back inside the loop
        (5, ((f, 7, "scan"),), (35,)),
        (6, ((f, 8, "scan"),), (36,)),           # y = stack(outs)
        (7, ((f, 9, "scan"),), (37,)),
    ]
    holds = local_holds(ops)
    assert holds[30] == 7                        # u: read only in the loop, held until the function returns
    assert holds[31] == 2                        # the first state: until iteration 0 rebinds the name
    assert holds[32] == 4                        # iteration 0's state: until iteration 1 rebinds it
    assert holds[33] == 7 and holds[35] == 7     # appended outputs: as long as the list `outs`


TUPLE_SOURCE = textwrap.dedent('''\
    def chunks(x, y):
        a, b = [pad(t).reshape(n) for t in (x, y)]
        z = g(a)
        return z
''')


def test_a_tuple_target_binds_the_statements_final_values_in_order(tmp_path):
    path = tmp_path / "tuple.py"
    path.write_text(TUPLE_SOURCE)
    f = str(path)
    ops = [
        (0, ((f, 2, "chunks"),), (40,), (1,)),        # pad(x)
        (1, ((f, 2, "chunks"),), (40,), (40,)),       # .reshape(n): a view continues it
        (2, ((f, 2, "chunks"),), (41,), (2,)),        # pad(y)
        (3, ((f, 2, "chunks"),), (41,), (41,)),
        (4, ((f, 3, "chunks"),), (42,), (40,)),       # z = g(a): last use of a
        (5, ((f, 4, "chunks"),), (43,), (42,)),
    ]
    holds = local_holds(ops)
    assert holds[40] == 5 and holds[41] == 5      # a and b: held until the function returns


RETURNED_TUPLE_SOURCE = textwrap.dedent('''\
    def model(x):
        h, mask, ids = embed(x)
        y = block(h)
        return y


    def embed(x):
        e = patch(x)
        e = e + pos
        return e, None, None
''')


def test_a_tuple_target_holds_the_local_the_callee_returns_at_its_position(tmp_path):
    path = tmp_path / "returned.py"
    path.write_text(RETURNED_TUPLE_SOURCE)
    f = str(path)
    outer = (f, 2, "model")
    ops = [
        (0, (outer, (f, 8, "embed")), (50,), (1,)),     # e = patch(x)
        (1, (outer, (f, 9, "embed")), (51,), (50, 2)),  # e = e + pos: the value `h` receives
        (2, ((f, 3, "model"),), (52,), (51,)),          # y = block(h): last use of h
        (3, ((f, 3, "model"),), (53,), (52,)),
        (4, ((f, 4, "model"),), (54,), (53,)),
    ]
    holds = local_holds(ops)
    assert holds[51] == 4                         # h: held until model returns
    assert holds[50] == 1                         # the first e: let go when embed rebinds e



WRAPPED_TUPLE_SOURCE = textwrap.dedent('''\
    def block(x):
        out, _ = attn(x)
        h = out + x
        y = mlp(h)
        return y


    def wrapped_func(*args, **kwargs):
        return func(*args, **kwargs)


    def attn(x):
        out = proj(x)
        return out, None
''')


def test_a_tuple_target_binds_through_a_wrapper_that_returns_its_call(tmp_path):
    """`out, _ = self.attn(x)` where attn's forward is decorated (transformers' deprecate_kwarg): the
    wrapper's `return func(*args, **kwargs)` passes attn's `return out, None` on, so `out` holds attn's `out`
    until block returns (checkpointed GPT-2: the attention output was let go after the residual add)."""
    path = tmp_path / "wrapped.py"
    path.write_text(WRAPPED_TUPLE_SOURCE)
    f = str(path)
    block = (f, 2, "block")
    ops = [
        (0, (block, (f, 9, "wrapped_func"), (f, 13, "attn")), (60,), (1,)),   # out = proj(x)
        (1, ((f, 3, "block"),), (61,), (60, 1)),                              # h = out + x: last use of out
        (2, ((f, 4, "block"),), (62,), (61,)),                                # y = mlp(h)
        (3, ((f, 4, "block"),), (63,), (62,)),
    ]
    holds = local_holds(ops)
    assert holds[60] == 3                         # out: held until block returns, not freed at the add


TWO_FORWARDS_SOURCE = textwrap.dedent('''\
    class Mix:
        def forward(self, x):
            qkv = self.qkv(x)
            return self.proj(qkv)


    class Mlp:
        def forward(self, x):
            h = self.up(x)
            return self.down(h)


    def residual(x):
        return x + module(x)
''')


def test_two_functions_with_one_name_in_one_file_are_two_invocations(tmp_path):
    """Module after module under one caller line (`x + self.module(x)`, each block's wrapper on one line):
    Mix.forward's lines (3-4) then Mlp.forward's (9-10) never go back, yet Mix's call has returned."""
    path = tmp_path / "blocks.py"
    path.write_text(TWO_FORWARDS_SOURCE)
    f = str(path)
    outer = (f, 14, "residual")
    ops = [
        (0, (outer, (f, 3, "forward")), (60,), (1,)),     # qkv = self.qkv(x)
        (1, (outer, (f, 4, "forward")), (61,), (60,)),    # return self.proj(qkv)
        (2, (outer,), (62,), (1, 61)),
        (3, (outer, (f, 9, "forward")), (63,), (62,)),    # h = self.up(x)
        (4, (outer, (f, 10, "forward")), (64,), (63,)),
        (5, (outer,), (65,), (62, 64)),
    ]
    holds = local_holds(ops)
    assert holds[60] == 1                         # qkv: let go when Mix.forward returns, not at Mlp's end
    assert holds[63] == 4


LAYER_LOOP_SOURCE = textwrap.dedent('''\
    def model(x):
        h = stem(x)
        for layer in layers:
            h = layer(h)
        return h


    def layer(x):
        y = up(x)
        return down(y)
''')


def test_a_new_call_from_a_one_statement_loop_body_is_the_next_iteration(tmp_path):
    """All iterations of `h = layer(h)` run on line 4 with no other statement between: each new call of
    `layer` starts the next execution of the statement, which rebinds h."""
    path = tmp_path / "loop.py"
    path.write_text(LAYER_LOOP_SOURCE)
    f = str(path)
    ops = [(0, ((f, 2, "model"),), (70,), (1,))]                     # h = stem(x)
    for k in range(3):                                                # layer k: ops 1+2k, 2+2k
        ops += [(1 + 2 * k, ((f, 4, "model"), (f, 9, "layer")), (71 + 2 * k,), (70 + 2 * k,)),
                (2 + 2 * k, ((f, 4, "model"), (f, 10, "layer")), (72 + 2 * k,), (71 + 2 * k,))]
    holds = local_holds(ops)
    assert holds[70] == 2                         # the stem's h: until the first layer's call returns
    assert holds[72] == 4                         # layer 0's output: until layer 1's returns
    assert holds[76] == 6                         # the last: until model returns


RETURNED_SOURCE = textwrap.dedent('''\
    def encoder(x):
        out = stage(x)
        y = out[0].contiguous()
        z = g(y)
        return z


    def stage(x):
        h = patch(x)
        if interpolate:
            h = h + interp(h)
        else:
            h = h + pos
        normed = norm(h)
        before = normed
        outputs = (normed, before)
        if output_attentions:
            outputs += (attn,)
        return outputs
''')


def test_a_local_bound_to_a_call_holds_what_the_call_returned_through_statements_without_ops(tmp_path):
    """`outputs = (normed, before)` and `before = normed` run no op; `h = h + pos` ran in the else branch,
    and `outputs += (attn,)` under an `if` ran nothing, so it is not taken to have run."""
    path = tmp_path / "returned.py"
    path.write_text(RETURNED_SOURCE)
    f = str(path)
    outer = (f, 2, "encoder")
    ops = [
        (0, (outer, (f, 9, "stage")), (80,), (1,)),       # h = patch(x)
        (1, (outer, (f, 13, "stage")), (81,), (80,)),     # h = h + pos (else branch)
        (2, (outer, (f, 14, "stage")), (82,), (81,)),     # normed = norm(h): what stage returns
        (3, ((f, 3, "encoder"),), (83,), (82,)),          # y = out[0].contiguous(): last read of normed
        (4, ((f, 4, "encoder"),), (84,), (83,)),
        (5, ((f, 4, "encoder"),), (85,), (84,)),
    ]
    holds = local_holds(ops)
    assert holds[82] == 5                         # held by `out` until encoder returns, past its last read
    assert holds[81] == 2                         # h: until stage returns; not returned
    assert holds[80] == 1


_RECORDED_MODEL = '''
import torch
import torch.nn.functional as F


class Double(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        doubled = x * 2
        return doubled

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


class Model(torch.nn.Module):
    def forward(self, x):
        h = torch.relu(x)
        if h.shape[0] > 100:
            h = None
        h = F.softmax(h, -1)
        return Double.apply(h)


def outside(x):
    y = x + 1
    return y
'''


def _recorded_model(tmp_path):
    import importlib.util

    path = tmp_path / "recorded_model.py"
    path.write_text(_RECORDED_MODEL)
    spec = importlib.util.spec_from_file_location("recorded_model", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module, str(path), {text.strip(): n for n, text in enumerate(_RECORDED_MODEL.splitlines(), start=1)}


def test_executed_lines_are_the_root_forwards_own_and_its_custom_functions(tmp_path):
    """With a root module, the lines that run are recorded while its forward runs (a custom Function's
    forward is the model's code too), not the branch it skips, and not model-file code run outside it."""
    import torch

    from tracer.capture.pylocals import record_executed_lines

    module, path, lines_of = _recorded_model(tmp_path)
    model = module.Model()
    with record_executed_lines(lambda f: f == path, model) as executed:
        model(torch.ones(3))
        module.outside(torch.ones(3))
    ran = {line for file, line in executed.lines if file == path}
    assert executed.complete
    assert {lines_of["h = torch.relu(x)"], lines_of["doubled = x * 2"], lines_of["return Double.apply(h)"]} <= ran
    assert lines_of["h = None"] not in ran
    assert lines_of["y = x + 1"] not in ran


def test_a_c_torch_call_runs_untraced_and_a_python_one_traced(tmp_path):
    """UntracedCall (what the direct trace's torch function mode runs each call in): the executed-lines
    trace is off while a C function (relu, mul) runs, on for a Python torch function (F.softmax, which
    could call model code), and the lines around the calls are still recorded."""
    import sys

    import torch

    from tracer.capture.pylocals import UntracedCall, record_executed_lines

    module, path, lines_of = _recorded_model(tmp_path)
    trace_inside: dict = {}

    class Probe(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            with UntracedCall(func):
                trace_inside.setdefault(getattr(func, "__name__", str(func)), sys.gettrace())
                return func(*args, **(kwargs or {}))

    model = module.Model()
    with record_executed_lines(lambda f: f == path, model) as executed, Probe():
        model(torch.ones(3))
    ran = {line for file, line in executed.lines if file == path}
    assert trace_inside["relu"] is None and trace_inside["mul"] is None
    assert trace_inside["softmax"] is not None
    assert {lines_of["h = F.softmax(h, -1)"], lines_of["doubled = x * 2"], lines_of["return doubled"],
            lines_of["return Double.apply(h)"]} <= ran


def test_untraced_call_leaves_another_trace_function_running():
    """A debugger's or coverage's trace function is not paused by UntracedCall."""
    import sys

    import torch

    from tracer.capture.pylocals import UntracedCall

    def other(frame, event, arg):
        return None

    previous = sys.gettrace()
    sys.settrace(other)
    try:
        with UntracedCall(torch.relu):
            inside = sys.gettrace()
    finally:
        sys.settrace(previous)
    assert inside is other
