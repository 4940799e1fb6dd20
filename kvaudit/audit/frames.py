"""Source lines for recorded stack frames, checked against the current source: every renderer asks
:func:`resolve` what to show for a frame, with a note when the code moved since it was recorded.

Design notes: docs/internals/audit.md.
"""

from __future__ import annotations

import ast
import functools
import os
import posixpath
import re
import stat
from dataclasses import dataclass
from typing import NamedTuple

from kvaudit.audit.findings import Site, source_path

# code objects with no ``def`` to look up: the check is skipped for them
_ANONYMOUS = ("<lambda>", "<genexpr>", "<listcomp>", "<dictcomp>", "<setcomp>")
_CHANGED = "; the file changed since this was recorded"


@dataclass(frozen=True)
class Frame:
    """What to show for a recorded :class:`Site`: ``line`` (1-based; where the recorded text is now
    when it moved), ``source`` (the line's text, "" when neither recorded nor trustworthy) and
    ``note`` ("" when the frame matches the current source; else one sentence saying why not) and
    ``release`` (the engine release the frame is of when not the installed one: its line and text are as
    recorded, not checked against, nor read from, the installed file; "" otherwise)."""

    line: int
    source: str
    note: str = ""
    release: str = ""


class RecordedEngine(NamedTuple):
    """The engine a finding was recorded on: ``package`` and ``version`` (installed here, None when unknown)
    as the target kind's :class:`~kvaudit.targets.EngineSource` says, ``recorded`` the release the replay
    file names (its ``engine_version``; None: not named, the installed one's frames)."""

    package: str
    version: str | None
    recorded: str | None = None


WINDOWS_ABS = re.compile(r"^[A-Za-z]:[\\/]")


def norm_path(path: str) -> str:
    """``path`` with forward slashes, normalized; a pseudo-file (``<string>``) as it is."""
    p = path.replace("\\", "/")
    return posixpath.normpath(p) if p and not p.startswith("<") else p


def engine_path(path: str, package: str) -> str | None:
    """A ``path`` inside ``package``, relative to the directory holding it: as recorded since 2026-12
    (``sglang/srt/a.py``, :func:`kvaudit.audit.findings.portable_path`), or an absolute one from the last
    ``/<package>/`` (``/x/site-packages/sglang/srt/a.py`` -> ``sglang/srt/a.py``); else None."""
    p = norm_path(path)
    if not (p.startswith("/") or WINDOWS_ABS.match(p)):
        return p if p.startswith(f"{package}/") else None
    i = p.rfind(f"/{package}/")
    return p[i + 1:] if i >= 0 else None


def recorded_release(path: str, package: str) -> str | None:
    """The release of ``package`` whose overlay ``path`` lies in, as the history suite lays one out
    (``~/.cache/kvaudit/releases/sglang-0.5.22/sglang/srt/a.py`` -> ``0.5.22``); None for another path."""
    m = re.search(rf"/{re.escape(package)}-([^/]+)/{re.escape(package)}/", norm_path(path))
    return m[1] if m else None


def frame_release(site: Site, engine: RecordedEngine | None) -> str | None:
    """The release ``site`` was recorded on when it is not the installed one (``engine.version``; unknown
    counts as other): its line is that release's, not a line of the installed package's file. The release
    is the overlay directory's in the recorded path, else, for a frame in the engine's package, the one the
    file was recorded on (``engine.recorded``)."""
    if engine is None:
        return None
    v = recorded_release(site.file, engine.package)
    if v is None and engine.recorded is not None and engine_path(site.file, engine.package) is not None:
        v = engine.recorded
    return v if v is not None and v != engine.version else None


# NOTE: a replay file names any path as a frame's file: only a regular file this size or smaller is read
# (the largest source file in torch, SGLang and vLLM is 1.4 MB); a device, a FIFO or a bigger file is not checked
MAX_SOURCE_BYTES = 4 << 20


