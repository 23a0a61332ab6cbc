"""Rank 0 of N: a model that splits itself over `torch.distributed`'s ranks, captured as one rank runs it.

    rank_zero_of(ranks)            while active, torch.distributed's default group has `ranks` ranks and
                                   this process is rank 0 (a fake group: nothing is sent)
    collective_ops(graph)          the captured step's collective ops, by name

Expert parallelism is written into the model: torchtitan's MoE, for one, builds `experts / world_size`
experts on each rank, sorts the routed tokens by expert, exchanges the per-expert counts and then the
tokens with all-to-all (`all_to_all_single`, `all_to_all_single_autograd`), runs its own experts on what it
received and sends the results back the same way. What one rank holds is therefore the model's own code
run as one rank: its experts, the tokens it receives, the exchange's buffers. `--ep N` builds and steps the
model as rank 0 of N ranks of torch's fake process group (`torch.testing._internal.distributed.fake_pg`),
under which every collective returns at once. Under fake tensors a collective is an op like any other:
its output is allocated by the op, its input is read, its autograd saves what torch's saves, so the
capture records what a real rank allocates and frees. An `hf:` model with an expert-parallel plan is split
by transformers' own plan under the group (tracer/models/hf.py), as `from_pretrained` with a
`DistributedConfig(ep_size=N)` splits it; its experts become DTensor parameters, counted by their shards
(capture/storages.py).

What the other ranks do is assumed to be what rank 0 does (symmetric ranks): each holds a batch of the
same shape and routes it by the same `--moe-routing` assumption. The sizes a collective decides follow
from that (capture/routing.py): rank 0 receives from every rank what it sends to itself (all-to-all), and
a sum over the group is N times its own value. torch's functional collectives take another code path
under a tracing or fake mode (they wait at once instead of returning torch's AsyncCollectiveTensor); the
wrapper holds no memory of its own, so the bytes are the same.

Not modelled: a rank whose batch or routing differs from rank 0's (uneven per-rank batches, a router that
sends rank 0 more than the assumption says: use --moe-routing worst or a FILE for that), process groups
other than the default one with its N ranks (a device mesh over `--ep` ranks works, since it is made from
the default group), and the communication library's own buffers (NCCL's are counted per communicator by
the device view).
"""
from __future__ import annotations

import contextlib
import sys

from tracer.errors import UsageError

COLLECTIVE_NAMESPACES = ("c10d.", "_c10d_functional.", "_c10d_functional_autograd.", "_dtensor.")


@contextlib.contextmanager
def rank_zero_of(ranks: int, flag: str = "--ep"):
    """torch.distributed's default process group of `ranks` fake ranks, this process rank 0, while active;
    nothing for one rank. Re-entered (the same group already made here) it does nothing. Raises UsageError
    when this process already belongs to a real group."""
    if ranks <= 1:
        yield
        return
    import torch.distributed as dist
    if dist.is_initialized():
        if _is_fake_group_of(dist, ranks):
            yield
            return
        raise UsageError(f"{flag} {ranks}: this process already belongs to a torch.distributed process group "
                         f"({dist.get_backend()}, {dist.get_world_size()} ranks)",
                         hint=f"run tracer in a process of its own; it makes its own fake group of {flag} ranks")
    from torch.testing._internal.distributed.fake_pg import FakeStore
    excepthook = sys.excepthook
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=ranks)
    sys.excepthook = excepthook          # init_process_group prefixes every traceback with "[rank0]:"
    try:
        yield
    finally:
        dist.destroy_process_group()


def _is_fake_group_of(dist, ranks: int) -> bool:
    try:
        return dist.get_backend() == "fake" and dist.get_world_size() == ranks
    except (RuntimeError, ValueError):
        return False


def collective_ops(graph) -> tuple[str, ...]:
    """The distinct collective ops (c10d's, the functional collectives') the step runs, in step order; a
    joint graph runs c10d's in-place ones inside `with_effects(token, "c10d.op", ...)`."""
    names = (op.args[1] if op.target == "with_effects" and len(op.args) > 1 and isinstance(op.args[1], str)
             else op.target for op in graph.ops)
    return tuple(dict.fromkeys(name for name in names if name.startswith(COLLECTIVE_NAMESPACES)))


def no_collective_error(ranks: int, model: str) -> UsageError:
    return UsageError(f"--ep {ranks}: {model} made no torch.distributed collective call, so each of the {ranks} "
                      f"ranks would hold the whole model: its experts are not split over the ranks",
                      hint="build the experts over dist.get_world_size() ranks and exchange the routed tokens "
                           "with all-to-all, as torchtitan's MoE does (docs: Expert parallelism); or drop --ep")
