"""HiSparse coordinator: a small per-request device buffer backed by a host copy of every token.

Modelled on SGLang 0.5.x ``srt/managers/hisparse_coordinator.py`` (``HiSparseCoordinator``) and
``srt/mem_cache/allocator/hisparse.py``. Rows store *logical* token ids from the main allocator;
the attention KV of a request lives in (a) its device buffer, physical slots taken from
``hisparse_attn_allocator``, at most ``device_buffer_size`` of them, holding the most recent tokens,
and (b) host slots, one per position, in ``host_pool``. This version models the PD-decode direct
path (``admit_request_direct``) and decode growth (``map_last_loc_to_buffer``).

``request_finished`` must run before ``release_kv_cache`` on every finish path: it is the only
place that returns the buffer and host slots.
"""

from __future__ import annotations

import torch

from engine_under_test.memory import INDEX_DTYPE, HostKVPool, TokenToKVPoolAllocator


class HiSparseCoordinator:
    """Per-row state: ``req_to_device_buffer[row]`` (``[cap] int64`` physical slots),
    ``req_device_buffer_pos[row]`` (``[cap] int64`` position held by each slot, -1 if empty) and
    ``req_to_host_pool[row]`` (``[allocated] int64`` host slots by position, page-rounded)."""

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

    # -- host side ------------------------------------------------------------------------
    def alloc_host(self, row: int, num_tokens: int) -> bool:
        """Allocate page-rounded host slots for positions ``[0, num_tokens)`` of ``row`` (the RDMA
        target of a PD transfer). Returns False, taking nothing, when the host pool is short."""
        need = -(-num_tokens // self.page_size) * self.page_size
        slots = self.host_pool.alloc(need)
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

    # -- device buffer --------------------------------------------------------------------
    def admit_request_direct(self, req) -> bool:
        """Give ``req`` its device buffer and preload its most recent tokens from host.

        Capacity is ``min(page_align(kv_committed_len), device_buffer_size)`` slots. Returns False
        (taking nothing) when the physical pool is short. Models ``admit_request_direct``.
        """
        row, n = req.kv.req_pool_idx, req.kv.kv_committed_len
        cap = min(-(-max(n, 1) // self.page_size) * self.page_size, self.device_buffer_size)
        slots = self.hisparse_attn_allocator.alloc(cap)
        if slots is None:
            return False
        pos = torch.full((cap,), -1, dtype=INDEX_DTYPE, device=slots.device)
        k = min(n, cap)
        pos[:k] = torch.arange(n - k, n, dtype=INDEX_DTYPE, device=slots.device)
        self.req_to_device_buffer[row], self.req_device_buffer_pos[row] = slots, pos
        if self.copy_kv and k:
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
            self.host_pool.k_buffer[:, host_loc] = self.kv_pool.k_buffer[:, device_loc].cpu()
            self.host_pool.v_buffer[:, host_loc] = self.kv_pool.v_buffer[:, device_loc].cpu()

    def _load(self, device_loc: torch.Tensor, host_loc: torch.Tensor) -> None:
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
        """Free the request's device buffer and host slots and clear its row's state."""
        row = req.kv.req_pool_idx
        buf = self.req_to_device_buffer.pop(row, None)
        self.req_device_buffer_pos.pop(row, None)
        host = self.req_to_host_pool.pop(row, None)
        if buf is not None:
            self.hisparse_attn_allocator.free(buf)
        if host is not None:
            self.host_pool.free(host)
        req.hisparse_admitted = False

    def buffer_size(self, row: int) -> int:
        b = self.req_to_device_buffer.get(row)
        return 0 if b is None else b.numel()

    def host_size(self, row: int) -> int:
        h = self.req_to_host_pool.get(row)
        return 0 if h is None else h.numel()
