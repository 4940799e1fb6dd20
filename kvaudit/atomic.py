"""Atomic file writes, and scratch directories an interrupt does not leave behind. Standard library only:
the entry point writes ``kvaudit ci``'s reports with them while the rest of kvaudit is still being
imported; :mod:`kvaudit.replay` re-exports the writes."""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import tempfile


def fd_link(path: str) -> str | None:
    """The link on ``path``'s way to its file that names an open file descriptor (``/dev/stdout``,
    ``/dev/fd/1``, ``/proc/self/fd/1``, or a link to one of them), else None. Such a path has no file of its own
    to replace: renaming over it replaced the link itself (``/dev/stdout`` for every process, as root)."""
    p = os.path.abspath(path)
    for _ in range(40):  # (the kernel's own limit on a chain of links)
        p = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))  # (a link to /proc/self/fd/)
        if not os.path.islink(p):
            return None
        if p.startswith(("/dev/", "/proc/")):
            return p
        p = os.path.normpath(os.path.join(os.path.dirname(p), os.readlink(p)))
    return None


def write_bytes_atomic(path: str, data: bytes, durable: bool = True) -> str:
    """Write ``data`` to ``path`` via a temporary file, fsync and ``os.replace``: a reader sees the old
    file or the whole new one (``durable`` False: no fsync, whole after a process crash only). A missing
    directory is made; a file written over keeps its permission bits (0o777: no setuid, setgid or sticky bit)
    and, where the writer may give it, its owner and group; a new one has the umask's mode. A symbolic
    link stays one: the file it names is the one replaced (or made). Raises OSError, naming ``path`` where
    the failure was the file's (a full disk at the write, fsync or close of the temporary, which names no
    file or the temporary)."""
    target = os.path.realpath(path)  # NOTE: not abspath: it folds link/.. lexically (mkstemp too)
    d = os.path.dirname(target)
    os.makedirs(d, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=os.path.splitext(path)[1], dir=d)
    try:
        old = os.stat(target)
    except OSError:
        old = None
    if old is not None:
        mode = old.st_mode & 0o777  # NOTE: a file written over keeps its permissions (600 stays), no setuid bit
    else:
        umask = os.umask(0)
        os.umask(umask)
        mode = 0o666 & ~umask
    try:
        os.fchmod(fd, mode)  # mkstemp makes 0600; a report is an ordinary file
        if old is not None and (old.st_uid, old.st_gid) != (os.geteuid(), os.getegid()):
            with contextlib.suppress(OSError):  # (best effort: a root's run over a user's file leaves it theirs)
                os.fchown(fd, old.st_uid, old.st_gid)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            if durable:
                os.fsync(fh.fileno())
        os.replace(tmp, target)
    except BaseException as e:
        if os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(e, OSError) and e.errno is not None and e.filename in (None, tmp):
            raise OSError(e.errno, e.strerror, path) from e  # (callers name the file the user asked for)
        raise
    return path


def write_text_atomic(path: str, text: str, durable: bool = True) -> str:
    """Raises OSError (UnicodeEncodeError for a lone surrogate)."""
    return write_bytes_atomic(path, text.encode("utf-8"), durable)


@contextlib.contextmanager
def scratch_dir(prefix: str):
    """A new directory in the temp dir (its path), removed on the way out, also when Ctrl-C or SIGTERM (a
    KeyboardInterrupt) lands right after the directory was made, or while it is being removed: in both cases
    ``TemporaryDirectory`` left it there (``mkdtemp`` can be interrupted after its mkdir, before it returns
    the name). Here the name is chosen first, so the ``finally`` knows what to remove; a removal cut short is
    finished, then the interrupt goes on."""
    base = tempfile.gettempdir()
    path = os.path.join(base, prefix + secrets.token_hex(6))
    while os.path.lexists(path):
        path = os.path.join(base, prefix + secrets.token_hex(6))
    try:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:  # another process's, made since the check: not ours to remove
            path = None
            raise
        yield path
    finally:
        if path is not None:
            try:
                shutil.rmtree(path, ignore_errors=True)
            except KeyboardInterrupt:
                shutil.rmtree(path, ignore_errors=True)
                raise
