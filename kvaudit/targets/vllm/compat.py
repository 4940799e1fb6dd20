"""The vLLM releases the target drives, and the API changes between them that it adapts to.

Each change is named after the first release that has the newer API; the target asks
:func:`has` with the installed version (``boot.load().version``) and takes the older path otherwise.
The releases were read (``pip install --no-deps --target``, then grep and ``inspect.signature``) and
each one in :data:`TESTED` passes ``tests/test_vllm_releases.py`` (every preset, a short fuzz, the
oracles clean) when it is the installed vLLM. Facts: ``../shared/reference/history-facts.md``.
"""

from __future__ import annotations

from dataclasses import dataclass

from packaging.version import Version

MIN_VERSION = "0.23.0"  # older releases need a second driver family (0.15: no hash_block_size, ...)
MAX_VERSION = "0.33.0"
TESTED = ("0.23.0", "0.24.0", "0.25.0", "0.26.0", "0.27.0", "0.28.0", "0.29.0", "0.30.0", "0.31.0",
          "0.32.0", "0.33.0")


@dataclass(frozen=True)
class Change:
    """An API change a driver sees: ``release`` is the first release with the newer API."""

    name: str
    release: str
    what: str


CHANGES: dict[str, Change] = {c.name: c for c in (
    Change("hash-helpers", "0.24.0",
           "BlockPool._insert_block_hash / _remove_cached_block_hashes and cached_block_hashes_by_block "
           "(a block cached under several hashes); before, cache_full_blocks and _maybe_evict_cached_block "
           "call the map's insert / pop directly"),
    Change("deferred-frees", "0.24.0",
           "Scheduler.deferred_frees and defer_block_free: with async scheduling and a KV consumer, a "
           "finished request's blocks wait for the in-flight step (the fix of vLLM #45357)"),
    Change("computed-blocks-triple", "0.26.0",
           "KVCacheManager.get_computed_blocks returns (blocks, hits, ...) instead of (blocks, hits)"),
    Change("pending-cow", "0.26.0", "single-type managers' _pending_cow_copies (copy-on-write pairs)"),
    Change("nixl-awaiting-kvs", "0.30.0",
           "NixlConnector's ReqMeta.awaiting_kvs; before, a read with no local block is notify-only"),
)}


def in_range(version: str) -> bool:
    """Whether ``version`` is within ``MIN_VERSION..MAX_VERSION`` (both included)."""
    try:
        v = Version(version)
    except Exception:
        return False
    return Version(MIN_VERSION) <= v <= Version(MAX_VERSION)


def has(change: str, version: str) -> bool:
    """Whether release ``version`` has the newer API of ``change`` (a key of :data:`CHANGES`; KeyError
    otherwise)."""
    return Version(version) >= Version(CHANGES[change].release)


def range_text() -> str:
    return f"{MIN_VERSION} to {MAX_VERSION}"
