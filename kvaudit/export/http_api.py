"""How each program op reaches a real server over HTTP, per engine: the table a target kind hands over.

A kind whose engine has a server provides an :class:`kvaudit.targets.export_api.EngineExport` through
its registry entry's ``export`` field (SGLang's in ``kvaudit/targets/sglang/export.py``, vLLM's in
``kvaudit/targets/vllm/export.py``): the release the calls were checked against, the engine's files
they were read from, per op kind an :class:`ApiCall` (the HTTP method and path, the JSON body's
fields, whether a client reproduces the op exactly), the server launch, and the engine's parts of the
client script and the issue text. The exporter reads nothing else about an engine.
"""

from __future__ import annotations

from kvaudit.targets import registry
from kvaudit.targets.export_api import ApiCall, EngineApi, EngineExport

__all__ = ["ApiCall", "EngineApi", "EngineExport", "apis", "export_for"]


def apis() -> dict[str, EngineApi]:
    """Kind name -> the HTTP table of every registered kind that has one, in the registry's order."""
    return {name: kind.export().api for name, kind in registry.kinds().items() if kind.export is not None}


def export_for(target: str) -> EngineExport:
    """What the kind called ``target`` (a replay config's ``target``) hands ``kvaudit export``. Raises
    ``KeyError`` for a kind with no server to export to (the built-in engine has none) or no such kind."""
    try:
        kind = registry.get(target)
    except registry.UnknownTargetError:
        raise KeyError(target) from None
    if kind.export is None:
        raise KeyError(target)
    return kind.export()
