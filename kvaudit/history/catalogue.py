"""The history suite's catalogue: every registered kind's known public KV-lifecycle bugs (its
``TargetKind.history`` rows: the last release that ships each and the first that does not) and each
kind's own findings (``TargetKind.own_findings``: ``corpora/<kind>/*.json``) as rediscoveries. Design
notes: docs/internals/history.md.
"""

from __future__ import annotations

import json
import os

from kvaudit import replay
from kvaudit.data import data_path
from kvaudit.history.notes import note_for
from kvaudit.targets import registry
from kvaudit.targets.catalogue import HistoryBug, Unreached

_HISTORIES = {kind.name: kind.history() for kind in registry.kinds().values() if kind.history is not None}
ENGINES = tuple(_HISTORIES)
BUGS: dict[str, HistoryBug] = {b.id: b for bugs, _, _ in _HISTORIES.values() for b in bugs}
UNREACHED: tuple[Unreached, ...] = tuple(u for _, unreached, _ in _HISTORIES.values() for u in unreached)
# (engine, version) -> what the release's overlay installs beside it (``--no-deps``)
PINS = {(engine, v): reqs for engine, (_, _, pins) in _HISTORIES.items() for v, reqs in pins.items()}


def rediscoveries() -> tuple[HistoryBug, ...]:
    """The findings kvaudit made in an engine (each kind's ``own_findings`` release: the replay files of
    ``corpora/<kind>/``) as bugs to rediscover from scratch: the file's config, its first finding's exact
    signature; no fixing release; ``reach``: the analysis's (``corpora/<kind>/notes.toml``) with its README
    section, or "" where none is written."""
    out = []
    for kind in registry.kinds().values():
        if kind.own_findings:
            out += _own_findings(kind.name, kind.own_findings)
    return tuple(out)


def _own_findings(engine: str, release: str) -> list[HistoryBug]:
    root = data_path("corpora", engine)
    out = []
    for name in sorted(n for n in os.listdir(root) if n.endswith(".json")) if os.path.isdir(root) else ():
        with open(os.path.join(root, name)) as f:
            doc = json.load(f)
        first = doc["findings"][0]
        note = note_for(engine, [first["signature"]], doc["config"].get("preset", ""))
        reach = f"{note.reach} (corpora/{engine}/README.md#finding-{note.readme})" if note and note.reach else ""
        out.append(HistoryBug(
            id=f"{engine}-{release}/{name[:-5]}", engine=engine, title=f"kvaudit's own finding ({name})",
            sources=(f"corpora/{engine}/{name}",), buggy=release, fixed=None, clean_because="",
            preset=doc["config"].get("preset", ""), finding=first["kind"], signature=first["signature"],
            replay_file=f"corpora/{engine}/{name}", reach=reach))
    return out


def all_bugs() -> dict[str, HistoryBug]:
    """The catalogue's bugs and the kinds' own findings to rediscover, by id."""
    return {**BUGS, **{b.id: b for b in rediscoveries()}}


def target_config(bug: HistoryBug):
    """The target config the suite searches for ``bug`` (``ValueError`` for a bad override): a
    rediscovery's replay file's, else its kind's preset with the bug's overrides (a preset of any release:
    the overrides can make one the installed release does not drive as it is drivable; the probe judges)."""
    if bug.replay_file:
        return replay.load(data_path(bug.replay_file))[0]
    return registry.get(bug.engine).preset(bug.preset, any_release=True).config(**bug.config)
