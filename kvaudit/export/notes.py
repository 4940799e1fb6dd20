"""What kvaudit's analyses say about known findings (a title, why it is a defect, a fix, what a server
shows), kept per engine beside its corpus in ``corpora/<kind>/notes.toml``.
Design notes: docs/internals/export.md."""

from __future__ import annotations

import functools
from typing import NamedTuple

from kvaudit.data import data_path
from kvaudit.export.http_api import export_for

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the tomli backport (pyproject.toml's dependency there)
    import tomli as tomllib  # type: ignore[no-redef]


class Note(NamedTuple):
    """``title`` (symptom + function), ``why`` (the broken rule), ``fix`` ("": none known), ``server``
    (what a client sees on a real server), ``readme`` (the README.md section with the full analysis)."""

    title: str
    why: str
    fix: str
    server: str
    readme: str


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


def _engine_name(kind: str) -> str:
    try:
        return export_for(kind).api.engine
    except KeyError:
        return kind


def history_note(bug, note: Note | None) -> Note:
    """The note for a replay file of the history suite's ``bug`` (a
    :class:`kvaudit.history.catalogue.HistoryBug`), with ``note``'s server line when the notes have none."""
    engine = _engine_name(bug.engine)
    fix = (f"Fixed upstream in {engine} {bug.fixed} ({', '.join(bug.sources)}); upgrade." if bug.fixed else
           f"Not fixed upstream as of the history suite ({', '.join(bug.sources)}).")
    history = notes_of(bug.engine).get("history", {})
    server = history.get("server", {}).get(bug.id, note.server if note is not None else "")
    return Note(f"{bug.title} ({engine} {bug.buggy}, {', '.join(bug.sources)})", bug.reach, fix, server,
                history.get("readme", ""))
