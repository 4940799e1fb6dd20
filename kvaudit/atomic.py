"""Atomic file writes: a reader sees the old file or the whole new one, never a part. Standard
library only, so that the entry point can write ``kvaudit ci``'s reports while the rest of kvaudit
is still being imported (:func:`kvaudit.app.interrupts.write_startup_reports`);
:mod:`kvaudit.replay` re-exports both."""

from __future__ import annotations

import os
import tempfile


def write_bytes_atomic(path: str, data: bytes, durable: bool = True) -> str:
    """Write ``data`` to ``path`` via a temporary file in the same directory, fsync and
    ``os.replace``: a reader sees the old file or the whole new one, never a part (``durable``
    False: no fsync -- still whole after a crash of the process, not of the machine; for corpus
    inputs, written hundreds of times a minute). A missing directory is created as ``path`` names it:
    resolved by the system, as the file's own path is (``abspath`` would fold ``link/..`` first and
    create the directory beside the link instead of where the file goes). Raises OSError."""
    d = os.path.dirname(path) or os.curdir
    os.makedirs(d, exist_ok=True)
    d = os.path.realpath(d)  # (mkstemp folds its dir lexically too)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=d)
    umask = os.umask(0)
    os.umask(umask)
    try:
        os.fchmod(fd, 0o666 & ~umask)  # mkstemp makes 0600; a report is an ordinary file
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def write_text_atomic(path: str, text: str, durable: bool = True) -> str:
    """:func:`write_bytes_atomic` of ``text`` in UTF-8. Raises OSError (UnicodeEncodeError for a
    lone surrogate)."""
    return write_bytes_atomic(path, text.encode("utf-8"), durable)
