"""Kernel scratch of the CPU flash-attention kernels (tracer.capture.kernel_scratch) against the allocations
the real kernels make, seen by the profiler's allocator events: every allocation of one call minus its
outputs is scratch."""
import pytest
import torch
import torch.fx as fx

from tracer.capture.kernel_scratch import eager_scratch_allocations, scratch_allocations

FORWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _allocations(call) -> tuple[list[int], object]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        result = call()
    return [e.nbytes() for e in prof.profiler.kineto_results.events() if e.name() == "[memory]" and e.nbytes() > 0], result


def _node(target, *values) -> fx.Node:
    """A one-op fx graph whose tensor arguments carry the given values as `meta["val"]`."""
    graph = fx.Graph()
    args = []
    for i, value in enumerate(values):
        if isinstance(value, torch.Tensor):
            placeholder = graph.placeholder(f"arg{i}")
            placeholder.meta["val"] = value
            args.append(placeholder)
        else:
            args.append(value)
    return graph.call_function(target, tuple(args))


def _nbytes(*tensors) -> list[int]:
    return [t.untyped_storage().nbytes() for t in tensors]


@pytest.fixture
def threads():
    """The intra-op thread count of the case, restored afterwards."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


# (batch, heads, kv heads, seq, head dim, causal, gradient laid out (batch, seq, heads, dim)); seq 128, 256
# and 800 take the three query block sizes (32, 64, 256), 800 also cuts the keys into blocks of 512
CASES = [(2, 4, 2, 256, 16, True, True), (2, 4, 4, 128, 16, True, False), (1, 2, 2, 800, 32, False, True),
         (2, 4, 4, 300, 24, False, False)]


@pytest.mark.parametrize("batch, heads, kv_heads, seq, head_dim, causal, transposed_grad", CASES)
def test_one_thread_scratch_equals_what_the_kernels_allocate(batch, heads, kv_heads, seq, head_dim, causal,
                                                              transposed_grad, threads):
    threads(1)
    q = torch.randn(batch, heads, seq, head_dim)
    k, v = torch.randn(2, batch, kv_heads, seq, head_dim)
    allocated, (out, lse) = _allocations(lambda: FORWARD(q, k, v, 0.0, causal))
    assert allocated == _nbytes(out, lse) + list(scratch_allocations(_node(FORWARD, q, k, v, 0.0, causal), 1))

    grad = torch.randn(batch, seq, heads, head_dim).transpose(1, 2) if transposed_grad else torch.randn_like(out)
    allocated, grads = _allocations(lambda: BACKWARD(grad, q, k, v, out, lse, 0.0, causal))
    node = _node(BACKWARD, grad, q, k, v, out, lse, 0.0, causal)
    assert allocated == _nbytes(*grads) + list(scratch_allocations(node, 1))


def test_scratch_grows_with_threads_and_the_profiler_misses_the_worker_threads_row_sums(threads):
    """Two threads: twice the block buffers, all seen; each thread's row sums, only the calling thread's seen."""
    threads(2)
    q, k, v = torch.randn(3, 2, 4, 256, 16)
    allocated, (out, lse) = _allocations(lambda: FORWARD(q, k, v, 0.0, True))
    forward = scratch_allocations(_node(FORWARD, q, k, v, 0.0, True), 2)
    assert allocated == _nbytes(out, lse) + list(forward)
    assert forward == (2 * 4 * (64 * 256 + 2 * 64 + 64 * 16),)

    grad = torch.randn(2, 256, 4, 16).transpose(1, 2)
    allocated, grads = _allocations(lambda: BACKWARD(grad, q, k, v, out, lse, 0.0, True))
    backward = scratch_allocations(_node(BACKWARD, grad, q, k, v, out, lse, 0.0, True), 2)
    assert backward == (2 * 2 * 64 * 256 * 4, 64 * 4, 64 * 4)
    assert allocated == _nbytes(*grads) + list(backward[:-1])


def test_checkpointing_rng_wrappers_are_the_kernel_they_wrap():
    from torch._prims.rng_prims import run_and_save_rng_state, run_with_rng_state
    q, k, v = torch.randn(3, 1, 2, 64, 8)
    plain = scratch_allocations(_node(FORWARD, q, k, v, 0.0, True), 2)
    graph = fx.Graph()
    inputs = []
    for name, value in zip("qkv", (q, k, v)):
        inputs.append(graph.placeholder(name))
        inputs[-1].meta["val"] = value
    saving = graph.call_function(run_and_save_rng_state, (FORWARD, *inputs, 0.0, True))
    replaying = graph.call_function(run_with_rng_state, (graph.placeholder("rng"), FORWARD, *inputs, 0.0, True))
    assert plain and scratch_allocations(saving, 2) == scratch_allocations(replaying, 2) == plain


def test_reduced_precision_and_other_ops_have_no_modelled_scratch():
    q, k, v = torch.randn(3, 1, 2, 64, 8, dtype=torch.bfloat16)
    assert scratch_allocations(_node(FORWARD, q, k, v, 0.0, True), 2) == ()
    assert scratch_allocations(_node(torch.ops.aten.mm.default, q[0, 0], k[0, 0].T), 2) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(2, 2), (64, 64), (300, 300), (3, 40, 40)])
def test_eigh_workspace_is_what_lapack_asks_for(dtype, shape):
    """torch.linalg.eigh on the CPU: one LAPACK workspace query per call (batched or not), then a work array of
    the matrix's dtype and an int array, both allocated through the allocator and freed before it returns;
    everything else the call allocates is its outputs (eigenvalues, eigenvectors, one int of info per
    matrix) and two 1-byte checks."""
    matrix = torch.eye(shape[-1], dtype=dtype).expand(shape).contiguous()
    allocated, (values, vectors) = _allocations(lambda: torch.ops.aten._linalg_eigh.default(matrix, "L", True))
    fake = torch.empty(shape, dtype=dtype, device="meta")
    predicted = eager_scratch_allocations("aten._linalg_eigh.default", (fake, "L", True), {})
    info_bytes = 4 * (shape[0] if len(shape) == 3 else 1)
    assert sorted(allocated) == sorted([*predicted, *_nbytes(values, vectors), info_bytes, 1, 1 if len(shape) == 2 else 3])


def test_eigenvalues_alone_are_not_modelled():
    """`eigvalsh`'s workspace is MKL's own block size times n: no scratch is claimed for it."""
    fake = torch.empty(64, 64, device="meta")
    assert eager_scratch_allocations("aten._linalg_eigh.default", (fake, "L", False), {}) == ()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape,mode", [((1000, 1000), "reduced"), ((300, 200), "reduced"), ((200, 300), "reduced"),
                                        ((300, 200), "complete"), ((4, 64, 64), "reduced"), ((3, 1, 1), "reduced")])
def test_qr_workspaces_are_what_lapack_asks_for(dtype, shape, mode):
    """torch.linalg.qr on the CPU: besides Q and R it allocates tau (min(m, n) values per matrix), live through
    the call, and geqrf's then orgqr's work arrays, one after the other, each sized by a LAPACK workspace
    query. The prediction is tau and the larger work array, asked of the same LAPACK by its own query."""
    matrix = torch.randn(shape, dtype=dtype)
    allocated, (q, r) = _allocations(lambda: torch.ops.aten.linalg_qr.default(matrix, mode))
    scratch = list(allocated)
    for nbytes in _nbytes(q, r):
        scratch.remove(nbytes)
    tau, geqrf, orgqr = scratch
    fake = torch.empty(shape, dtype=dtype, device="meta")
    assert eager_scratch_allocations("aten.linalg_qr.default", (fake, mode), {}) == (tau, max(geqrf, orgqr))
    assert scratch_allocations(_node(torch.ops.aten.linalg_qr.default, fake, mode), 2) == (tau, max(geqrf, orgqr))


QR_STEP = '''
import torch
from torch import nn


class QrSGD(torch.optim.SGD):
    @torch.no_grad()
    def step(self):
        for p in self.param_groups[0]["params"]:
            if p.dim() == 2:
                torch.linalg.qr(p.grad, mode=MODE)
        return super().step()


def build_model():
    return nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 4))


def example_batch(batch, seq):
    return torch.randn(batch, 32), torch.randn(batch, 4)


def loss_fn(out, y):
    return ((out - y) ** 2).mean()


def make_optimizer(params):
    return QrSGD(params, lr=0.1)
'''


@pytest.mark.parametrize("mode,flagged", [("reduced", False), ("complete", False), ("r", True)])
def test_a_qr_whose_workspace_is_counted_is_not_flagged(tmp_path, mode, flagged):
    """The report's "kernel scratch not counted" names torch.linalg.qr only where its workspaces are not in the
    step (mode "r"); a reduced or complete QR's are counted (the workspace query above)."""
    from tracer.capture import CaptureOptions, capture_step, load_model_source
    path = tmp_path / "qr_step.py"
    path.write_text(QR_STEP.replace("MODE", repr(mode)))
    graph = capture_step(load_model_source(str(path)), CaptureOptions(batch=2, seq=8, target="cpu"))
    notes = [n for n in graph.config.notes if n.startswith("kernel scratch not counted")]
    assert bool(notes and "torch.linalg.qr" in notes[0]) is flagged
    scratch = [s for s in graph.storages if s.name.startswith("kernel scratch of aten.linalg_qr")]
    assert bool(scratch) is not flagged


