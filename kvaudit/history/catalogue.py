"""The history suite's catalogue: known public KV-lifecycle bugs of SGLang and vLLM, each with the last
release that ships it and the first that does not, and what kvaudit needs to find it there
(``kvaudit bench --suite history``; the method is :mod:`kvaudit.history.suite`).

Facts (which release ships which bug, what changed in the fixing release) are from the releases' own
code and the public trackers, collected in ``../shared/reference/history-facts.md``; each entry says
whether the fixing release is clean because of the fix or because the path was refactored away.
"""

from __future__ import annotations

from kvaudit.targets import registry
from kvaudit.targets.catalogue import HistoryBug, Unreached  # noqa: F401  (the rows' types, for the suite)


def _rows() -> tuple[tuple[HistoryBug, ...], tuple[Unreached, ...], dict[tuple[str, str], tuple[str, ...]]]:
    """Every registered kind's rows and release pins (``TargetKind.history``), in the registry's order."""
    bugs: list[HistoryBug] = []
    unreached: list[Unreached] = []
    pins: dict[tuple[str, str], tuple[str, ...]] = {}
    for kind in registry.kinds().values():
        if kind.history is not None:
            b, u, p = kind.history()
            bugs += b
            unreached += u
            pins.update({(kind.name, version): reqs for version, reqs in p.items()})
    return tuple(bugs), tuple(unreached), pins


# PINS: (engine, version) -> what the release's overlay installs beside it (``--no-deps``)
_BUGS, UNREACHED, PINS = _rows()
ENGINES = tuple(kind.name for kind in registry.kinds().values() if kind.history is not None)


BUGS: dict[str, HistoryBug] = {b.id: b for b in _BUGS}


def rediscoveries() -> tuple[HistoryBug, ...]:
    """The findings kvaudit made in SGLang 0.5.23 (``corpora/sglang/*.json``) as bugs to rediscover from
    scratch: the file's config, its first finding's exact signature; no fixing release."""
    import json
    import os

    from kvaudit.data import data_path

    root = data_path("corpora/sglang")
    out = []
    for name in sorted(os.listdir(root)):
        if not name.endswith(".json"):
            continue
        with open(os.path.join(root, name)) as f:
            doc = json.load(f)
        first = doc["findings"][0]
        out.append(HistoryBug(
            id=f"sglang-0.5.23/{name[:-5]}", engine="sglang", title=f"kvaudit's own finding ({name})",
            sources=(f"corpora/sglang/{name}",), buggy="0.5.23", fixed=None, clean_because="",
            preset=doc["config"].get("preset", ""), finding=first["kind"], signature=first["signature"],
            replay_file=f"corpora/sglang/{name}"))
    return tuple(out)


def all_bugs() -> dict[str, HistoryBug]:
    """The catalogue's bugs and the SGLang 0.5.23 rediscoveries, by id."""
    return {**BUGS, **{b.id: b for b in rediscoveries()}}


def target_config(bug: HistoryBug):
    """The target config the suite searches for ``bug`` (``ValueError`` for a bad override): a
    rediscovery's replay file's, else its kind's preset with the bug's overrides."""
    if bug.replay_file:
        from kvaudit import replay
        from kvaudit.data import data_path
        return replay.load(data_path(bug.replay_file))[0]
    return registry.get(bug.engine).preset(bug.preset).config(**bug.config)
