"""What the real-engine targets share to adapt to API changes between releases: a :class:`Change` names
one after the first release with the newer API, and :func:`release_has` says whether a release has it.
Each engine lists its own changes (``kvaudit/targets/sglang/compat.py``, ``kvaudit/targets/vllm/compat.py``)."""

from __future__ import annotations

import contextlib
import functools
import importlib.metadata
import sys
from dataclasses import dataclass

from packaging.version import Version


@dataclass(frozen=True)
class Change:
    """An API change a driver sees: ``release`` is the first release with the newer API."""

    name: str
    release: str
    what: str


def release_has(changes: dict[str, Change], change: str, version: str) -> bool:
    """Whether release ``version`` has the newer API of ``changes[change]`` (KeyError for an unknown
    change; ``packaging.version.InvalidVersion`` for a malformed version)."""
    return _at_least(version, changes[change].release)


@functools.cache  # (asked per scheduler step by the drivers and observers: a Version parse costs 10 us)
def _at_least(version: str, release: str) -> bool:
    return Version(version) >= Version(release)


def installed(distribution: str) -> str | None:
    """The version of the first ``distribution`` on ``sys.path`` (a release overlay in front wins), or None
    when none is installed. Read from the metadata once per ``sys.path``: a target's boot asks it (a
    metadata read costs about 3 ms, which a search used to pay three times per program it ran). A version
    found stays the answer while ``sys.path`` only grows at its end (the first distribution found is still
    first): importing vLLM appends setuptools' ``_vendor`` folder, and the first build after the probe read
    the metadata again (0.75 ms of it; docs/internals/performance.md, stop 56)."""
    path = tuple(sys.path)
    found = _found.get(distribution)
    if found is not None and path[:len(found[0])] == found[0]:
        return found[1]
    version = _installed(distribution, path)
    if version is not None:
        _found[distribution] = (path, version)
    return version


_found: dict[str, tuple[tuple[str, ...], str]] = {}  # distribution -> (the sys.path it was found on, version)


@functools.cache
def _installed(distribution: str, syspath: tuple[str, ...]) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


@contextlib.contextmanager
def engine_import():
    """While an engine imports: its stdout goes to stderr, so that a log handler it sets up then (vLLM's
    writes to the ``sys.stdout`` of that moment) writes to stderr for the rest of the process, and
    kvaudit's stdout stays its own (a report, a ``SUMMARY:`` line) for a pipe to read."""
    with contextlib.redirect_stdout(sys.stderr):
        yield
