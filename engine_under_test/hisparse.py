"""HiSparse coordinator: a small per-request device buffer backed by a host copy of every token.

Modelled on SGLang 0.5.x ``srt/managers/hisparse_coordinator.py`` (``HiSparseCoordinator``) and
``srt/mem_cache/allocator/hisparse.py``. Rows store *logical* token ids from the main allocator; a
request's attention KV lives in (a) physical slots from ``hisparse_attn_allocator``: its prefill
slots, then a device buffer of at most ``device_buffer_size`` slots holding the most recent tokens,
and (b) host slots, one per position, in ``host_pool``. PD decode: ``alloc_host`` ->
``admit_request_direct``. Aggregated: ``alloc_prefill`` -> ``admit_request_into_staging`` ->
``collect_ready_reqs`` (``alloc_device_buffer``). Decode growth: ``map_last_loc_to_buffer``.

``request_finished`` (or ``retract_req``) must run before ``release_kv_cache`` on every finish
path: it is the only place that returns buffer, prefill and host slots. Sizes are in tokens.
"""

from __future__ import annotations

import torch

from engine_under_test.memory import INDEX_DTYPE, HostKVPool, PoolIntegrityError, TokenToKVPoolAllocator


class HiSparseCoordinator:
    """Per-row state: ``req_to_device_buffer[row]`` (``[cap] int64`` physical slots),
    ``req_device_buffer_pos[row]`` (``[cap] int64`` position held by each slot, -1 if empty),
    ``req_to_host_pool[row]`` (``[allocated] int64`` host slots by position, page-rounded) and
    ``req_prefill_physical[row]`` (``[page-rounded] int64`` physical slot of prefill position i at i).
    ``ack_staging_queue`` holds ``(ready_at, row, req)`` in enqueue order."""

    def __init__(self, hisparse_attn_allocator: TokenToKVPoolAllocator, host_pool: HostKVPool,
                 device_buffer_size: int, page_size: int, copy_kv: bool):
        self.hisparse_attn_allocator = hisparse_attn_allocator
        self.host_pool = host_pool
        self.device_buffer_size = device_buffer_size
        self.page_size = page_size
        self.copy_kv = copy_kv
        self.kv_pool = None  # the device KV tensors; set by the scheduler
        self.clear()

    def clear(self) -> None:
        self.req_to_device_buffer: dict[int, torch.Tensor] = {}
        self.req_device_buffer_pos: dict[int, torch.Tensor] = {}
        self.req_to_host_pool: dict[int, torch.Tensor] = {}
        self.req_prefill_physical: dict[int, torch.Tensor] = {}
        self.ack_staging_queue: list[tuple[int, int, object]] = []

    def _align(self, n: int) -> int:
        return -(-n // self.page_size) * self.page_size

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=INDEX_DTYPE, device=self.hisparse_attn_allocator.device)

    # -- host side ------------------------------------------------------------------------
    def alloc_host(self, row: int, num_tokens: int) -> bool:
        """Allocate page-rounded host slots for positions ``[0, num_tokens)`` of ``row`` (the RDMA
        target of a PD transfer). Returns False, taking nothing, when the host pool is short."""
        slots = self.host_pool.alloc(self._align(num_tokens))
        if slots is None:
            return False
        self.req_to_host_pool[row] = slots
        return True

    def _ensure_host_slot(self, row: int, pos: int) -> torch.Tensor:
        have = self.req_to_host_pool[row]
        if pos >= have.numel():  # a new page of host backup (SGLang _eager_backup_previous_token)
            more = self.host_pool.alloc(self.page_size)
            if more is None:
                raise RuntimeError("HiSparse host pool out of memory")
            have = self.req_to_host_pool[row] = torch.cat((have, more))
        return have[pos : pos + 1]

    # -- aggregated mode: prefill and staging ---------------------------------------------
    def alloc_prefill(self, row: int, num_tokens: int) -> torch.Tensor | None:
        """Physical slots for prefill positions ``[0, num_tokens)`` of ``row`` (SGLang ``alloc_extend``
        of ``HiSparseTokenToKVPoolAllocator``). The row holds ``page_align(num_tokens)`` slots in all;
        one already holding some (an earlier chunk) grows by the missing pages only. Returns the first
        ``num_tokens`` (``[num_tokens] int64``, slot ``i`` for position ``i``; the model writes its
        chunk's part), or None, taking nothing, when the physical pool is short."""
        have = self.req_prefill_physical.get(row, self._empty())
        need = self._align(num_tokens) - have.numel()
        if need > 0:
            more = self.hisparse_attn_allocator.alloc(need)
            if more is None:
                return None
            have = torch.cat((have, more))
        self.req_prefill_physical[row] = have
        return have[:num_tokens]

    def prefill_context(self, row: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, positions)``, ``[end] int64`` each: what a prefill forward over positions
        ``[0, end)`` of ``row`` reads. Raises ValueError if the row holds fewer than ``end`` slots."""
        have = self.req_prefill_physical.get(row)
        if have is None or have.numel() < end:
            raise ValueError(f"row {row}: prefill holds {0 if have is None else have.numel()} slots < {end}")
        return have[:end], torch.arange(end, dtype=INDEX_DTYPE, device=have.device)

    def admit_request_into_staging(self, req, now: int, latency: int) -> bool:
        """After a prefill that did not finish (SGLang ``admit_request_into_staging``): allocate
        page-rounded host slots for positions ``[0, kv_committed_len)`` as ``req_to_host_pool[row]``,
        copy their K/V physical -> host (if ``copy_kv``), queue the request on ``ack_staging_queue``
        ready at step ``now + latency`` and set ``req.hisparse_staging``. Returns False, taking
        nothing, when the host pool is short; ValueError if the prefill slots do not cover the length."""
        row, n = req.kv.req_pool_idx, req.kv.kv_committed_len
        phys = self.req_prefill_physical.get(row)
        if n and (phys is None or phys.numel() < n):
            raise ValueError(f"row {row}: prefill slots do not cover kv_committed_len={n}")
        host = self.host_pool.alloc(self._align(n))
        if host is None:
            return False
        self.req_to_host_pool[row] = host
        if n:
            self.backup(phys[:n], host[:n])
        self.ack_staging_queue.append((now + latency, row, req))
        setattr(req, "hisparse_staging", True)
        return True

    def collect_ready_reqs(self, now: int) -> list:
        """Pop the leading entries with ``ready_at <= now`` (SGLang counts the finished prefix of the
        queue), give each its buffer (``alloc_device_buffer``) and return them, in order, to merge into
        the running batch. An entry whose buffer cannot be completed stays queued, with the rest."""
        out = []
        while self.ack_staging_queue and self.ack_staging_queue[0][0] <= now:
            req = self.ack_staging_queue[0][2]
            if not self.alloc_device_buffer(req):
                break
            self.ack_staging_queue.pop(0)
            out.append(req)
        return out

    def alloc_device_buffer(self, req) -> bool:
        """Turn the prefill slots into the persistent buffer (SGLang ``alloc_device_buffer``): keep
        ``cap = min(page_align(n), device_buffer_size)`` slots (``n = kv_committed_len``; one page if
        0), the whole pages of positions ``[page_align(n) - cap, page_align(n))`` (those ``>= n`` empty,
        -1), and free the rest. Length 0 allocates its page: False, changing nothing, when short."""
        row, n = req.kv.req_pool_idx, req.kv.kv_committed_len
        phys = self.req_prefill_physical.get(row, self._empty())
        end = self._align(n)
        cap = min(self._align(max(n, 1)), self.device_buffer_size)
        start = max(end - cap, 0)
        keep = phys[start:end]
        if keep.numel() < cap:  # only for n == 0: nothing to keep
            more = self.hisparse_attn_allocator.alloc(cap - keep.numel())
            if more is None:
                return False
            keep = torch.cat((keep, more))
        self.hisparse_attn_allocator.free(torch.cat((phys[:start], phys[end:])))
        pos = torch.arange(start, start + cap, dtype=INDEX_DTYPE, device=keep.device)
        pos[pos >= n] = -1
        self.req_to_device_buffer[row], self.req_device_buffer_pos[row] = keep, pos
        self.req_prefill_physical.pop(row, None)
        setattr(req, "hisparse_staging", False)
        req.hisparse_admitted = True
        return True

    def abort_staging_request(self, req) -> None:
        """Drop a staging request (SGLang ``abort_staging_request``): remove it from the queue, free
        its prefill physical slots and host slots, clear the row's state and both flags."""
        self.request_finished(req)

    def retract_req(self, req) -> None:
        """Retraction (SGLang ``retract_req``): a staging request is aborted from staging, any other
        is finished (``request_finished``). Call before ``release_kv_cache``."""
        if getattr(req, "hisparse_staging", False):
            self.abort_staging_request(req)
        else:
            self.request_finished(req)

    def has_ongoing_staging(self) -> bool:
        return bool(self.ack_staging_queue)

    def staging_reqs(self) -> list:
        """The staging requests, in queue order."""
        return [e[2] for e in self.ack_staging_queue]

    # -- device buffer --------------------------------------------------------------------
    def admit_request_direct(self, req) -> bool:
        """Give ``req`` its device buffer and preload its most recent tokens from host.

        Capacity is ``min(page_align(kv_committed_len), device_buffer_size)`` slots. Returns False
        (taking nothing) when the physical pool is short. Models ``admit_request_direct``.
        """
        row, n = req.kv.req_pool_idx, req.kv.kv_committed_len
        cap = min(self._align(max(n, 1)), self.device_buffer_size)
        slots = self.hisparse_attn_allocator.alloc(cap)
        if slots is None:
            return False
        pos = torch.full((cap,), -1, dtype=INDEX_DTYPE, device=slots.device)
        k = min(n, cap)
        pos[:k] = torch.arange(n - k, n, dtype=INDEX_DTYPE, device=slots.device)
        self.req_to_device_buffer[row], self.req_device_buffer_pos[row] = slots, pos
        if k:
            self._load(slots[:k], self.req_to_host_pool[row][n - k : n])
        req.hisparse_admitted = True
        return True

    def map_last_loc_to_buffer(self, req, pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Physical and host slot (each ``[1] int64``) for the new decode position ``pos``.

        Uses an empty buffer slot, else grows the buffer by one page (up to ``device_buffer_size``,
        if the physical pool has one), else reuses the slot of the oldest position (LRU).
        """
        row = req.kv.req_pool_idx
        host = self._ensure_host_slot(row, pos)
        slots, bpos = self.req_to_device_buffer[row], self.req_device_buffer_pos[row]
        empty = (bpos < 0).nonzero()
        if empty.numel() == 0 and slots.numel() < self.device_buffer_size:
            more = self.hisparse_attn_allocator.alloc(self.page_size)
            if more is not None:
                slots = self.req_to_device_buffer[row] = torch.cat((slots, more))
                bpos = self.req_device_buffer_pos[row] = torch.cat(
                    (bpos, torch.full((self.page_size,), -1, dtype=INDEX_DTYPE, device=bpos.device)))
                empty = (bpos < 0).nonzero()
        i = int(empty[0]) if empty.numel() else int(bpos.argmin())
        bpos[i] = pos
        return slots[i : i + 1], host

    def backup(self, device_loc: torch.Tensor, host_loc: torch.Tensor) -> None:
        """Copy K/V of device slots to host slots (both ``[n] int64``)."""
        if self.copy_kv:
            host_loc = host_loc.cpu()
            self.host_pool.k_buffer[:, host_loc] = self.kv_pool.k_buffer[:, device_loc].cpu()
            self.host_pool.v_buffer[:, host_loc] = self.kv_pool.v_buffer[:, device_loc].cpu()

    def _load(self, device_loc: torch.Tensor, host_loc: torch.Tensor) -> None:
        """Copy K/V of host slots to device slots (both ``[n] int64``)."""
        if not self.copy_kv:
            return
        dev = self.kv_pool.k_buffer.device
        self.kv_pool.k_buffer[:, device_loc] = self.host_pool.k_buffer[:, host_loc.cpu()].to(dev)
        self.kv_pool.v_buffer[:, device_loc] = self.host_pool.v_buffer[:, host_loc.cpu()].to(dev)

    def physical_context(self, req) -> tuple[torch.Tensor, torch.Tensor]:
        """``(slots, positions)``, each ``[m] int64`` sorted by position: the tokens attention reads."""
        row = req.kv.req_pool_idx
        bpos = self.req_device_buffer_pos[row]
        keep = (bpos >= 0).nonzero().squeeze(1)
        order = keep[bpos[keep].argsort()]
        return self.req_to_device_buffer[row][order], bpos[order]

    # -- lifecycle ------------------------------------------------------------------------
    def request_finished(self, req) -> None:
        """Free the request's device buffer, any prefill physical slots (finished in its prefill, or
        aborted before staging) and host slots, drop any staging entry, and clear its row's state."""
        row = req.kv.req_pool_idx
        self.ack_staging_queue = [e for e in self.ack_staging_queue if e[2] is not req]
        self.req_device_buffer_pos.pop(row, None)
        for pool, held in ((self.hisparse_attn_allocator, self.req_to_device_buffer),
                           (self.hisparse_attn_allocator, self.req_prefill_physical),
                           (self.host_pool, self.req_to_host_pool)):
            slots = held.pop(row, None)
            if slots is not None:
                pool.free(slots)
        req.hisparse_admitted = False
        setattr(req, "hisparse_staging", False)

    def buffer_size(self, row: int) -> int:
        b = self.req_to_device_buffer.get(row)
        return 0 if b is None else b.numel()

    def host_size(self, row: int) -> int:
        h = self.req_to_host_pool.get(row)
        return 0 if h is None else h.numel()

    def device_size(self, row: int) -> int:
        """Physical slots ``row`` holds: its buffer plus its prefill slots (tokens)."""
        p = self.req_prefill_physical.get(row)
        return self.buffer_size(row) + (0 if p is None else p.numel())

    def check_integrity(self, live_rows: set[int]) -> None:
        """Raise :class:`PoolIntegrityError` if a held physical or host slot is held twice (or its
        page by two rows), lies in page 0 or in its pool's free list; if a row's buffer and position
        tensors differ in length; if a staging entry's row has no host slots or is queued twice; or
        if any per-row state exists for a row not in ``live_rows``."""
        for name in ("req_to_device_buffer", "req_device_buffer_pos", "req_to_host_pool", "req_prefill_physical"):
            dead = sorted(set(getattr(self, name)) - set(live_rows))
            if dead:
                raise PoolIntegrityError(f"[hisparse] {name} holds state for dead rows {dead}")
        for row, buf in self.req_to_device_buffer.items():
            pos = self.req_device_buffer_pos.get(row)
            if pos is None or pos.numel() != buf.numel():
                raise PoolIntegrityError(f"[hisparse] row {row}: buffer has {buf.numel()} slots, positions "
                                         f"{None if pos is None else pos.numel()}")
        staged = [e[1] for e in self.ack_staging_queue]
        bad = sorted({r for r in staged if r not in self.req_to_host_pool})
        if bad or len(set(staged)) != len(staged):
            raise PoolIntegrityError(f"[hisparse] staging rows {staged}: without host slots {bad}")
        dev = {r: torch.cat([d[r] for d in (self.req_to_device_buffer, self.req_prefill_physical) if r in d])
               for r in set(self.req_to_device_buffer) | set(self.req_prefill_physical)}
        self._check_held(self.hisparse_attn_allocator, dev)
        self._check_held(self.host_pool, self.req_to_host_pool)

    @staticmethod
    def _check_held(pool: TokenToKVPoolAllocator, held: dict[int, torch.Tensor]) -> None:
        if not held:
            return
        slots = torch.cat([s.to(pool.device) for s in held.values()])
        dup = slots.numel() - torch.unique(slots).numel()
        pages = torch.cat([torch.unique(s.to(pool.device) // pool.page_size) for s in held.values()])
        shared = pages.numel() - torch.unique(pages).numel()
        in_free = int(torch.isin(pages, pool.free_pages).sum())
        zero = int((pages < 1).sum())
        if dup or shared or in_free or zero:
            raise PoolIntegrityError(f"[{pool.name}] held slots: {dup} duplicate slots, {shared} pages held by "
                                     f"two rows, {in_free} pages in the free list, {zero} in page 0")
