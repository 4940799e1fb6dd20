"""Targets: adapters between kvaudit and an engine.

The configs import without torch; the target classes (which do) are imported on first use (PEP
562), so that ``kvaudit --help`` starts in a fraction of a second.
"""

from typing import NamedTuple

from kvaudit.targets.sglang.config import SglangConfig, is_sglang_config

_LAZY = {"Accounting": "base", "PoolSpec": "base", "Root": "base", "Target": "base", "EutTarget": "eut"}

__all__ = ["Accounting", "PoolSpec", "Root", "Target", "EutTarget", "SglangConfig", "make_target", "config_from_dict",
           "program_features", "EngineSource", "engine_source"]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f"kvaudit.targets.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'kvaudit.targets' has no attribute {name!r}")


def make_target(config):
    """The target for ``config``: real SGLang for a :class:`SglangConfig`, else ``engine_under_test``.
    Raises :class:`kvaudit.targets.sglang.boot.SglangUnavailable` when SGLang cannot be driven."""
    if isinstance(config, SglangConfig):
        if config.disaggregation_mode == "decode":
            from kvaudit.targets.sglang.pd import SglangPdDecodeTarget
            return SglangPdDecodeTarget(config)
        if config.enable_hisparse:
            from kvaudit.targets.sglang.hisparse import SglangHiSparseTarget
            return SglangHiSparseTarget(config)
        if config.hicache_storage_backend is not None:
            from kvaudit.targets.sglang.hicache_l3 import SglangHiCacheL3Target
            return SglangHiCacheL3Target(config)
        if config.enable_hierarchical_cache:
            from kvaudit.targets.sglang.hicache import SglangHiCacheTarget
            return SglangHiCacheTarget(config)
        from kvaudit.targets.sglang.target import SglangTarget
        return SglangTarget(config)
    from kvaudit.targets.eut import EutTarget
    return EutTarget(config)


def program_features(config) -> frozenset[str]:
    """What of :data:`kvaudit.program.FEATURES` the target of ``config`` gives meaning to, so the
    generators draw it: a target config's own ``program_features`` (:class:`SglangConfig`), else the
    built-in engine's: ``transfer_fail`` on a PD decode server (``Scheduler.report_transfer_failure``),
    ``priority`` with ``enable_priority_scheduling``."""
    own = getattr(config, "program_features", None)
    if own is not None:
        return own
    return frozenset({"transfer_fail"} if getattr(config, "is_pd_decode", False) else ()) | frozenset(
        {"priority"} if getattr(config, "enable_priority_scheduling", False) else ())


def config_from_dict(d: dict):
    """A config from a replay file's ``config`` object: ``"target": "sglang"`` selects
    :class:`SglangConfig`. Raises ``ValueError``/``TypeError`` on bad keys or values."""
    from engine_under_test import EngineConfig
    if is_sglang_config(d):
        return SglangConfig.from_dict(d)
    if isinstance(d, dict) and d.get("target", "eut") != "eut":
        raise ValueError(f"unknown target {d['target']!r} (valid: eut, sglang)")
    return EngineConfig.from_dict({k: v for k, v in d.items() if k != "target"} if isinstance(d, dict) else d)


class EngineSource(NamedTuple):
    """An engine installed as a package, outside this repository: ``package`` is its top-level
    import name (the frames of a finding under a ``<package>/`` directory are the engine's own),
    ``version`` the release whose frames a recorded finding holds (None when unknown)."""

    package: str
    version: str | None


def engine_source(target: str) -> EngineSource | None:
    """Where the engine of the target named ``target`` (a config's ``target``) keeps its source, for
    reports that anchor a finding at the engine's own frame (``kvaudit/sarif.py``); None for
    ``eut``, whose source is in this repository. SGLang's version is the installed one when this
    target drives it; else, while the target drives a single release, that release (the only one
    that can have recorded the frames). Imports nothing of the engine."""
    if target == "sglang":
        from kvaudit.targets.sglang.boot import SUPPORTED_VERSIONS, installed_version
        v = installed_version()
        return EngineSource("sglang", v if v in SUPPORTED_VERSIONS else
                            SUPPORTED_VERSIONS[0] if len(SUPPORTED_VERSIONS) == 1 else None)
    return None
