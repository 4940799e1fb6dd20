"""The ``eut`` target kind: the built-in engine, registered with :mod:`kvaudit.targets.registry`.

Imports the engine's configuration only (no torch): its config and presets
(:mod:`kvaudit.targets.eut.presets`); its bug zoo (``engine_under_test/bugs.py``) and ``Scheduler``
are read when the registry asks.
"""

from __future__ import annotations

from kvaudit.targets.eut.presets import PRESETS, EutConfig
from kvaudit.targets.registry import TargetKind, register, server_args_capabilities


def _presets():
    return PRESETS


def _bugs():
    from engine_under_test import BUGS
    return BUGS


def _make(config):
    from kvaudit.targets.eut.target import EutTarget
    return EutTarget(config)


def _warm_up():
    import kvaudit.targets.eut.target  # noqa: F401  (torch and the engine)


def _features(config) -> frozenset[str]:
    """``transfer_fail`` on a PD decode server (``Scheduler.report_transfer_failure``), ``priority``
    with ``enable_priority_scheduling``."""
    return (frozenset({"transfer_fail"} if config.is_pd_decode else ())
            | frozenset({"priority"} if config.enable_priority_scheduling else ()))


def _engine_check(config, program):
    from kvaudit.targets.eut.engine_check import first_failures
    return first_failures(config, program)


def _header(config) -> str:
    bugs = ", ".join(sorted(config.bugs)) or "none"
    return f"kvaudit report: preset {config.preset}, bugs: {bugs}, model {config.model}, page_size {config.page_size}"


def _anchor(kind: str):
    """``Scheduler.check_memory`` (the engine's own statement of the accounting and lock invariants)
    for accounting drift and lock imbalance, ``Scheduler.step`` (the loop that failed to make
    progress, or raised) for the rest."""
    from engine_under_test import Scheduler
    method = "check_memory" if kind in ("accounting-drift", "lock-imbalance") else "step"
    return getattr(Scheduler, method), f"Scheduler.{method}"


KIND = register(TargetKind(
    name="eut", summary="the built-in engine_under_test", config_class=EutConfig, presets=_presets, make=_make,
    bugs=_bugs, bugs_title="bug zoo", header=_header, anchor=_anchor, features=_features,
    capabilities=server_args_capabilities, model_choices=("none", "tiny"), regressions="corpora/regressions",
    engine_check=_engine_check, warm_up=_warm_up))