QR_FORWARD = '''
import torch
import torch.nn.functional as F
from torch import nn


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.randn(128, 128))
        self.head = nn.Linear(128, 10)

    def forward(self, x, y):
        q, _ = torch.linalg.qr(self.w)
        return F.cross_entropy(self.head(x @ q), y)


def build_model():
    return Net()


def example_batch(batch, seq):
    return torch.randn(batch, 128), torch.randint(0, 10, (batch,))
'''


def test_the_op_by_op_step_counts_lapacks_workspace_on_a_cpu_target_only(tmp_path):
    """A QR in forward, run op by op: for a CPU target its LAPACK workspaces are in the forward peak, which
    equals the CPU allocator's in a real step; a CUDA step runs cuSOLVER instead, whose workspace is not
    the CPU's, so none is counted there (the graph rung's CUDA step has the same forward peak)."""
    from tracer.capture import CaptureOptions, PolicySpec, capture_steps, load_model_source
    from tracer.passes.analysis import analyze_graphs
    from truth import measure_step_at_allocator

    path = tmp_path / "qr_forward.py"
    path.write_text(QR_FORWARD)
    source = load_model_source(str(path))

    def forward_peak(capture: str, target: str) -> int:
        options = CaptureOptions(batch=4, seq=1, capture=capture, target=target)
        graphs = capture_steps(source, options, (PolicySpec(name="eager"),))
        return analyze_graphs(graphs).policies["eager"].phases["forward"].peak_bytes

    torch.manual_seed(0)
    real = source.build_model()
    measured = measure_step_at_allocator(real, source.example_batch(4, 1), torch.optim.AdamW(real.parameters()))
    assert forward_peak("dispatch", "cpu") == measured["forward"]
    assert forward_peak("dispatch", "cuda") == forward_peak("export", "cuda") < measured["forward"]
