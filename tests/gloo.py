"""Real multi-process steps for the accuracy tests: `ranks` CPU processes joined by a gloo process group,
each running `measure(rank)` and handing back what it returns (JSON)."""
from __future__ import annotations

import json
import os
import socket


def run_ranks(measure, ranks: int, out_dir: str) -> list:
    """[measure(rank) for each rank], each run in its own spawned process of a gloo group of `ranks`.
    `measure` must be a module-level function (the processes are spawned)."""
    import torch.multiprocessing as mp
    mp.spawn(_rank, args=(measure, ranks, free_port(), out_dir), nprocs=ranks, join=True)
    results = []
    for rank in range(ranks):
        with open(os.path.join(out_dir, f"rank{rank}.json")) as f:
            results.append(json.load(f))
    return results


def _rank(rank: int, measure, ranks: int, port: int, out_dir: str) -> None:
    import torch.distributed as dist
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    try:
        result = measure(rank)
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(result, f)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
