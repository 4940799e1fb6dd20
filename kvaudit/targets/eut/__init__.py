"""The target of the built-in engine, ``engine_under_test`` (``--target eut``, the default).

:mod:`kvaudit.targets.eut.kind` registers it (no torch); :class:`EutTarget` (in ``target.py``, which
imports torch) is imported on first use (PEP 562).
"""


def __getattr__(name: str):
    if name in ("EutTarget", "SessionRecords"):
        from kvaudit.targets.eut import target

        return getattr(target, name)
    raise AttributeError(f"module 'kvaudit.targets.eut' has no attribute {name!r}")
