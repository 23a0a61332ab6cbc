"""Every file tracer writes goes through `write_output`: a temporary file in the same folder, flushed and
fsynced, then renamed over the target (`os.replace`, atomic on POSIX and Windows within one file system).

    write_output(path, data: str | bytes, *, what: str) -> None

A reader, a concurrent writer or a failed write (disk full, a file-size limit, a crash, Ctrl-C) therefore
sees either the old file whole or the new file whole, never a mix or a truncated one; a failed write leaves
no temporary file behind. Two processes writing the same path: the last rename wins, whole.
The new file gets the permissions `open()` would give it (0666 less the umask). Raises UsageError naming
`what` and the path when the folder cannot be written. Not handled: a target that is a symlink is
replaced by a regular file (the link is not followed).
"""
from __future__ import annotations

import os
import tempfile

from tracer.errors import UsageError


def write_output(path, data: str | bytes, *, what: str) -> None:
    path = os.fspath(path)
    payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
    folder = os.path.dirname(os.path.abspath(path))
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
