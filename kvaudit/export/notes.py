"""What kvaudit's analyses say about known findings: a title naming the symptom and the function, why it
is a defect, a suggested fix, and what a maintainer sees on a running server. Kept per engine as data
beside the corpus they describe, ``corpora/<kind>/notes.toml`` (condensed from that folder's README.md);
a finding not listed there gets a report without them (the sections say so)."""

from __future__ import annotations

import functools
import tomllib
from typing import NamedTuple

from kvaudit.data import data_path


class Note(NamedTuple):
    """``title`` (symptom + function), ``why`` (the broken rule), ``fix`` (a suggestion; "" if none
    is known), ``server`` (what a client sees on a real server), ``readme`` (the section of the
    corpus's README.md with the full analysis)."""

    title: str
    why: str
    fix: str
    server: str
    readme: str


@functools.cache
def notes_of(kind: str) -> dict:
    """The parsed ``corpora/<kind>/notes.toml`` (``{}`` when the kind has none): ``notes`` (signature ->
    :class:`Note`, ``{name}`` in a value expanded from ``parts``) and ``history`` (``readme``, and
    ``server``: bug id -> what a server shows). Raises ``tomllib.TOMLDecodeError`` for a malformed file."""
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
    """The note of the first signature that has one in ``kind``'s notes, else None. A signature that says
    little on its own (``hang/-/idle/prealloc:memory``: any PD decode server whose pre-allocation never
    fits) is keyed ``signature|preset``."""
    notes = notes_of(kind).get("notes", {})
    for s in signatures:
        for key in (f"{s}|{preset}", s):
            if key in notes:
                return notes[key]
    return None


def _engine_name(kind: str) -> str:
    """The engine's name as its project spells it (its kind's HTTP table's), else the kind's name."""
    from kvaudit.export.http_api import export_for
    try:
        return export_for(kind).api.engine
    except KeyError:
        return kind


def history_note(bug, note: Note | None) -> Note:
    """The note for a replay file of the history suite's ``bug`` (a
    :class:`kvaudit.history.catalogue.HistoryBug`): its title, how a server reaches it (``reach``), the
    upstream fix, and what a server shows (the kind's notes' ``history.server``; else ``note``'s)."""
    engine = _engine_name(bug.engine)
    fix = (f"Fixed upstream in {engine} {bug.fixed} ({', '.join(bug.sources)}); upgrade." if bug.fixed else
           f"Not fixed upstream as of the history suite ({', '.join(bug.sources)}).")
    history = notes_of(bug.engine).get("history", {})
    server = history.get("server", {}).get(bug.id, note.server if note is not None else "")
    return Note(f"{bug.title} ({engine} {bug.buggy}, {', '.join(bug.sources)})", bug.reach, fix, server,
                history.get("readme", ""))