def _parsed(path: str) -> tuple[list[str], dict[str, list[tuple[int, int]]]] | None:
    # the stripped lines and, per function name, its defs' line ranges (decorators to last line,
    # inclusive); cached per file by mtime and size; None if the file cannot be read or parsed
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
        return None
    return _parse(path, st.st_mtime_ns, st.st_size)


def _read_source(path: str) -> str | None:
    # non-blocking open and a bounded read: the file may have become a FIFO, or grown, since it was stat'ed
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    with open(fd, "rb") as fh:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = fh.read(MAX_SOURCE_BYTES + 1)
    return data.decode("utf-8") if len(data) <= MAX_SOURCE_BYTES else None


@functools.lru_cache(maxsize=256)
def _parse(path: str, mtime_ns: int, size: int) -> tuple[list[str], dict[str, list[tuple[int, int]]]] | None:
    try:
        text = _read_source(path)
        if text is None:
            return None
        tree = ast.parse(text)
    except (OSError, UnicodeDecodeError, SyntaxError, ValueError):
        return None
    ranges: dict[str, list[tuple[int, int]]] = {}
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            start = min([node.lineno] + [d.lineno for d in node.decorator_list])
            ranges.setdefault(node.name, []).append((start, node.end_lineno or node.lineno))
    return [line.strip() for line in text.splitlines()], ranges


def function_ranges(file: str, function: str) -> list[tuple[int, int]] | None:
    """The inclusive line ranges of every ``def function`` (or ``class``) in the current ``file`` (a
    recorded, possibly repo-relative path); ``[(1, len)]`` for ``<module>``; None when the file
    cannot be read or the function has no ``def`` (a lambda, a comprehension)."""
    parsed = _parsed(source_path(file))
    if parsed is None or function in _ANONYMOUS:
        return None
    lines, ranges = parsed
    if function == "<module>":
        return [(1, len(lines))]
    return ranges.get(function.rsplit(".", 1)[-1], [])  # a qualified name (Scheduler.step) by its last part


def resolve(site: Site, engine: RecordedEngine | None = None) -> Frame:
    """The line to show for ``site``, checked against the current source file (the rules:
    docs/internals/audit.md); a file that cannot be read or a function without a ``def`` is not checked.
    A frame of another release of ``engine`` than the installed one (:func:`frame_release`) is shown as
    recorded, with a note naming its release, and never read from the installed file."""
    other = frame_release(site, engine)
    if other is not None:
        here = f"the installed {engine.package} {engine.version}" if engine.version else f"no {engine.package} here"
        return Frame(site.line, site.source, f"{engine.package} {other}'s line, as recorded: not checked against "
                                             f"{here}", other)
    parsed = _parsed(source_path(site.file))
    ranges = function_ranges(site.file, site.function)
    if parsed is None or ranges is None:
        return Frame(site.line, site.source)
    lines = parsed[0]
    where = os.path.basename(site.file)
    current = lines[site.line - 1] if 1 <= site.line <= len(lines) else None
    inside = any(a <= site.line <= b for a, b in ranges)
    if not ranges:
        return Frame(site.line, site.source, f"stale: no function {site.function} in the current {where}{_CHANGED}")
    if site.source:
        if inside and current == site.source:
            return Frame(site.line, site.source)
        moved = [i + 1 for a, b in ranges for i in range(a - 1, min(b, len(lines))) if lines[i] == site.source]
        if moved:
            line = min(moved, key=lambda n: abs(n - site.line))
            return Frame(line, site.source, f"moved: recorded as line {site.line}{_CHANGED}")
        why = "now reads something else" if inside else f"is outside {site.function}"
        return Frame(site.line, site.source, f"stale: line {site.line} {why} in the current source{_CHANGED}")
    if inside:
        return Frame(site.line, current or "")
    return Frame(site.line, "", f"stale: line {site.line} is outside {site.function} in the current source{_CHANGED}")
