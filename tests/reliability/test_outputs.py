"""Writes are atomic (tracer.outputs.write_output, used by every output): a failed write keeps the old
file whole and leaves no temporary file; concurrent writers leave one whole file; a failing graphviz
writes no report file."""
import errno
import json
import multiprocessing
import os

import pytest

from conftest import TINY, model
from tracer.errors import ExitCode, UsageError
from tracer.outputs import write_output


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    path = tmp_path / "baseline.json"
    path.write_text('{"good": true}')

    def disk_full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(os, "fsync", disk_full)
    with pytest.raises(UsageError, match="cannot write baseline .*No space left on device"):
        write_output(path, "x" * 100_000, what="baseline")
    assert path.read_text() == '{"good": true}'
    assert os.listdir(tmp_path) == ["baseline.json"]


def test_new_files_get_the_usual_permissions(tmp_path):
    write_output(tmp_path / "a.json", "{}", what="--json")
    mask = os.umask(0)
    os.umask(mask)
    assert os.stat(tmp_path / "a.json").st_mode & 0o777 == 0o666 & ~mask


def _writer(path, payload, rounds):
    for _ in range(rounds):
        write_output(path, payload, what="--json")


def test_concurrent_writers_leave_one_whole_file(tmp_path):
    path = str(tmp_path / "report.json")
    payloads = [json.dumps({"writer": i, "pad": "x" * 200_000}) for i in range(2)]
    ctx = multiprocessing.get_context("fork")
    procs = [ctx.Process(target=_writer, args=(path, p, 40)) for p in payloads]
    for p in procs:
        p.start()
    seen = 0
    while any(p.is_alive() for p in procs):
        if os.path.exists(path):
            with open(path) as f:
                assert f.read() in payloads          # never a mix or a truncated file
            seen += 1
    for p in procs:
        p.join()
        assert p.exitcode == 0
    assert open(path).read() in payloads and os.listdir(tmp_path) == ["report.json"]


def test_a_failing_graphviz_writes_no_report_file(run_cli, tmp_path, monkeypatch):
    from tracer.errors import TracerError
    import tracer.reports.report_dir as report_dir

    def broken(dot):
        raise TracerError("graphviz `dot -Tsvg` failed: simulated")
    monkeypatch.setattr(report_dir, "dot_to_svg", broken)
    out = tmp_path / "rep"
    code, _, err = run_cli(model("tiny"), *TINY, "--report", out)
    assert code == ExitCode.ANALYSIS and "simulated" in err
    assert not out.exists() or os.listdir(out) == []
