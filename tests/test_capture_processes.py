"""tracer.pipeline.capture_processes: the pool of processes a command's captures run in."""
import os
import sys

import torch

from tracer.pipeline import capture_processes


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
