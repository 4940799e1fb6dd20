"""The files a command reads and writes: ``--suppress`` files, replay files of findings, and the
report files (checked before a long run, written after it)."""

from __future__ import annotations

import os
import shlex
import tempfile
from typing import TYPE_CHECKING

from kvaudit import atomic, replay
from kvaudit.config import json_value, shown_path
from kvaudit.app.errors import InputError, write_error
from kvaudit.reports.outputs import Outputs, ReportData, WriteError
from kvaudit.reports.outputs import write as write_outputs
from kvaudit.audit.suppress import SuppressionError, SuppressionSet
from kvaudit.targets import registry

if TYPE_CHECKING:
    from rich.console import Console


def load_suppressions(path: str | None) -> SuppressionSet | None:
    """The rules of ``--suppress FILE``, or None. Raises :class:`InputError` for a bad file."""
    if path is None:
        return None
    try:
        return SuppressionSet.load(path)
    except SuppressionError as e:
        raise InputError(str(e)) from None


def check_outputs(inputs: tuple[str, ...] = (), **paths) -> Outputs:
    check_paths(inputs, **paths)
    return Outputs(**paths)


def check_paths(inputs: tuple[str, ...] = (), **paths) -> None:
    """Output paths (``--FLAG=path`` as keywords) must be distinct file names, none of ``inputs``, where
    a file can really be created (tried). Raises :class:`InputError`."""
    seen: dict[str, str] = {}
    given = {os.path.realpath(p): p for p in inputs if p and os.path.exists(p)}
    for fmt, path in paths.items():
        if path is None:
            continue
        if path in ("", "-"):
            raise InputError(f"--{fmt}: want a file name, not {json_value(path)}")
        if path.endswith((os.sep, os.altsep or os.sep)):  # (a directory's name: realpath drops the slash)
            raise InputError(f"--{fmt} {path}: names a directory (want a file name)")
        link = atomic.fd_link(path)
        if link is not None:
            raise InputError(f"--{fmt} {path}: {link} is a file descriptor's link, not a file (reports are written "
                             "by renaming a new file over the old one): give a file name")
        real = os.path.realpath(path)
        if real in seen:
            raise InputError(f"--{fmt} and --{seen[real]} both name {path}")
        seen[real] = fmt
        if real in given:
            raise InputError(f"--{fmt} {path}: is the input file {given[real]}; it would be overwritten")
        if os.path.isdir(real):
            raise InputError(f"--{fmt} {path}: is a directory (want a file name)")
        if os.path.exists(real) and not os.path.isfile(real):
            raise InputError(f"--{fmt} {path}: not a regular file (reports are written by renaming a new file "
                             "over the old one)")
        _check_writable(fmt, path, os.path.dirname(real), os.path.basename(real))


def folder_problem(path: str) -> str | None:
    """What ``path`` (a ``--regressions`` folder to read) is instead of a folder: a file (named with or without a
    trailing slash), or nothing; None when it is a folder."""
    if os.path.isdir(path):
        return None
    if path and os.path.exists(path.rstrip(os.sep) or os.sep):  # ("/" stripped is ""; "" itself is nothing)
        return "a file, not a folder: it takes a folder of replay files (*.json)"
    return "no such directory"


def out_folder_problem(path: str) -> str | None:
    """What ``path`` (an output directory: ``--out``, ``--corpus``) is instead of a directory: "not a directory"
    when something else is there, named with or without a trailing slash; None otherwise."""
    real = os.path.realpath(path)
    return "not a directory" if os.path.exists(real) and not os.path.isdir(real) else None


def check_dir(path: str, flag: str) -> None:
    """An output directory (made when written): a directory or nothing yet, where a file can be created.
    Raises :class:`InputError`."""
    if path == "":  # (an unset variable in a script: realpath("") is the current directory)
        raise InputError(f"--{flag}: want a directory name, not \"\"")
    what = out_folder_problem(path)
    if what is not None:
        raise InputError(f"--{flag} {path}: {what}")
    _check_writable(flag, path, os.path.realpath(path))


