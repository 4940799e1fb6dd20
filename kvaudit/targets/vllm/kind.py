"""The ``vllm`` target kind: vLLM's own v1 Scheduler and KV-cache manager on CPU, releases 0.15.1, 0.16.0 and
0.20.0 to 0.33.0 (registered with :mod:`kvaudit.targets.registry`). Imports neither vLLM nor torch."""

from __future__ import annotations

from kvaudit.targets.registry import TargetKind, TargetUnavailable, fault_rows, preset_label, register
from kvaudit.targets.vllm.config import FAULTS, VLLM_PRESETS, VllmConfig, fault_fixed_in


def _presets():
    """The presets the installed vLLM can build (``boot.refusal``, by its metadata, no import), so that
    ``ci --presets all`` runs."""
    from kvaudit.targets.vllm.boot import installed_version, refusal
    v = installed_version()
    return {n: p for n, p in VLLM_PRESETS.items() if refusal(p.config(), v) is None}


def _refused(name: str) -> str | None:
    """Why the installed vLLM cannot build the preset ``name`` (:func:`_presets` leaves it out), naming the
    releases that can (``boot.refusal``: by its metadata, no import); None for a drivable or unknown name."""
    from kvaudit.targets.vllm.boot import installed_version, refusal
    return refusal(VLLM_PRESETS[name].config(), installed_version()) if name in VLLM_PRESETS else None


def _notes(config) -> list[str]:
    """A fault that puts back a bug the installed release still ships (``config.fault_fixed_in``): say that
    a finding there may be vLLM's own bug, not the fault's (by the installed metadata, no import)."""
    from packaging.version import Version

    from kvaudit.targets.vllm.boot import installed_version
    v = installed_version()
    fixed = {n: fault_fixed_in(n) for n in sorted(config.bugs)}
    try:
        older = [n for n, f in fixed.items() if f is not None and Version(v) < Version(f)]
    except Exception:  # no vLLM, or a version string packaging cannot read: the probe says so
        return []
    return [f"vLLM {v} still ships the bug that --bug {n} puts back (fixed in {fixed[n]}): a finding "
            "here may come from vLLM's own code, not the fault" for n in older]


def _make(config):
    """The target for ``config``'s level (and KV connector)."""
    if config.level == "manager":
        from kvaudit.targets.vllm.target import VllmManagerTarget
        return VllmManagerTarget(config)
    if config.kv_connector is not None:
        from kvaudit.targets.vllm.connector import VllmConnectorTarget
        return VllmConnectorTarget(config)
    from kvaudit.targets.vllm.target import VllmSchedulerTarget
    return VllmSchedulerTarget(config)


def _probe(config) -> None:
    """Raises :class:`TargetUnavailable` (one line, with the install hint) when no vLLM release the target
    drives imports here, or the one that does cannot build ``config`` (``boot.check_config``)."""
    from kvaudit.targets.vllm.boot import VllmUnavailable, check_config
    try:
        check_config(config)
    except VllmUnavailable as e:
        raise TargetUnavailable(str(e)) from None


def _header(config) -> str:
    """The level and scheduler, and the fields that differ from the preset."""
    bugs = ", ".join(sorted(config.bugs)) or "none"
    return (f"kvaudit report: target vllm, preset {preset_label(config, VLLM_PRESETS)}, {_level(config)}, "
            f"bugs: {bugs}, block_size {config.block_size}")


def _level(config) -> str:
    if config.level == "manager":
        return "KVCacheManager"
    sched = "AsyncScheduler" if config.async_scheduling else "Scheduler"
    return sched if config.kv_connector is None else f"{sched} + {config.kv_connector} (scheduler side)"


def _anchor(kind: str):
    """A finding with no usable frame is anchored in this repository (vLLM's files are not): at the
    observer's ``invariant_findings`` for accounting drift (vLLM's invariants are checked there), else at
    the driver's ``VllmSchedulerTarget.step`` (the engine core's calls)."""
    from kvaudit.targets.vllm.observer import VllmObserver
    from kvaudit.targets.vllm.target import VllmSchedulerTarget
    owner, method = (VllmObserver, "invariant_findings") if kind == "accounting-drift" else (VllmSchedulerTarget, "step")
    return getattr(owner, method), f"{owner.__name__}.{method}"


def _describe(config) -> str:
    from kvaudit.targets.vllm.boot import installed_version
    return f"target vllm {installed_version() or '?'} ({_level(config)})"


def _engine_source():
    from kvaudit.targets import EngineSource
    from kvaudit.targets.vllm.boot import SUPPORTED_VERSIONS, installed_version
    v = installed_version()
    return EngineSource("vllm", v if v in SUPPORTED_VERSIONS else
                        SUPPORTED_VERSIONS[0] if len(SUPPORTED_VERSIONS) == 1 else None)


def _features(config) -> frozenset[str]:
    """``priority`` (a submit's priority reaches ``Request.priority``) with the priority scheduling policy;
    ``transfer_fail`` where the NIXL stand-in fails transfers (``kv_load_failure_policy`` set)."""
    return frozenset({"priority"} if config.scheduling_policy == "priority" else ()) | frozenset(
        {"transfer_fail"} if config.kv_load_failure_policy is not None else ())


def _capabilities(config) -> frozenset[str]:
    on = {"prefix_cache": config.enable_prefix_caching, "sessions": config.streaming_sessions}
    return frozenset(name for name, yes in on.items() if yes)


def _history():
    from kvaudit.targets.vllm.catalogue import BUGS, PINS, UNREACHED
    return BUGS, UNREACHED, PINS


def _export():
    from kvaudit.targets.vllm.export import EXPORT
    return EXPORT


KIND = register(TargetKind(
    name="vllm", summary="vLLM's own v1 Scheduler and KV-cache manager on CPU, 0.15.1 to 0.33.0 (presets 'vllm...')",
    config_class=VllmConfig, presets=_presets, all_presets=lambda: VLLM_PRESETS, make=_make, bugs=fault_rows(FAULTS),
    bugs_title="injected faults (--target vllm)", default_preset="vllm", probe=_probe, header=_header,
    anchor=_anchor, features=_features, capabilities=_capabilities, engine_source=_engine_source, describe=_describe,
    notes=_notes, refused=_refused, regressions="corpora/vllm", history=_history, export=_export,
    search_per_step_first=2))  # (a check costs little beside a vLLM step: docs/internals/performance.md, stop 48)
