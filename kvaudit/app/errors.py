"""The errors a command ends with, each a one-line message and an exit code (see :mod:`kvaudit.cli`)."""

from __future__ import annotations

import click

from kvaudit.constants import EXIT_UNAVAILABLE
from kvaudit.reports.outputs import disk_full

EXIT_CLEAN, EXIT_FINDINGS, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 70, 130
EXIT_NONDETERMINISTIC, EXIT_NOT_REPRODUCED, EXIT_DISK_FULL = 3, 4, 74
EXIT_NOTHING_SEARCHED = 5  # fuzz, ci: the search budget ended before one program ran (nothing checked: not clean)


class InputError(click.ClickException):
    exit_code = EXIT_USAGE


class DiskFull(click.ClickException):
    """``path`` not written (``why``: the OS's words), nor the files ``also`` names; ``kept``: what this run
    wrote, which stays."""

    exit_code = EXIT_DISK_FULL

    def __init__(self, path: str, why: str, kept: list[str] | tuple = (), also: list[str] | tuple = ()):
        self.path, self.why, self.kept, self.also = path, why, tuple(kept), tuple(also)
        super().__init__(f"disk full: cannot write {', '.join((path, *also))} ({why}); "
                         + (f"kept what was written: {', '.join(kept)}" if kept else "nothing else was written"))

    def keeping(self, more: list[str] | tuple, also: list[str] | tuple = ()) -> "DiskFull":
        """The same error, naming ``more`` files written after it among those kept, and ``also`` among those not
        written."""
        return DiskFull(self.path, self.why, (*self.kept, *more), (*self.also, *also))


def refused(e: click.ClickException) -> tuple[str, ...]:
    """The files ``e`` says a full disk refused (its path and ``also``), to name after an earlier one; none for
    another error."""
    return (e.path, *e.also) if isinstance(e, DiskFull) else ()


class NothingChecked(click.ClickException):
    """A run, or the file a run left, in which nothing was checked: not clean (exit 5)."""

    exit_code = EXIT_NOTHING_SEARCHED


class UnavailableError(click.ClickException):
    exit_code = EXIT_UNAVAILABLE


def unreadable(e: ValueError) -> click.ClickException:
    """The error for a replay or report file ``kvaudit.replay`` could not read (``e``, a ``ReplayFormatError``,
    its message one line naming the file): :class:`UnavailableError` (69) when it names a target kind not
    registered here (a plugin not loaded), :class:`NothingChecked` (5) for the ``--json`` of a run interrupted
    during start-up, else :class:`InputError` (2)."""
    from kvaudit import replay

    if isinstance(e, replay.TargetNotLoadedError):
        return UnavailableError(str(e))
    return (NothingChecked if isinstance(e, replay.NothingRecordedError) else InputError)(str(e))


def write_error(e: OSError, path: str, kept: list[str] | tuple = (),
                also: list[str] | tuple = ()) -> click.ClickException:
    """The error for a file not written: :class:`DiskFull` naming the files ``kept`` (and ``also``, other files
    not written), else :class:`InputError`."""
    if disk_full(e):
        return DiskFull(path, str(e.strerror or e), kept, also)
    return InputError(f"cannot write {path}: {e.strerror or e}")
