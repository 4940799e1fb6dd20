"""How each program op reaches a real server over HTTP, per engine: the
:class:`kvaudit.targets.export_api.EngineExport` a target kind's registry entry hands over. The exporter
reads nothing else about an engine. Design notes: docs/internals/export.md.
"""

from __future__ import annotations

from kvaudit.targets import registry
from kvaudit.targets.export_api import EngineApi, EngineExport


def apis() -> dict[str, EngineApi]:
    """Kind name -> the HTTP table of every registered kind that has one, in the registry's order."""
    return {name: kind.export().api for name, kind in registry.kinds().items() if kind.export is not None}


def export_for(target: str) -> EngineExport:
    """What the kind called ``target`` hands ``kvaudit export``. Raises ``KeyError`` for a kind with no
    server to export to (the built-in engine has none) or no such kind."""
    try:
        kind = registry.get(target)
    except registry.UnknownTargetError:
        raise KeyError(target) from None
    if kind.export is None:
        raise KeyError(target)
    return kind.export()
