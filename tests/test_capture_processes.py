"""tracer.pipeline.capture_processes: the pool of processes a command's captures run in."""
import os
import sys
import time

import pytest
import torch

from tracer.errors import UsageError
from tracer.pipeline import capture_processes, results_side_by_side


def _where_it_runs():
    from tracer.capture.triton_target import intra_op_threads
    return os.getppid(), intra_op_threads(), torch.get_num_threads(), "tracer.capture" in sys.modules


def test_forked_processes_inherit_this_ones_imports_run_on_one_thread_and_model_its_threads():
    import tracer.capture  # noqa: F401 - what the forked processes inherit
    threads = torch.get_num_threads()
    with capture_processes(2, forked=True) as pool:
        answers = [pool.submit(_where_it_runs).result() for _ in range(4)]
    assert answers == [(os.getpid(), threads, 1, True)] * 4


def test_a_spawned_process_runs_and_models_its_own_threads():
    with capture_processes(1) as pool:
        parent, modelled, runs, _ = pool.submit(_where_it_runs).result()
    assert parent == os.getpid() and modelled == runs


def _pid_after(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _refuse(seconds: float) -> int:
    raise UsageError(f"refused after {seconds} s")


def test_calls_side_by_side_keep_their_order_and_this_process_runs_those_no_worker_is_free_for():
    """Two workers and three calls: the third runs here at once instead of waiting for a worker."""
    with capture_processes(2, forked=True) as pool:
        pids = results_side_by_side(pool, 2, [(_pid_after, (1.0,))] * 3)
    assert pids[2] == os.getpid() and os.getpid() not in pids[:2]


def test_an_error_in_a_call_side_by_side_is_raised_with_its_type():
    with capture_processes(1, forked=True) as pool:
        with pytest.raises(UsageError, match="refused after 0.1"):
            results_side_by_side(pool, 1, [(_pid_after, (0.1,)), (_refuse, (0.1,)), (_pid_after, (0.1,))])
