"""PD's stand-ins for what is not on this machine: for the decode side (:mod:`kvaudit.targets.sglang.pd`) the
prefill server and the wire (:class:`Network`), the transfer backend built on SGLang's ``fake`` one
(:func:`fake_backend`), and the KV checksum over pages that hold no KV data (:class:`KvChecksums`); for both
sides the ``metadata_buffers`` pool (SGLang's ``ReqToMetadataIdxAllocator``) as kvaudit audits it; and what
a PD decode server's queues read alike in both API eras (:func:`decode_groups`, :func:`decode_stuck`,
:func:`abort_decode_queues`; their servers: ``pd.PdDecode``, ``legacy_pd``).
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from kvaudit.targets.base import Accounting, PoolSpec, Root
from kvaudit.targets.sglang.feature import SglangLoop


def page_digest(content: bytes) -> int:
    """A 32-bit digest of page content, never 0 (which marks "no digest" in a metadata row)."""
    raw = hashlib.blake2b(content, digest_size=4).digest()
    return int.from_bytes(raw, "big") | 1


TAG_WIDTH = 4  # int16 words of a token's tag, at the head of its K vector in every layer


def kv_tags(rooms, positions) -> torch.Tensor:
    """``[n]`` bootstrap rooms and ``[n]`` token positions (or one room for all) -> ``[n, TAG_WIDTH]`` int16:
    the KV kvaudit writes for that token of that request (prefill's and decode's forward compute the same
    KV for it). 14-bit chunks keep each word a finite bfloat16 bit pattern."""
    pos = torch.as_tensor(positions, dtype=torch.int64).reshape(-1)
    room = torch.as_tensor(rooms, dtype=torch.int64).reshape(-1).expand(pos.numel())
    return torch.stack([(room >> 14) & 0x3FFF, room & 0x3FFF, (pos >> 14) & 0x3FFF, pos & 0x3FFF], 1).to(torch.int16)


def write_kv(kv, slots: torch.Tensor, tags: torch.Tensor) -> None:
    """Write ``[n, TAG_WIDTH]`` tags into ``[n]`` slots of ``kv`` (SGLang's ``MHATokenToKVPool``), every layer's K:
    what a transfer or a forward pass leaves there. SGLang's own copies (``get_cpu_copy`` /
    ``load_cpu_copy`` of a retraction's ``cpu_tensor`` backup) move it as they move real KV."""
    for buf in kv.k_buffer:
        buf.view(torch.int16)[slots, 0, :TAG_WIDTH] = tags


def read_kv(kv, slots: torch.Tensor) -> torch.Tensor:
    """``[n]`` slots -> their ``[n, TAG_WIDTH]`` tags (layer 0's K)."""
    return kv.k_buffer[0].view(torch.int16)[slots, 0, :TAG_WIDTH]


def page_slots(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[p]`` page indices -> the ``[p * page_size]`` slots they hold, in order."""
    return (pages.reshape(-1, 1).to(torch.int64) * page_size + torch.arange(page_size)).reshape(-1)


class KvChecksums:
    """Stand-in for SGLang's CUDA ``KvChecksumComputer`` (``disaggregation/checksum.py``), built by
    ``DecodePreallocQueue.__init__`` in its place: ``compute`` digests whole pages of the decode server's
    KV pool (``kv``, SGLang's ``MHATokenToKVPool`` on CPU: every layer's K and V), as the CUDA kernel does;
    ``calls`` counts the verifications."""

    def __init__(self, **gpu_buffers):
        self.kv = None  # set once the pools are built (PdDecode.build)
        self.calls = 0

    def compute(self, kv_page_indices, state_indices=None) -> int:
        """``[num_pages]`` int64 page indices (``page_indices_for_request``) -> digest; ``state_indices``
        is None for this pool (no SWA / mamba state)."""
        self.calls += 1
        return self.digest(kv_page_indices)

    def digest(self, pages: torch.Tensor) -> int:
        """The digest of ``[p]`` pages' content (what prefill's computer gives over the same content)."""
        slots = page_slots(pages, self.kv.page_size)
        data = [buf[slots].view(torch.int16) for buf in list(self.kv.k_buffer) + list(self.kv.v_buffer)]
        return page_digest(torch.stack(data).numpy().tobytes())


class Network:
    """The prefill server and the wire: a transfer lands ``latency`` steps after it is sent (the prompt's
    KV into its pages, prefill's digest into its metadata row; every ``mismatch_every``-th one corrupted
    after the digest); an abort notification is acked after ``ack_steps`` steps, or never. ``sent``:
    bootstrap room -> (transfers landed for it, the last one's digest)."""

    def __init__(self, latency: int, ack_steps: int | None, mismatch_every: int | None, page_size: int):
        self.latency, self.ack_steps = latency, ack_steps
        self.mismatch_every, self.page_size = mismatch_every, page_size
        self.sending: list[tuple[int, object]] = []  # (step due, receiver)
        self.acks: list[tuple[int, object]] = []
        self.step = 0
        self.landed = self.corrupted = self.prefix_hits = 0
        self.checksums = self.metadata_buffers = None  # set once the prealloc queue is built (PdDecode.build)
        self.signature = 0
        self.sent: dict[int, tuple[int, int]] = {}

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
        """The transfer to ``rx`` completes: its pages are copied whole (prefill's page tails past the sent
        tokens hold nothing of this request: zeros), then prefill's digest of the prompt's pages past the
        prefix decode holds. (0.5.22 digests the whole prompt from page 0: the same pages, decode's tree
        being off under PD, so its prefix is 0.) A re-bootstrap's replayed output is sent and digested with
        the prompt (the prefill request's ``origin_input_ids``)."""
        self.landed += 1
        self.prefix_hits += rx.decode_prefix_len > 0
        ps, kv = self.page_size, self.checksums.kv
        pages = torch.as_tensor(rx.page_indices, dtype=torch.int64)
        slots = page_slots(pages, ps)
        pos = torch.arange(slots.numel()) + rx.decode_prefix_len
        tags = kv_tags(rx.bootstrap_room, pos)
        tags[pos >= rx.prompt_len] = 0
        write_kv(kv, slots, tags)
        digest = self.checksums.digest(pages[:-(-(rx.prompt_len - rx.decode_prefix_len) // ps)])
        if self.mismatch_every and self.landed % self.mismatch_every == 0 and slots.numel():
            write_kv(kv, slots[:1], tags[:1] ^ 1)  # the wire flips a bit of the first token's KV
            self.corrupted += 1
        self.sent[rx.bootstrap_room] = (self.sent.get(rx.bootstrap_room, (0, 0))[0] + 1, digest)
        self.metadata_buffers.kv_checksum[rx.aux_index, :2] = torch.tensor([digest, self.signature])
        if rx.handoff is not None:  # a real-host request: prefill's first token and room (a fake one's are decode's)
            self.metadata_buffers.output_ids[rx.aux_index, 0] = rx.handoff
            self.metadata_buffers.bootstrap_room[rx.aux_index, 0] = rx.bootstrap_room
        rx.has_sent_metadata = True

    def decoded(self, batch) -> None:
        """A decode forward over ``batch`` (after ``prepare_for_decode``) writes each request's newest
        token's KV at its ``out_cache_loc`` (position ``seq_len - 1``)."""
        if not batch.reqs:
            return
        rooms = torch.tensor([r.bootstrap_room for r in batch.reqs], dtype=torch.int64)
        write_kv(self.checksums.kv, batch.out_cache_loc.to(torch.int64), kv_tags(rooms, batch.seq_lens.cpu() - 1))


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

        def submit_prefill_recompute(self, kv_receiver, payload) -> None:
            """A retracted real-host request's re-bootstrap: prefill recomputes prompt and outputs and sends them
            over the channel ``send_metadata`` opened (kvaudit's wire sends them there: ``Receiver.prompt_len``)."""

    class Receiver(P.FakeKVReceiver):
        ensure_abort_notified = P.CommonKVReceiver.ensure_abort_notified

        def __init__(self, mgr, bootstrap_addr, bootstrap_room=None):
            super().__init__(mgr, bootstrap_addr, bootstrap_room)
            self.bootstrap_room = bootstrap_room
            self.bootstrap_infos = [{"rank": 0}]  # one prefill rank holds the destinations
            self.init_time = None
            self._abort_generation = None
            self.handoff = None  # prefill's first output token, sent with the metadata (real-host requests)

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


def metadata_roots(held: list[tuple[str, int | None]], where: str = "") -> list[Root]:
    """``(rid, metadata_buffer_index)`` of each holder -> its root (an index None or < 0 holds nothing)."""
    return [Root("metadata_buffers", f"req:{rid}", np.array([idx + 1], dtype=np.int64), where=where)
            for rid, idx in held if idx is not None and idx >= 0]


# -- a PD decode server's queues, in both API eras -------------------------------------------------------------
def decode_groups(prealloc_queue, transfer_queue, sched, deferred=()) -> tuple:
    """``(place, requests)`` of a PD decode server's queues, from the front of its pipeline (``deferred``:
    ``DecodeTransferQueue._deferred_releases``' entries, none before the era has them)."""
    pq, tq = prealloc_queue, transfer_queue
    return (("prealloc", [dr.req for dr in pq.queue]), ("transfer", [dr.req for dr in tq.queue]),
            ("deferred_release", [entry[0].req for entry in deferred]), ("waiting", sched.waiting_queue),
            ("running", sched.running_batch.reqs), ("retracted", pq.retracted_queue))


def decode_stuck(prealloc_queue, transfer_queue, sched, rows_left: int, deferred=()) -> str:
    """What keeps a PD decode server busy, from the end of its pipeline back: ``running:decode``,
    ``waiting:memory``, ``transfer:kv-transfer``, ``transfer:deferred-release``, ``prealloc:retracted``,
    ``prealloc:rows`` (no row left: ``rows_left`` 0) or ``prealloc:memory``; ``""`` when nothing waits."""
    for place, on in (("running:decode", sched.running_batch.reqs), ("waiting:memory", sched.waiting_queue),
                      ("transfer:kv-transfer", transfer_queue.queue), ("transfer:deferred-release", deferred),
                      ("prealloc:retracted", prealloc_queue.retracted_queue)):
        if on:
            return place
    if prealloc_queue.queue:
        return "prealloc:memory" if rows_left else "prealloc:rows"
    return ""


def abort_decode_queues(prealloc_queue, transfer_queue, running: list, rid: str, drop_backup, finish_abort) -> None:
    """``Scheduler.abort_request``'s decode branch past the waiting queue (rids match by prefix): a queued
    request's receiver is aborted, a retracted one leaves the retracted queue through ``drop_backup(req)``,
    a running one gets ``to_finish = finish_abort()``."""
    for dr in prealloc_queue.queue + transfer_queue.queue:
        if dr.req.rid.startswith(rid):
            dr.kv_receiver.abort()
    for req in [r for r in prealloc_queue.retracted_queue if r.rid.startswith(rid)]:
        drop_backup(req)
    prealloc_queue.retracted_queue = [r for r in prealloc_queue.retracted_queue if not r.rid.startswith(rid)]
    for req in running:
        if req.rid.startswith(rid) and not req.finished():
            req.to_finish = finish_abort()


class PdServer(SglangLoop):
    """What both PD servers' loops (decode, prefill) say alike of their third pool, ``metadata_buffers``:
    ``self.metadata_allocator``, which their ``build`` sets."""

    def pools(self, pools: list) -> list:
        return pools + [metadata_pool(self.metadata_allocator)]

    def accounting(self, out: dict) -> dict:
        out["metadata_buffers"] = Accounting(self.metadata_allocator.available_size(), 0, 0, 0,
                                             self.metadata_allocator.size)
        return out

    def free_lists(self, out: dict) -> dict:
        out["metadata_buffers"] = np.asarray(self.metadata_allocator.free_slots, dtype=np.int64) + 1
        return out
