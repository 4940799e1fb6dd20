"""The ``sglang`` target kind, registered with :mod:`kvaudit.targets.registry`: 0.5.23's driver, or the
legacy era's (:mod:`kvaudit.targets.sglang.compat`). Imports neither SGLang nor torch."""

from __future__ import annotations

from kvaudit.targets.registry import (TargetKind, TargetUnavailable, fault_rows, preset_label, register,
                                      server_args_capabilities)
from kvaudit.targets.sglang.compat import LEGACY, OLDER_CURRENT, has
from kvaudit.targets.sglang.config import (FAULTS, SGLANG_PRESETS, TREE_CORES, SglangConfig, legacy_pd_refusal,
                                           legacy_refusal)


def _presets():
    """The presets the installed SGLang's era drives (:func:`era_refusal`, by its metadata, no import); all
    of them with no SGLang, or one this target does not drive, installed (the probe says so)."""
    from kvaudit.targets.sglang.boot import installed_version
    v = installed_version()
    return {n: p for n, p in SGLANG_PRESETS.items() if era_refusal(p.config(), v) is None}


def _refused(name: str) -> str | None:
    """Why the installed SGLang cannot drive the preset ``name`` (:func:`_presets` leaves it out), naming the
    releases that can; None for a drivable or unknown name (by its metadata: no import)."""
    if name not in SGLANG_PRESETS:
        return None
    return _refusal_here(SGLANG_PRESETS[name].config())


def _refusal_here(config) -> str | None:
    """:func:`era_refusal` on the installed SGLang, naming the releases that drive ``config`` and the installed
    one (a preset's refusal and a replay file's read the same), or None."""
    from kvaudit.targets.sglang.boot import SUPPORTED_VERSIONS, installed_version
    why = era_refusal(config, installed_version())
    if why is None:
        return None
    can = [v for v in SUPPORTED_VERSIONS if era_refusal(config, v) is None]
    return f"{why} (driven on SGLang {', '.join(can) or 'no release'}; installed {installed_version()})"


def era_refusal(config, version: str | None) -> str | None:
    """Why the driver family of SGLang ``version`` cannot drive ``config``, one line, or None (None too for a
    release this target does not drive, or none: the probe refuses those)."""
    if version in LEGACY:
        pd = config.disaggregation_mode == "decode"  # (with HiSparse: legacy_refusal leaves it to legacy_pd's)
        return legacy_refusal(config) or (legacy_pd_refusal(config) if pd else None)
    if config.disaggregation_mode == "decode" and config.enable_hisparse:
        return _CURRENT_PD_HISPARSE
    return older_refusal(config, version)


def _make(config):
    """The target for ``config``'s era (the serving mode is a feature of the composed target)."""
    from kvaudit.targets.sglang.boot import SglangUnavailable
    why = _refusal_here(config)
    if why is not None:
        raise SglangUnavailable(why)
    if _legacy() and config.disaggregation_mode == "decode":  # the era's PD decode with HiSparse
        from kvaudit.targets.sglang.legacy_pd import SglangLegacyPdHiSparseTarget as cls
    elif _legacy():  # the cache_finished_req era's driver family (kvaudit.targets.sglang.compat)
        from kvaudit.targets.sglang.legacy import SglangLegacyTarget as cls
    else:  # one composed target: its features come from the config (target.features)
        from kvaudit.targets.sglang.target import SglangTarget as cls
    return cls(config)


_CURRENT_PD_HISPARSE = (f"PD decode with HiSparse (the direct-to-host path) is driven on SGLang {', '.join(LEGACY)} "
                        "only (kvaudit/targets/sglang/legacy_pd.py), not on SGLang 0.5.23")


def older_refusal(config, version: str | None) -> str | None:
    """Why the current family cannot drive ``config`` on ``version``, one of ``compat.OLDER_CURRENT`` (0.5.19-
    0.5.21: release_kv_cache's is_insert, the lock on req.last_node, a StreamingSession that wraps the tree),
    or None: their Change rows cover the plain and PD-prefill paths only (and 0.5.19 takes no eviction policy
    config: ``--radix-eviction-policy-config`` came in 0.5.20)."""
    if version not in OLDER_CURRENT:
        return None
    if config.radix_eviction_policy_config is not None and not has("eviction-policy-config", version):
        return (f"SGLang {version} takes no --radix-eviction-policy-config (CacheInitParams.eviction_policy_config "
                "came in 0.5.20): this config's would be dropped")
    modes = [name for name, on in (
        ("sessions", config.enable_streaming_session), ("HiSparse", config.enable_hisparse),
        ("HiCache", config.enable_hierarchical_cache), ("SWA", config.sliding_window_size is not None),
        ("Mamba", config.enable_mamba), ("speculative decoding", config.speculative_algorithm is not None),
        ("PD decode", config.disaggregation_mode == "decode"), ("overlap", config.enable_overlap)) if on]
    if not modes:
        return None
    return (f"SGLang {version} is driven by the current family on the plain and PD-prefill paths only; "
            f"not driven there: {', '.join(modes)} (kvaudit/targets/sglang/compat.py)")


