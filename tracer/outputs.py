"""Every file tracer writes goes through `write_output`: a temporary file in the same folder, flushed and
fsynced, then renamed over the target (`os.replace`, atomic on POSIX and Windows within one file system).

    write_output(path, data: str | bytes, *, what: str) -> None

    write_output_dir(path, files: dict[str, str | bytes], *, what: str) -> None

A reader, a concurrent writer or a failed write (disk full, a file-size limit, a crash, Ctrl-C) therefore
sees either the old file whole or the new file whole, never a mix or a truncated one; a failed write leaves
no temporary file behind. Two processes writing the same path: the last rename wins, whole.
The new file gets the permissions `open()` would give it (0666 less the umask). Raises UsageError naming
`what` and the path when the folder cannot be written.

What the path names decides how it is written:
- a regular file, or nothing yet: replaced atomically as above;
- a symlink (to a file, or dangling): the file it points to is replaced atomically; the link stays;
- a device, a FIFO or a socket (`/dev/null`, a terminal, a pipe), or a file descriptor's link
  (`/dev/stdout`, `/dev/fd/N`, `/proc/self/fd/N`, whatever it leads to): written through in place, appended,
  never replaced: `--json /dev/stdout` prints the report and `--json /dev/null` discards it. Python's own
  stdout and stderr are flushed first, so the output keeps its order.
`write_output_dir` makes a folder of files whole or not at all: every file is written into a temporary
folder beside it first, then moved in by rename (which needs no space), so a full disk leaves the folder
as it was. Files of other names already in the folder are left alone.
"""
from __future__ import annotations

import os
import shutil
import stat
import sys
import tempfile

from tracer.errors import UsageError


# folders whose entries are file descriptors' links: what they lead to is already open by this process
_DESCRIPTOR_FOLDERS = ("/dev/fd", "/proc/self/fd", f"/proc/{os.getpid()}/fd", "/proc/thread-self/fd")
_DESCRIPTOR_NAMES = ("/dev/stdout", "/dev/stderr", "/dev/stdin")


def write_output(path, data: str | bytes, *, what: str) -> None:
    path = os.fspath(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    if _written_through(path):
        _write_through(path, payload, what)
        return
    path = os.path.realpath(path)              # a symlink: its file is replaced, the link stays
    folder = os.path.dirname(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
        tmp = None
    except OSError as exc:
        raise UsageError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc
    finally:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _written_through(path: str) -> bool:
    """A device, FIFO or socket, or a file descriptor's link: written in place, never replaced."""
    if any(hop in _DESCRIPTOR_NAMES or os.path.dirname(hop) in _DESCRIPTOR_FOLDERS for hop in _link_hops(path)):
        return True
    try:
        mode = os.stat(path).st_mode            # follows links
    except OSError:
        return False                            # nothing there yet (or a dangling link): a new file
    return not stat.S_ISREG(mode) and not stat.S_ISDIR(mode)


def _link_hops(path: str, most: int = 40) -> list[str]:
    """`path` and every path its symlinks lead through, absolute, in order."""
    hops = [os.path.abspath(path)]
    while len(hops) < most and os.path.islink(hops[-1]):
        target = os.readlink(hops[-1])
        hops.append(os.path.abspath(os.path.join(os.path.dirname(hops[-1]), target)))
    return hops


def _write_through(path: str, payload: bytes, what: str) -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError, AttributeError):
            pass
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view):]
        finally:
            os.close(fd)
    except OSError as exc:
        raise UsageError(f"cannot write {what} {path}: {exc.strerror or exc}") from exc


def write_output_dir(path, files: dict[str, str | bytes], *, what: str) -> None:
    """Write `files` (name -> contents) into the folder `path`, whole or not at all (module docstring)."""
    out = os.path.realpath(os.fspath(path))
    parent = os.path.dirname(out)
    try:
        os.makedirs(parent, exist_ok=True)
        staging = tempfile.mkdtemp(prefix="." + os.path.basename(out) + ".", suffix=".tmp", dir=parent)
    except OSError as exc:
        raise UsageError(f"cannot create {what} {out}: {exc.strerror or exc}") from exc
    try:
        for name, data in files.items():
            write_output(os.path.join(staging, name), data, what=what)
        os.chmod(staging, 0o777 & ~_umask())
        try:
            os.rename(staging, out)              # no folder there yet: it appears whole
            staging = None
            return
        except OSError:
            if not os.path.isdir(out):
                raise
        for name in files:                       # a folder there already: each file moved in by rename
            os.replace(os.path.join(staging, name), os.path.join(out, name))
    except OSError as exc:
        raise UsageError(f"cannot write {what} {out}: {exc.strerror or exc}") from exc
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
