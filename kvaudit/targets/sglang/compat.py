"""The SGLang releases the target drives, in two eras, and the API changes between them: **current**
(0.5.22 and 0.5.23: ``ReqKvInfo``, ``release_kv_cache(req, cache, *, checkpoint)``, tree locks
``lock``/``unlock(handle)``, ``StreamingSession.take``, the tree-cache factory) and **legacy** (the ``cache_finished_req`` era, 0.5.10.post1 and 0.5.11: KV fields on ``Req``,
``release_kv_cache(req, cache, is_insert)``, a hand-built ``RadixCache`` and ``SessionAwareCache``).
Each change is named after the first release with the newer API (facts: ``../shared/reference/history-facts.md``)."""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

from kvaudit.targets.compat import Change, release_has

CURRENT = ("0.5.22", "0.5.23")
# 0.5.12-0.5.21 are neither: ReqKvInfo and the factory arrive in between, but release_kv_cache still takes
# is_insert, the tree caches through insert_req/cache_unfinished_req/unpin, and StreamingSession wraps
# the tree cache (0.5.22 replaces all three); refused with :func:`refusal`
BETWEEN = ("0.5.12", "0.5.21")
LEGACY = ("0.5.10.post1", "0.5.11")  # 0.5.10 itself has the same API; only these two are tested


CHANGES: dict[str, Change] = {c.name: c for c in (
    Change("session-package", "0.5.11",
           "sessions move to sglang.srt.session (session_controller; the cache wrapper SessionAwareCache is "
           "renamed StreamingSession in streaming_session); before, managers.session_controller and "
           "mem_cache.session_aware_cache"),
    Change("session-held-active", "0.5.11",
           "SessionAwareCache.session_held_tokens(active_pool_idxs): a slot whose row a running turn borrowed "
           "is counted once, as the turn's uncached KV (the fix of SGLang #22213/#22753); before, no argument"),
    Change("row-zero-padding", "0.5.11",
           "ReqToTokenPool reserves row 0 (rows 1..size, a size + 1 table); before, every row 0..size-1 is "
           "usable"),
    Change("session-close-deferral", "0.5.11",
           "Session.close_on_finish: closing a session while its turn runs is deferred to maybe_reap, and a "
           "closing session takes no new turn (the fix of SGLang #21875); before, the slot is released at once"),
    Change("flush-send-output", "0.5.23",
           "SchedulerFlushWrapper(flush_cache, is_fully_idle, send_output): a deferred flush answers through "
           "a send_output callable; before (0.5.22), through ipc_channels.send_to_tokenizer.send_output"),
    Change("mamba-track-position", "0.5.23",
           "ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend returns the ping-pong position "
           "(track_position) and prepare_for_extend gathers the slot ids from the pool's mapping; before "
           "(0.5.22), the slot id itself (track_index)"),
    Change("kv-checksum-signature", "0.5.23",
           "PD KV checksum: prefill digests only the pages past the prefix decode holds and writes (digest, "
           "layout signature) to MetadataBuffers (set_kv_checksum(req, digest, signature)); decode verifies "
           "once; before (0.5.22), one digest of the whole prompt from page 0, verified at every join"),
)}


def family(version: str) -> str | None:
    """``"current"``, ``"legacy"`` or None (a release this target does not drive)."""
    if version in CURRENT:
        return "current"
    if version in LEGACY:
        return "legacy"
    return None


def supported() -> str:
    """The supported releases, by family, for the probe's one-line error."""
    return f"{', '.join(LEGACY)} (cache_finished_req era) and {', '.join(CURRENT)}"


def refusal(version: str) -> str:
    """The one-line reason ``version`` (not driven) is refused, for the probe's error."""
    head = f"SGLang {version} is installed, but --target sglang drives only {supported()}"
    try:
        between = Version(BETWEEN[0]) <= Version(version) <= Version(BETWEEN[1])
    except InvalidVersion:
        between = False
    if between:
        return (head + f": {version} is between the two eras (release_kv_cache(req, cache, is_insert), the "
                "tree's insert_req/cache_unfinished_req/unpin and a StreamingSession that wraps the tree "
                "cache: neither driver family's API)")
    return head + ": its scheduler-level API changes between versions"


def has(change: str, version: str) -> bool:
    """Whether release ``version`` has the newer API of ``change`` (a key of :data:`CHANGES`; KeyError otherwise)."""
    return release_has(CHANGES, change, version)
