"""What kvaudit's analyses say about known findings (a title, why it is a defect, a fix, what a server
shows, how a server reaches it), kept per engine beside its corpus in ``corpora/<kind>/notes.toml``: read by
the history suite (a rediscovery's reach) and ``kvaudit export`` (the issue text).
Design notes: docs/internals/export.md."""

from __future__ import annotations

import functools
from typing import NamedTuple

from kvaudit.data import data_path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport (pyproject.toml's dependency there)
    import tomli as tomllib  # type: ignore[no-redef]


class Note(NamedTuple):
    """``title`` (symptom + function), ``why`` (the broken rule), ``fix`` ("": none known), ``server``
    (what a client sees on a real server), ``readme`` (the README.md section with the full analysis: its
    ``finding-README`` anchor), ``reach`` (how a real server reaches it from client requests; "": not written),
    ``driver`` (where kvaudit's driver could differ from a real server on this finding's path; "": not written),
    ``sure`` (how sure the analysis is of this finding, and what was not run; "": not written)."""

    title: str
    why: str
    fix: str
    server: str
    readme: str
    reach: str = ""
    driver: str = ""
    sure: str = ""


@functools.cache
def notes_of(kind: str) -> dict:
    """The parsed ``corpora/<kind>/notes.toml`` (``{}`` when there is none): ``notes`` (signature ->
    :class:`Note`) and ``history``. Raises ``tomllib.TOMLDecodeError`` for a malformed file."""
    try:
        with open(data_path("corpora", kind, "notes.toml"), "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        return {}
    parts = doc.get("parts", {})

    def expand(text: str) -> str:
        for name, part in parts.items():
            text = text.replace("{" + name + "}", part)
        return text

    notes = {sig: Note(**{k: expand(v) for k, v in row.items()}) for sig, row in doc.get("notes", {}).items()}
    return {"notes": notes, "history": doc.get("history", {})}


def note_for(kind: str, signatures: list[str], preset: str = "") -> Note | None:
    """The note of the first signature that has one in ``kind``'s notes (keyed ``signature|preset`` or
    ``signature``), else None."""
    notes = notes_of(kind).get("notes", {})
    for s in signatures:
        for key in (f"{s}|{preset}", s):
            if key in notes:
                return notes[key]
    return None