def _legacy() -> bool:
    """Whether the installed SGLang is a legacy-era release (by its metadata: no import)."""
    from kvaudit.targets.sglang.boot import installed_version
    return installed_version() in LEGACY


def _probe(config) -> None:
    """Raises :class:`TargetUnavailable` (one line, with the install hint) when SGLang, or its PD decode
    modules for a PD config, cannot be imported, or the legacy era cannot drive ``config``."""
    from kvaudit.targets.sglang.boot import SglangUnavailable, load, probe_version
    try:
        version = probe_version()  # not installed, or a release this target does not drive: no import needed
        why = _refusal_here(config)
        if why is not None:
            raise TargetUnavailable(why)
        if _legacy():
            from kvaudit.targets.sglang import legacy_pd
            from kvaudit.targets.sglang.legacy import load_legacy
            S = load_legacy(version)
            if config.disaggregation_mode == "decode":
                legacy_pd.load_pd_hisparse(S)
            return
        load()
        if config.disaggregation_mode != "null":
            from kvaudit.targets.sglang.pd import load_pd
            load_pd()
    except SglangUnavailable as e:
        raise TargetUnavailable(str(e)) from None


def _header(config) -> str:
    """The tree core, and the fields that differ from the preset."""
    bugs = ", ".join(sorted(config.bugs)) or "none"
    return (f"kvaudit report: target sglang, preset {preset_label(config, SGLANG_PRESETS, ('tree_core',))}, "
            f"{_core(config)}, bugs: {bugs}, page_size {config.page_size}")


def _core(config) -> str:
    """The tree core driven: none in the legacy era (its RadixCache or ChunkCache; --tree-core is not read)."""
    return "cache_finished_req era, no tree core" if _legacy() else f"{config.tree_core} tree core"


def _anchor(kind: str):
    """The driver plays SGLang's scheduler: ``SglangTarget.engine_check`` for accounting drift and lock
    imbalance, ``SglangTarget.step`` else (the observer's and the driver's, which the target composes)."""
    from kvaudit.targets.sglang.driver import SglangDriver
    from kvaudit.targets.sglang.observer import SglangObserver
    method = "engine_check" if kind in ("accounting-drift", "lock-imbalance") else "step"
    return getattr(SglangObserver if method == "engine_check" else SglangDriver, method), f"SglangTarget.{method}"


def _describe(config) -> str:
    from kvaudit.targets.sglang.boot import installed_version
    return f"target sglang {installed_version() or '?'} ({_core(config)})"


def _notes(config) -> list[str]:
    if config.enable_hierarchical_cache and config.tree_core == "rust":
        return ["on the rust tree core the hicache_host_pool is checked by its ledger and free-list replay only "
                "(the core cannot list host values: no leak check there); --tree-core python checks it fully"]
    return []


def _engine_source():
    """The installed SGLang when this target drives it; else, while the target drives a single release,
    that release."""
    from kvaudit.targets import EngineSource
    from kvaudit.targets.sglang.boot import SUPPORTED_VERSIONS, installed_version
    v = installed_version()
    return EngineSource("sglang", v if v in SUPPORTED_VERSIONS else
                        SUPPORTED_VERSIONS[0] if len(SUPPORTED_VERSIONS) == 1 else None)


def _history():
    from kvaudit.targets.sglang.catalogue import BUGS, PINS, UNREACHED
    return BUGS, UNREACHED, PINS


def _export():
    from kvaudit.targets.sglang.export import EXPORT
    return EXPORT


KIND = register(TargetKind(
    name="sglang", summary=f"SGLang's own memory manager on CPU, 0.5.22 and 0.5.23 ({', '.join(OLDER_CURRENT)}: plain "
                           f"and PD prefill; {', '.join(LEGACY)}: core pools, radix cache, sessions and PD decode with "
                           "HiSparse) (its presets start with 'sglang')",
    config_class=SglangConfig, presets=_presets, refused=_refused,
    all_presets=lambda: SGLANG_PRESETS, own_findings="0.5.23", make=_make, bugs=fault_rows(FAULTS),
    bugs_title="injected faults (--target sglang)",
    default_preset="sglang", from_dict=SglangConfig.from_dict, probe=_probe, header=_header, anchor=_anchor,
    features=lambda config: config.program_features, capabilities=server_args_capabilities,
    engine_source=_engine_source, describe=_describe, notes=_notes,
    options={"tree_core": (TREE_CORES, "the UnifiedRadixCache tree core [default: rust, SGLang's own default]")}, history=_history,
    export=_export))