def _check_writable(flag: str, path: str, where: str, file: str | None = None) -> None:
    made = [file] if file else []  # the names this run would make below ``where``: each must fit the name limit
    while not os.path.exists(where):
        where, name = os.path.split(where)
        made.append(name)
    if not os.path.isdir(where):
        raise InputError(f"--{flag} {path}: cannot write in {where} (not a directory)")
    try:
        limit = os.pathconf(where, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    too_long = next((name for name in made if len(os.fsencode(name)) > limit), None)
    if too_long is not None:  # (else an error only once the search is over: a campaign's internal error 70)
        raise InputError(f"--{flag} {path}: a name of {len(os.fsencode(too_long))} bytes ({too_long[:40]}...): "
                         f"the file system of {where} takes {limit} at most")
    try:  # NOTE: os.access says yes to root on read-only mounts and /sys
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        raise InputError(f"--{flag} {path}: cannot write in {where}: {e.strerror or e}") from None


def write_reports(outputs: Outputs, data: ReportData, err: Console, kept: tuple[str, ...] = (),
                  before: tuple[str, ...] = ()) -> list[str]:
    """``kept``: files this run wrote before (named if the disk is full); ``before``: reports it wrote before
    (``ci``'s JUnit and SARIF), named first on the one ``reports written:`` line. Returns the reports written
    here."""
    if not outputs.wanted():
        reports_written(err, list(before))
        return []
    try:
        written = write_outputs(outputs, data)
    except WriteError as e:  # (the others were written: a full disk under one need not be under another)
        reports_written(err, [*before, *e.written])
        raise write_error(e, f"report {e.filename}", [*kept, *e.written], also=e.also) from None
    reports_written(err, [*before, *written])
    return written


def reports_written(err: Console, paths: list[str]) -> None:
    """The one ``reports written: A, B`` line on ``err`` (nothing when ``paths`` is empty)."""
    if paths:
        err.print("reports written: " + ", ".join(map(shown_path, paths)), soft_wrap=True)


def write_finding(out_dir, config, program, findings, **extra) -> str:
    """The replay file of ``findings[0]``'s signature in ``out_dir``: it replaces one of the same target kind and
    signature only; another file of that name (another kind's, a note) is left as it is and this one takes
    the next free ``<name>.<n>.json`` (:func:`kvaudit.replay.home`). Returns its path."""
    path, _ = replay.home(out_dir, findings[0].signature, replay.target_name(config))
    return write_replay(path, config, program, findings, **extra)


def replay_hint(config, path: str, suppress: str | None = None) -> str:
    """``kvaudit replay PATH`` as a shell line, after this run's ``KVAUDIT_PLUGINS=...`` for a plugin kind, with
    the run's ``--suppress FILE`` (without it the replay stops at the first finding the rules hid)."""
    env = registry.plugins_env(registry.kind_of(config).name)
    return ((f"{env} " if env else "") + f"kvaudit replay {shell_quoted(path)}"
            + (f" --suppress {shell_quoted(suppress)}" if suppress else ""))


def shell_quoted(path: str) -> str:
    """``path`` quoted for a POSIX shell, on one printable line: as :func:`shlex.quote` does, or, for a name with
    bytes that are not UTF-8 or a control character (a newline), bash's ``$'...'`` with those bytes as ``\\xNN``
    (the name, which a console shows escaped, still pastes)."""
    if shown_path(path) == path:
        return shlex.quote(path)
    raw = path.encode("utf-8", "surrogateescape")
    return "$'" + "".join(chr(b) if 32 <= b < 127 and b not in b"'\\" else f"\\x{b:02x}" for b in raw) + "'"


def write_replay(path, config, program, findings, **extra) -> str:
    try:
        return replay.write_atomic(path, replay.to_doc(config, program, findings, **extra))
    except OSError as e:
        raise write_error(e, path) from None
