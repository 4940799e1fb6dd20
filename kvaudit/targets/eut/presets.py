"""The built-in engine's config as kvaudit keeps it (:class:`EutConfig`: the engine's
``EngineConfig`` with the JSON form of a replay file) and its named presets (:data:`PRESETS`).
Imports no torch: the CLI lists and validates presets without it.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine_under_test import EngineConfig
from kvaudit.config import ConfigBase, Preset, UnknownPresetError

__all__ = ["EutConfig", "PRESETS", "Preset", "UnknownPresetError", "get_preset"]


@dataclass(frozen=True)
class EutConfig(ConfigBase, EngineConfig):
    """:class:`engine_under_test.EngineConfig` (its fields, defaults and validation, which raises
    ``ValueError`` or ``UnknownBugError``) with :class:`kvaudit.config.ConfigBase`'s ``to_dict``,
    ``from_dict`` and ``replace``; and the bounds on what two fields size together (:func:`_check_tables`)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        _check_tables(self)


# NOTE: each field's range (the engine's _INT_RANGES) bounds one size; the engine also builds at start tables
# that two fields size together, each GBs at the fields' maxima (16 GiB of host K and V for num_slots 4194304
# at hicache_ratio 16: an out-of-memory crash, exit 70, instead of a bad-config line)
MAX_HOST_SLOTS = 1 << 22  # a host tier's slots: at most the largest device pool (num_slots), 1 GiB of K and V
MAX_ROW_TABLE = 1 << 24  # entries of the request-row table (req_to_token, int64: 128 MiB)
# the tiny model's context: a forward of n new tokens over a context of m has heads x n x m attention scores (floats;
# two heads, engine_under_test/model.py), n and m up to context_len: 8 GiB for one prefill at context_len 32768,
# 128 MiB at this bound
MAX_TINY_CONTEXT = 1 << 12


def _check_tables(c: EngineConfig) -> None:
    """Raises ``ValueError`` for a host tier, request-row table or the tiny model's attention past its bound."""
    # (the engine sizes a host pool from the device pool's whole pages, total_tokens: engine_under_test/scheduler.py)
    slots = c.total_tokens if c.total_tokens == c.num_slots else \
        f"{c.total_tokens} (num_slots {c.num_slots} in whole pages of {c.page_size})"
    for on, ratio in (("enable_hicache", "hicache_ratio"), ("enable_hisparse", "hisparse_host_ratio")):
        if getattr(c, on) and c.total_tokens * getattr(c, ratio) > MAX_HOST_SLOTS:
            raise ValueError(f"num_slots x {ratio} (the host pool, tokens) must be at most {MAX_HOST_SLOTS}, got "
                             f"{slots} x {getattr(c, ratio)}")
    rows = c.max_req_rows + (c.pd_pre_alloc_rows if c.is_pd_decode else 0)
    if rows * c.context_len > MAX_ROW_TABLE:
        what = "(max_req_rows + pd_pre_alloc_rows)" if c.is_pd_decode else "max_req_rows"
        raise ValueError(f"{what} x context_len (the request-row table, entries) must be at most {MAX_ROW_TABLE}, "
                         f"got {rows} x {c.context_len}")
    if c.model == "tiny" and c.context_len > MAX_TINY_CONTEXT:
        raise ValueError(f"context_len must be at most {MAX_TINY_CONTEXT} with model \"tiny\" (its attention scores, "
                         f"heads x context_len x context_len floats), got {c.context_len}")


def _preset(name: str, description: str, overrides: dict) -> Preset:
    return Preset(name, description, overrides, config_class=EutConfig)


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        _preset("default", "aggregated serving, page 1, radix cache on", {}),
        _preset("chunked", "chunked prefill of 32 tokens: long prompts park between chunks as chunked_req",
               {"chunked_prefill_size": 32}),
        _preset("mixed-chunk", "chunked prefill with mixed chunk: prefill and decode rows in one batch",
               {"chunked_prefill_size": 64, "enable_mixed_chunk": True}),
        _preset("retract", "a small paged pool and optimistic admission: decode runs out and retracts",
               {"page_size": 4, "num_slots": 128, "new_token_ratio": 0.0}),
        _preset("overlap", "overlap scheduling: each batch's result is processed one step after it ran",
               {"enable_overlap": True}),
        _preset("paged", "aggregated serving with 16-token pages: page-aligned radix keys, private partial pages",
               {"page_size": 16, "num_slots": 1024}),
        _preset(
            "pd-decode",
            "PD disaggregation, decode side: prealloc -> transfer -> prebuilt -> running; tree off; 1 running",
            {"disaggregation_mode": "decode", "disable_radix_cache": True, "max_running_requests": 1},
        ),
        _preset("pd-decode-radix", "PD decode with the decode-side radix cache: prefix hits locked, only the suffix "
               "transferred, the tree evicted for pre-allocation; small pool",
               {"disaggregation_mode": "decode", "disaggregation_decode_enable_radix_cache": True, "num_slots": 128,
                "max_running_requests": 2}),
        _preset(
            "pd-decode-hisparse",
            "PD decode with HiSparse: logical ids, per-request device buffer and host pool",
            {"disaggregation_mode": "decode", "disable_radix_cache": True, "enable_hisparse": True,
             "num_slots": 256},
        ),
        _preset("hisparse", "aggregated HiSparse: prefill, staging to host, per-request device buffer; tree off",
               {"enable_hisparse": True, "disable_radix_cache": True, "num_slots": 256}),
        _preset("streaming-session", "streaming sessions with overlap: a session slot keeps each turn's KV; context 64",
               {"enable_streaming_session": True, "enable_overlap": True, "context_len": 64}),
        _preset("hicache", "HiCache write-through host tier under a small device pool: demote, load back, acks",
               {"enable_hicache": True, "num_slots": 128}),
        _preset("priority", "priority scheduling: queue by priority, preemption past a gap of 1, 3 running, "
                           "at most 4 waiting",
               {"enable_priority_scheduling": True, "priority_scheduling_preemption_threshold": 1,
                "max_running_requests": 3, "max_queued_requests": 4}),
    ]
}


def get_preset(name: str) -> Preset:
    """The preset called ``name`` (the built-in engine's kind looks it up:
    :meth:`kvaudit.targets.registry.TargetKind.preset`). Raises :class:`kvaudit.config.UnknownPresetError`
    naming the valid ones."""
    from kvaudit.targets.registry import get

    return get("eut").preset(name)
