"""Engine releases as overlays: one ``pip install --no-deps --target`` folder per release, put in front of
``PYTHONPATH`` in a child process over this environment. The cache is ``$KVAUDIT_RELEASE_CACHE``, else
``~/.cache/kvaudit/releases``. Design notes: docs/internals/history.md#release-overlays.
"""

from __future__ import annotations

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from kvaudit.config import json_value
from kvaudit.history.catalogue import ENGINES, PINS, all_bugs

CACHE_ENV = "KVAUDIT_RELEASE_CACHE"


class ReleaseError(RuntimeError):
    """A release could not be installed or is unknown; one line, fit for the CLI's exit-2 error."""


def base_version(engine: str) -> str | None:
    """The version of ``engine`` installed in this environment (the base), or None."""
    try:
        return importlib.metadata.version(engine)
    except importlib.metadata.PackageNotFoundError:
        return None


def overlay_path(engine: str, version: str) -> Path:
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "kvaudit" / "releases") / f"{engine}-{version}"


def _pip(cmd: list[str]) -> tuple[int, str]:
    r = subprocess.run(cmd, capture_output=True, text=True)
    return r.returncode, r.stderr


def ensure(engine: str, version: str, on_event=lambda line: None, run=None) -> Path | None:
    """The overlay folder of ``engine==version``, installed into the cache if missing (with the kind's
    :data:`kvaudit.history.catalogue.PINS`); None when the base has that version. ``run(cmd) -> (exit code,
    stderr)`` runs pip (default: :func:`subprocess.run`; the history suite's runs it where a Ctrl-C can stop
    it). Raises :class:`ReleaseError` when pip fails (the registry has no such release, no disk; stopped) or
    the cache folder cannot be made (under a file, read-only)."""
    if engine not in ENGINES:
        raise ReleaseError(f"unknown engine {json_value(engine, 60)} (valid: {', '.join(ENGINES)})")
    if base_version(engine) == version:
        return None
    dest = overlay_path(engine, version)
    # NOTE: installed into a temporary folder renamed into place when pip succeeds: an interrupted
    # install leaves nothing that looks complete
    try:
        if dest.is_dir():  # (is_dir raises for a name too long or a folder that cannot be searched)
            return dest
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{engine}-{version}-", dir=dest.parent))
    except OSError as e:  # the cache is under a file, read-only, on a full disk
        raise ReleaseError(f"could not install {engine} {version}: the release cache {dest.parent} "
                           f"(${CACHE_ENV}, else ~/.cache/kvaudit/releases) is unusable: {e.strerror or e}") from None
    reqs = [f"{engine}=={version}", *PINS.get((engine, version), ())]
    on_event(f"installing {' '.join(reqs)} into {dest} (--no-deps --target)")
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
           "--disable-pip-version-check", "--target", str(tmp), *reqs]
    try:
        returncode, stderr = (run or _pip)(cmd)
    except BaseException:  # Ctrl-C, SIGTERM: no half-installed folder left in the cache
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (stderr.strip().splitlines() or ["pip failed"])[-1]
        raise ReleaseError(f"could not install {engine} {version}: {last}")
    try:
        tmp.rename(dest)
    except OSError:  # another process installed it meanwhile
        shutil.rmtree(tmp, ignore_errors=True)
    return dest


def env(engine: str, version: str, overlay: Path | None) -> dict[str, str]:
    """The environment of a child process that imports ``engine`` at ``version``: the overlay first on
    ``PYTHONPATH`` (the child's own import asserts the version)."""
    out = dict(os.environ)
    if overlay is not None:
        out["PYTHONPATH"] = os.pathsep.join([str(overlay), *filter(None, [out.get("PYTHONPATH")])])
    return out


def size_bytes(path: Path | None) -> int:
    """Bytes on disk under ``path`` (0 for None: the base)."""
    if path is None:
        return 0
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and not f.is_symlink())


def catalogue_releases() -> list[tuple[str, str]]:
    """Every ``(engine, version)`` the history catalogue searches or replays on, in order."""
    out: list[tuple[str, str]] = []
    for b in all_bugs().values():
        for v in (b.buggy, None if b.replay_blocked else b.fixed):
            if v is not None and (b.engine, v) not in out:
                out.append((b.engine, v))
    return out


def main(argv: list[str] | None = None) -> int:
    """``python -m kvaudit.history.releases [all | ENGINE==VERSION ...]``: install overlays into the cache
    (``all``: every release the history catalogue uses; what the base has is skipped). Prints one line
    per release; exit 2 with one line when one cannot be installed."""
    args = sys.argv[1:] if argv is None else argv
    if not args or args in (["-h"], ["--help"]):
        print(main.__doc__.split(":", 1)[0].strip("`"))
        return 0 if args else 2
    wanted = catalogue_releases() if args == ["all"] else []
    for a in ([] if args == ["all"] else args):
        engine, sep, version = a.partition("==")
        if not sep or not version:
            print(f'kvaudit releases: want ENGINE==VERSION or "all", not {json_value(a, 60)}', file=sys.stderr)
            return 2
        wanted.append((engine, version))
    for engine, version in wanted:
        try:
            path = ensure(engine, version, lambda line: print(line, flush=True))
        except ReleaseError as e:
            print(f"kvaudit releases: {e}", file=sys.stderr)
            return 2
        print(f"{engine} {version}: " + ("the base environment" if path is None else
                                          f"{path} ({size_bytes(path) / 2**20:.0f} MiB)"), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
