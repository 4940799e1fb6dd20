"""Targets: adapters between kvaudit and an engine.

The configs import without torch; the target classes (which do) are imported on first use (PEP
562), so that ``kvaudit --help`` starts in a fraction of a second.
"""

from typing import NamedTuple

_LAZY = {"Accounting": "base", "PoolSpec": "base", "Root": "base", "Target": "base", "TargetFinding": "base"}

__all__ = ["Accounting", "PoolSpec", "Root", "Target", "make_target", "config_from_dict",
           "config_to_dict", "program_features", "EngineSource", "engine_source"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"kvaudit.targets.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvaudit.targets' has no attribute {name!r}")


def make_target(config):
    """The target for ``config``, built by the registered kind it belongs to
    (:func:`kvaudit.targets.registry.kind_of`) and checked (:func:`kvaudit.targets.base.check_target`).
    Raises :class:`kvaudit.targets.registry.UnknownTargetError` for a config no kind takes,
    :class:`kvaudit.targets.registry.TargetDefinitionError` for a plugin kind's ``make`` that raises (the
    error its cause) or a target that does not keep the target
    API (a plugin kind's ``roots()`` and other reads at every call: :func:`kvaudit.targets.base.check_reads_always`); a
    kind may raise its own error when its engine cannot be driven (real SGLang:
    ``SglangUnavailable``)."""
    from kvaudit.targets.base import check_reads_always, check_target
    from kvaudit.targets.registry import BUILTIN_KINDS, TargetDefinitionError, TargetUnavailable, kind_of

    kind = kind_of(config)
    if kind.name not in BUILTIN_KINDS:
        _check_sizes(config, kind.name)
    try:
        target = kind.make(config)
    except Exception as e:  # noqa: BLE001 -- a plugin's constructor: its own code, at any build (a search builds many)
        if kind.name in BUILTIN_KINDS or isinstance(e, (TargetDefinitionError, TargetUnavailable)):
            raise
        raise TargetDefinitionError(f"target {kind.name}: building its target failed: {type(e).__name__}: "
                                    f"{' '.join(str(e).split())} (KVAUDIT_DEBUG=1 shows its traceback)") from e
    try:
        check_target(target, kind.name, once=kind.name in BUILTIN_KINDS)
        if kind.name not in BUILTIN_KINDS:
            check_reads_always(target, kind.name)
    except Exception:
        close = getattr(target, "close", None)
        if callable(close):
            close()
        raise
    return target


def _check_sizes(config, kind: str) -> None:
    """A plugin kind's config gives what the generators and reports read (docs/writing-a-target.md):
    ``context_len``, ``num_slots`` and ``page_size``, positive Python ints (tokens; a numpy integer ends up
    in the replay file's ops, which JSON cannot hold). Raises
    :class:`kvaudit.targets.registry.TargetDefinitionError` naming the first missing or wrong one."""
    from kvaudit.config import json_value
    from kvaudit.targets.registry import TargetDefinitionError

    for name in ("context_len", "num_slots", "page_size"):
        v = getattr(config, name, None)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:  # (a numpy int is not one: JSON cannot hold it)
            raise TargetDefinitionError(
                f"target {kind}: its config ({type(config).__name__}) must give {name} as a positive integer "
                f"(a Python int, tokens; a field or a property), got {'nothing' if not hasattr(config, name) else json_value(v, 60)}")


def program_features(config) -> frozenset[str]:
    """What of :data:`kvaudit.program.FEATURES` the target of ``config`` gives meaning to, so the
    generators draw it (the registered kind's ``features``)."""
    from kvaudit.targets.registry import kind_of
    return kind_of(config).features(config)


def config_from_dict(d: dict):
    """A config from a replay file's ``config`` object; its ``target`` (default ``eut``) names the
    registered kind. Raises ``ValueError``/``TypeError`` on bad keys or values, an unknown target
    included (:class:`kvaudit.targets.registry.UnknownTargetError` is a ``ValueError``)."""
    from kvaudit.config import json_value
    from kvaudit.targets.registry import kind_of_dict
    if not isinstance(d, dict):
        raise ValueError(f"config must be an object, got {json_value(d, 60)}")
    kind = kind_of_dict(d)
    try:
        return kind.config_from_dict(d)
    except ValueError as e:
        other = _kind_whose_keys(d, kind) if str(e).startswith("unknown config key") else None
        if other is None:
            raise
        raise ValueError(f"{e}: the config's keys are those of target {other}, its \"target\" says "
                         f"{json_value(kind.name)}") from None


def _kind_whose_keys(d: dict, kind):
    # another kind whose config class has every key of ``d``: a file whose "target" was changed by hand
    import dataclasses

    from kvaudit.targets.registry import kinds
    keys = set(d) - {"target"}
    return next((k.name for k in kinds().values() if k is not kind and dataclasses.is_dataclass(k.config_class)
                 and keys <= {f.name for f in dataclasses.fields(k.config_class)}), None)


def config_to_dict(config) -> dict:
    """A replay file's ``config`` object for ``config``: its ``to_dict()`` with ``target`` set to the
    name of the registered kind it belongs to (:func:`kvaudit.targets.registry.kind_of`), whether or not
    the config class has a ``target`` field, so that :func:`config_from_dict` reads it back as that kind
    (a file with no ``target`` is read as ``eut``). A config whose own ``target`` field is set keeps it.
    Raises :class:`kvaudit.targets.registry.UnknownTargetError` for a config no kind takes."""
    from kvaudit.targets.registry import kind_of
    d = config.to_dict()
    d.setdefault("target", kind_of(config).name)
    return d


class EngineSource(NamedTuple):
    """An engine installed as a package, outside this repository: ``package`` is its top-level
    import name (the frames of a finding under a ``<package>/`` directory are the engine's own),
    ``version`` the release whose frames a recorded finding holds (None when unknown)."""

    package: str
    version: str | None


def engine_source(target: str) -> EngineSource | None:
    """Where the engine of the target kind named ``target`` (a config's ``target``) keeps its source,
    for reports that anchor a finding at the engine's own frame (``kvaudit/reports/sarif.py``); None for a
    kind whose source is in this repository (``eut``) or that is not registered here."""
    from kvaudit.targets.registry import UnknownTargetError, get
    try:
        return get(target).engine_source()
    except UnknownTargetError:
        return None
