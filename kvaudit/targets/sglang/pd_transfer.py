"""PD's stand-ins for what is not on this machine: for the decode side (:mod:`kvaudit.targets.sglang.pd`) the
prefill server and the wire (:class:`Network`), the transfer backend built on SGLang's ``fake`` one
(:func:`fake_backend`), and the KV checksum over pages that hold no KV data (:class:`KvChecksums`); for both
sides the ``metadata_buffers`` pool (SGLang's ``ReqToMetadataIdxAllocator``) as kvaudit audits it.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from kvaudit.targets.base import Accounting, PoolSpec, Root


def page_digest(words: list[int]) -> int:
    """A 32-bit digest of page words, never 0 (which marks "no digest" in a metadata row)."""
    raw = hashlib.blake2b(repr(words).encode(), digest_size=4).digest()
    return int.from_bytes(raw, "big") | 1


class KvChecksums:
    """Stand-in for SGLang's CUDA ``KvChecksumComputer`` (``disaggregation/checksum.py``), built by
    ``DecodePreallocQueue.__init__`` in its place: a page's content is the word the wire last wrote
    into it (``pages``), and ``compute`` digests those words; ``calls`` counts the verifications."""

    def __init__(self, **gpu_buffers):
        self.pages: dict[int, int] = {}
        self.calls = 0

    def compute(self, kv_page_indices, state_indices=None) -> int:
        """``[num_pages]`` int64 page indices (``page_indices_for_request``) -> digest; ``state_indices``
        is None for this pool (no SWA / mamba state)."""
        self.calls += 1
        return page_digest([self.pages.get(int(p), 0) for p in kv_page_indices.tolist()])


class Network:
    """The prefill server and the wire: a transfer lands ``latency`` steps after it is sent (the prompt's
    KV words into its pages, prefill's digest into its metadata row; every ``mismatch_every``-th one
    corrupted after the digest); an abort notification is acked after ``ack_steps`` steps, or never."""

    def __init__(self, latency: int, ack_steps: int | None, mismatch_every: int | None, page_size: int):
        self.latency, self.ack_steps = latency, ack_steps
        self.mismatch_every, self.page_size = mismatch_every, page_size
        self.sending: list[tuple[int, object]] = []  # (step due, receiver)
        self.acks: list[tuple[int, object]] = []
        self.step = 0
        self.landed = self.corrupted = 0
        self.checksums = self.metadata_buffers = None  # set once the prealloc queue is built
        self.signature = 0

    def tick(self) -> None:
        self.step += 1
        for due, rx in [x for x in self.sending if x[0] <= self.step]:
            self.sending.remove((due, rx))
            if rx.conclude_state is None:
                self.land(rx)
        for due, rx in [x for x in self.acks if x[0] <= self.step]:
            self.acks.remove((due, rx))
            rx.kv_mgr.note_abort_ack(rx.bootstrap_room, 0, rx._abort_generation)

    def land(self, rx) -> None:
        """The transfer to ``rx`` completes. Prefill digests the prompt's pages past the prefix decode holds;
        a re-bootstrap's replayed output pages are sent, not digested."""
        self.landed += 1
        words = [(rx.bootstrap_room << 16) + i + 1 for i in range(len(rx.page_indices))]
        digested = -(-(rx.prompt_len - rx.decode_prefix_len) // self.page_size)
        digest = page_digest(words[:digested])
        if self.mismatch_every and self.landed % self.mismatch_every == 0 and words:
            words[0] ^= 1
            self.corrupted += 1
        if self.checksums is not None:  # None: the decode server verifies no checksum (pd._checksum_on)
            self.checksums.pages.update(zip(rx.page_indices, words))
            self.metadata_buffers.kv_checksum[rx.aux_index, :2] = torch.tensor([digest, self.signature])
        rx.has_sent_metadata = True


def fake_backend(P, network: Network):
    """kvaudit's transfer backend: SGLang's fake manager and receiver, plus latency and the deferred
    abort-release protocol (``CommonKVManager``'s ack tracker, ``CommonKVReceiver.ensure_abort_notified``)."""

    class Manager(P.FakeKVManager):
        enable_deferred_decode_kv_release = True
        register_deferred_abort_room = P.CommonKVManager.register_deferred_abort_room
        note_abort_ack = P.CommonKVManager.note_abort_ack
        is_abort_release_safe = P.CommonKVManager.is_abort_release_safe
        clear_deferred_abort_state = P.CommonKVManager.clear_deferred_abort_state

        def __init__(self, *a, **k):
            super().__init__(*a, **k)
            self._deferred_abort_ack_tracker = {}
            self._deferred_abort_generation = 0

    class Receiver(P.FakeKVReceiver):
        ensure_abort_notified = P.CommonKVReceiver.ensure_abort_notified

        def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
            super().__init__(mgr, bootstrap_addr, bootstrap_room)
            self.bootstrap_room = bootstrap_room
            self.bootstrap_infos = [{"rank": 0}]  # one prefill rank holds the destinations
            self.init_time = None
            self._abort_generation = None

        def send_metadata(self, kv_indices, aux_index=None, state_indices=None, decode_prefix_len=0, **k) -> None:
            """The destinations are published: the transfer starts (with no latency it lands at once)."""
            self.init_time = network.step
            self.page_indices = [int(p) for p in kv_indices]
            self.aux_index, self.decode_prefix_len = aux_index, decode_prefix_len or 0
            if network.latency:
                network.sending.append((network.step + network.latency, self))
            else:
                network.land(self)

        def abort(self) -> None:
            """``CommonKVReceiver.abort``: the room fails, prefill is told."""
            self.conclude_state = P.KVPoll.Failed
            self.ensure_abort_notified()

        def _send_abort_notification(self, *, force_arm: bool = False) -> None:
            if self.kv_mgr.enable_deferred_decode_kv_release and (force_arm or self.init_time is not None):
                self._abort_generation = self.kv_mgr.register_deferred_abort_room(self.bootstrap_room)
                if network.ack_steps is not None:
                    network.acks.append((network.step + network.ack_steps, self))

    return Manager, Receiver


# -- the metadata_buffers pool, on either side ---------------------------------------------------------------
def metadata_pool(allocator) -> PoolSpec:
    """``ReqToMetadataIdxAllocator`` as a pool: slot ``i`` is unit ``i + 1``."""
    return PoolSpec("metadata_buffers", allocator, "meta", 1, allocator.size)


def install_metadata_pool(spec: PoolSpec, auditor) -> bool:
    """Wrap ``alloc() -> int | None`` / ``free(int)`` of a ``meta`` pool; False for another kind."""
    if spec.kind != "meta":
        return False
    obj, pool = spec.obj, spec.name
    orig_take, orig_give = obj.alloc, obj.free

    def take(*a, **k):
        idx = orig_take(*a, **k)
        if idx is not None:
            auditor.on_alloc(pool, [int(idx) + 1], auditor.capture_site())
        return idx

    def give(idx, *a, **k):
        orig_give(idx, *a, **k)
        auditor.on_free(pool, [int(idx) + 1], auditor.capture_site())

    auditor._wrap(obj, "alloc", take)
    auditor._wrap(obj, "free", give)
    return True


def metadata_roots(held: list[tuple[str, int | None]]) -> list[Root]:
    """``(rid, metadata_buffer_index)`` of each holder -> its root (an index None or < 0 holds nothing)."""
    return [Root("metadata_buffers", f"req:{rid}", np.array([idx + 1], dtype=np.int64))
            for rid, idx in held if idx is not None and idx >= 0]


def metadata_accounting(out: dict, allocator) -> dict:
    out["metadata_buffers"] = Accounting(allocator.available_size(), 0, 0, 0, allocator.size)
    return out


def metadata_free_list(out: dict, allocator) -> dict:
    out["metadata_buffers"] = np.asarray(allocator.free_slots, dtype=np.int64) + 1
    return out
