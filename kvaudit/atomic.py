"""Atomic file writes, and scratch directories an interrupt does not leave behind. Standard library only: the entry point writes ``kvaudit ci``'s reports with
them while the rest of kvaudit is still being imported; :mod:`kvaudit.replay` re-exports both."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile


def write_bytes_atomic(path: str, data: bytes, durable: bool = True) -> str:
    """Write ``data`` to ``path`` via a temporary file, fsync and ``os.replace``: a reader sees the old
    file or the whole new one (``durable`` False: no fsync, whole after a process crash only). A missing
    directory is made. Raises OSError."""
    d = os.path.dirname(path) or os.curdir
    os.makedirs(d, exist_ok=True)
    d = os.path.realpath(d)  # NOTE: not abspath: it folds link/.. lexically (mkstemp too)
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
    """Raises OSError (UnicodeEncodeError for a lone surrogate)."""
    return write_bytes_atomic(path, text.encode("utf-8"), durable)


_INTERRUPTS = {signal.SIGINT, signal.SIGTERM}


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A new directory in the temp dir (its path), removed on the way out, also when Ctrl-C or SIGTERM (a
    KeyboardInterrupt) lands inside ``mkdtemp`` after it made the directory, or while it is being removed:
    ``TemporaryDirectory`` left the directory there in both cases. The signals are held while the directory
    is made (delivered as soon as it is, inside the ``try``); a removal cut short is finished, then the
    interrupt goes on."""
    hold = hasattr(signal, "pthread_sigmask")
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _INTERRUPTS) if hold else None
    try:
        path = tempfile.mkdtemp(prefix=prefix)
    except BaseException:
        if hold:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        raise
    try:
        if hold:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)  # NOTE: an interrupt held meanwhile is raised here
        yield path
    finally:
        try:
            shutil.rmtree(path, ignore_errors=True)
        except KeyboardInterrupt:
            shutil.rmtree(path, ignore_errors=True)
            raise
