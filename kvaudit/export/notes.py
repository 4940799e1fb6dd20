"""The issue text's note for a history-suite bug; the analyses of known findings themselves (``Note``,
``notes_of``, ``note_for``) are read by :mod:`kvaudit.history.notes`. Design notes: docs/internals/export.md."""

from __future__ import annotations

from kvaudit.export.http_api import export_for
from kvaudit.history.notes import Note, note_for, notes_of  # noqa: F401 -- (the exporter's names, read here)


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
