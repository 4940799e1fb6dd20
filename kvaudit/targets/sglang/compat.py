"""The SGLang releases the target drives, in two eras, and the API changes between them: **current**
(0.5.23: ``ReqKvInfo``, ``release_kv_cache(req, cache, *, checkpoint)``, the tree-cache factory)
and **legacy** (the ``cache_finished_req`` era, 0.5.10.post1 and 0.5.11: KV fields on ``Req``,
``release_kv_cache(req, cache, is_insert)``, a hand-built ``RadixCache`` and ``SessionAwareCache``).
Each change is named after the first release with the newer API (facts: ``../shared/reference/history-facts.md``)."""

from __future__ import annotations

from kvaudit.targets.compat import Change, release_has

CURRENT = ("0.5.23",)
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


def has(change: str, version: str) -> bool:
    """Whether release ``version`` has the newer API of ``change`` (a key of :data:`CHANGES`; KeyError otherwise)."""
    return release_has(CHANGES, change, version)
