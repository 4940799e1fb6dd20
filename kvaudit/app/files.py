"""The files a command reads and writes besides the engine's: ``--suppress`` files, replay files
of findings, and the report files ``--html``/``--sarif``/``--junit``/``--json`` name (checked before a
long run, written after it)."""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING

from kvaudit import replay
from kvaudit.app.errors import InputError, write_error
from kvaudit.reports.outputs import Outputs, ReportData, WriteError
from kvaudit.reports.outputs import write as write_outputs
from kvaudit.audit.suppress import SuppressionError, SuppressionSet

if TYPE_CHECKING:
    from rich.console import Console


def load_suppressions(path: str | None) -> SuppressionSet | None:
    """The rules of ``--suppress FILE``, or None without the flag; a bad file is an input error."""
    if path is None:
        return None
    try:
        return SuppressionSet.load(path)
    except SuppressionError as e:
        raise InputError(str(e)) from None


def check_outputs(inputs: tuple[str, ...] = (), **paths) -> Outputs:
    """Check the report paths now, not after a long run (:func:`check_paths`); the ``Outputs`` they name."""
    check_paths(inputs, **paths)
    return Outputs(**paths)


def check_paths(inputs: tuple[str, ...] = (), **paths) -> None:
    """Check output paths (``--FLAG=path`` as keywords): a non-empty file name (not ``-``), not a
    directory or a device, not one of the ``inputs`` and not named twice (however spelled), in a
    directory where a file can really be created (tried). Raises :class:`InputError`."""
    seen: dict[str, str] = {}
    given = {os.path.realpath(p): p for p in inputs if p and os.path.exists(p)}
    for fmt, path in paths.items():
        if path is None:
            continue
        if path in ("", "-"):
            raise InputError(f"--{fmt}: want a file name, not {path!r}")
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
        _check_writable(fmt, path, os.path.dirname(real))


def check_dir(path: str, flag: str) -> None:
    """An output directory made only when something is written there: ``path`` is a directory or
    nothing yet, in a directory where a file can really be created (tried; nothing is left). Raises
    :class:`InputError` (``--FLAG PATH: ...``)."""
    real = os.path.realpath(path)
    if os.path.exists(real) and not os.path.isdir(real):
        raise InputError(f"--{flag} {path}: not a directory")
    _check_writable(flag, path, real)


def _check_writable(flag: str, path: str, where: str) -> None:
    """A file can be created in ``where``, or in the nearest directory above it that exists (the
    rest is made when written). Raises :class:`InputError` naming ``--FLAG PATH``."""
    while not os.path.exists(where):
        where = os.path.dirname(where)
    if not os.path.isdir(where):
        raise InputError(f"--{flag} {path}: cannot write in {where} (not a directory)")
    try:  # os.access says yes to root on read-only mounts and /sys: try it
        tempfile.TemporaryFile(dir=where).close()
    except OSError as e:
        raise InputError(f"--{flag} {path}: cannot write in {where}: {e.strerror or e}") from None


def write_reports(outputs: Outputs, data: ReportData, err: Console, kept: tuple[str, ...] = ()) -> None:
    """Write the reports asked for; ``kept``: files this run wrote before (named if the disk is full)."""
    if not outputs.wanted():
        return
    try:
        written = write_outputs(outputs, data)
    except WriteError as e:
        raise write_error(e, f"report {e.filename}", [*kept, *e.written]) from None
    err.print("reports written: " + ", ".join(written), soft_wrap=True)


def write_finding(out_dir, config, program, findings, **extra) -> str:
    """The replay file of ``findings`` in ``out_dir``, named by the first one's signature."""
    return write_replay(os.path.join(out_dir, replay.file_name(findings[0].signature)), config, program, findings,
                        **extra)


def replay_hint(config, path: str) -> str:
    """The command that replays the file at ``path`` written for ``config``, as a shell line:
    ``kvaudit replay PATH``, after ``KVAUDIT_PLUGINS=...`` (this run's value) when ``config``'s kind
    came from a plugin module (without it the replay cannot find the kind: exit 2, unknown target)."""
    import shlex

    from kvaudit.targets import registry

    env = registry.plugins_env(registry.kind_of(config).name)
    return (f"{env} " if env else "") + f"kvaudit replay {shlex.quote(path)}"


def write_replay(path, config, program, findings, **extra) -> str:
    try:
        return replay.write_atomic(path, replay.to_doc(config, program, findings, **extra))
    except OSError as e:
        raise write_error(e, path) from None
