"""Device and host memory pools: the paged KV slot allocator, the request rows, the KV tensors.

Modelled on SGLang 0.5.x ``srt/mem_cache/allocator/{token,paged}.py`` (``TokenToKVPoolAllocator``,
``PagedTokenToKVPoolAllocator``), ``srt/mem_cache/memory_pool.py`` (``ReqToTokenPool``,
``MHATokenToKVPool``) and ``srt/mem_cache/pool_host/base.py`` (``HostKVCache``).

Index layout (both pools): index 0 is reserved as the padding sink and is never handed out.
A token slot ``t`` lives in page ``t // page_size``; page ids run ``1..num_pages``.
"""

from __future__ import annotations

import torch

INDEX_DTYPE = torch.int64


class PoolIntegrityError(AssertionError):
    """A pool's own bookkeeping is inconsistent (raised by ``check_integrity``)."""


class TokenToKVPoolAllocator:
    """Paged allocator of KV slots.

    ``size`` is in tokens and is rounded down to whole pages. ``alloc*`` return token indices
    (``[n] int64`` on ``device``) or ``None`` when the pool is short; they never evict.
    ``free`` takes token indices and returns every page they touch (SGLang's paged ``free`` does
    ``unique(index // page_size)``). Inside a free group, frees are recorded and applied together at
    ``free_group_end`` (SGLang ``free_group_begin/end``, used around result processing).
    """

    def __init__(self, size: int, page_size: int = 1, device: str = "cpu", name: str = "token_to_kv_pool"):
        self.page_size = page_size
        self.num_pages = size // page_size
        self.size = self.num_pages * page_size
        self.device = torch.device(device)
        self.name = name
        self.clear()

    # -- state -------------------------------------------------------------------------
    def clear(self) -> None:
        """Return every page to the free list (SGLang ``clear``, used by ``flush_cache``)."""
        self.free_pages = torch.arange(1, self.num_pages + 1, dtype=INDEX_DTYPE, device=self.device)
        self.is_not_in_free_group = True
        self.free_group: list[torch.Tensor] = []

    def available_size(self) -> int:
        """Free tokens: free pages times ``page_size``. Pending group frees are not counted."""
        return self.free_pages.numel() * self.page_size

    def _pages_to_tokens(self, pages: torch.Tensor) -> torch.Tensor:
        if self.page_size == 1:
            return pages
        offs = torch.arange(self.page_size, dtype=INDEX_DTYPE, device=self.device)
        return (pages[:, None] * self.page_size + offs).reshape(-1)

    def _take_pages(self, k: int) -> torch.Tensor | None:
        if k > self.free_pages.numel():
            return None
        pages, self.free_pages = self.free_pages[:k], self.free_pages[k:]
        return pages

    # -- allocation ----------------------------------------------------------------------
    def alloc(self, need_size: int) -> torch.Tensor | None:
        """Allocate ``need_size`` tokens (a multiple of ``page_size``) as whole fresh pages.

        Returns ``[need_size] int64`` token indices, or ``None`` if fewer pages are free.
        Raises ``ValueError`` if ``need_size`` is not page-aligned.
        """
        if need_size % self.page_size:
            raise ValueError(f"alloc({need_size}) is not a multiple of page_size={self.page_size}")
        pages = self._take_pages(need_size // self.page_size)
        return None if pages is None else self._pages_to_tokens(pages)

    def alloc_extend(self, prefix_lens: list[int], seq_lens: list[int], last_loc: torch.Tensor) -> torch.Tensor | None:
        """Slots for positions ``[prefix_len, seq_len)`` of each request, concatenated.

        ``last_loc`` is ``[bs] int64``: the slot of position ``prefix_len - 1`` (or ``-1``).
        Each request first fills the rest of its partly used last page (``last_loc + 1 ...``),
        then takes fresh pages: ``ceil(seq/ps) - ceil(prefix/ps)`` of them
        (SGLang ``alloc_extend`` and ``get_num_new_pages``). Returns ``[sum(seq - prefix)] int64``
        or ``None`` (nothing taken) when the pool is short.
        """
        ps = self.page_size
        if ps == 1:
            return self.alloc(sum(s - p for p, s in zip(prefix_lens, seq_lens)))
        new_pages = [-(-s // ps) - (-(-p // ps)) for p, s in zip(prefix_lens, seq_lens)]
        pages = self._take_pages(sum(new_pages))
        if pages is None:
            return None
        parts, used = [], 0
        for i, (p, s) in enumerate(zip(prefix_lens, seq_lens)):
            in_page = min(s, -(-p // ps) * ps) - p  # rest of the partly filled last page
            if in_page > 0:
                start = int(last_loc[i]) + 1
                parts.append(torch.arange(start, start + in_page, dtype=INDEX_DTYPE, device=self.device))
            n_fresh = s - p - max(in_page, 0)
            if n_fresh > 0:
                mine = pages[used : used + new_pages[i]]
                parts.append(self._pages_to_tokens(mine)[:n_fresh])
            used += new_pages[i]
        if not parts:
            return torch.empty(0, dtype=INDEX_DTYPE, device=self.device)
        return torch.cat(parts)

    def alloc_decode(self, seq_lens: list[int], last_loc: torch.Tensor) -> torch.Tensor | None:
        """One slot per request for position ``seq_len - 1`` (``seq_lens`` counts the new token).

        A fresh page is taken only where the new position starts a page (SGLang ``alloc_decode``).
        ``last_loc`` is ``[bs] int64``. Returns ``[bs] int64`` or ``None`` when short.
        """
        ps = self.page_size
        if ps == 1:
            return self.alloc(len(seq_lens))
        needs = torch.tensor([(s - 1) % ps == 0 for s in seq_lens], device=self.device)
        pages = self._take_pages(int(sum((s - 1) % ps == 0 for s in seq_lens)))
        if pages is None:
            return None
        out = last_loc.to(INDEX_DTYPE) + 1
        out[needs] = pages * ps
        return out

    # -- release -------------------------------------------------------------------------
    def free(self, free_index: torch.Tensor) -> None:
        """Return the pages touched by token indices ``free_index`` (``[n] int64``) to the pool.

        Double frees are *not* detected here (SGLang only does so in debug mode); the duplicate page
        simply lands in the free list twice.
        """
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        pages = free_index if self.page_size == 1 else torch.unique(free_index // self.page_size)
        self.free_pages = torch.cat((self.free_pages, pages.to(INDEX_DTYPE)))

    def free_group_begin(self) -> None:
        if not self.is_not_in_free_group:
            raise RuntimeError("free groups cannot nest")
        self.is_not_in_free_group = False
        self.free_group = []

    def free_group_end(self) -> None:
        self.is_not_in_free_group = True
        if self.free_group:
            self.free(torch.cat(self.free_group))
        self.free_group = []

    def check_integrity(self) -> None:
        """Raise :class:`PoolIntegrityError` if the free list holds page 0, an out-of-range or a duplicate page."""
        fp = self.free_pages
        if fp.numel() and (int(fp.min()) < 1 or int(fp.max()) > self.num_pages):
            raise PoolIntegrityError(f"[{self.name}] free list holds a page outside 1..{self.num_pages}")
        dup = fp.numel() - torch.unique(fp).numel()
        if dup:
            raise PoolIntegrityError(f"[{self.name}] {dup} duplicate pages in the free list")


class HostKVPool(TokenToKVPoolAllocator):
    """Host-memory KV slots (SGLang ``HostKVCache``), page-granular, with K/V tensors on the CPU.

    ``alloc(n)`` needs ``n`` page-aligned. Index 0 is reserved, as on the device.
    """

    def __init__(self, size: int, page_size: int, num_layers: int, num_heads: int, head_dim: int,
                 name: str = "host_pool"):
        super().__init__(size, page_size, "cpu", name)
        shape = (num_layers, (self.num_pages + 1) * page_size, num_heads, head_dim)
        self.k_buffer = torch.zeros(shape)
        self.v_buffer = torch.zeros(shape)
        self.compute_device = torch.device("cpu")  # where get_kv hands tensors to the model

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        MHATokenToKVPool.set_kv(self, layer, loc.cpu(), k.cpu(), v.cpu())

    def get_kv(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = MHATokenToKVPool.get_kv(self, layer, loc.cpu())
        return k.to(self.compute_device), v.to(self.compute_device)


class ReqToTokenPool:
    """Request rows: row ``r`` maps a request's positions to KV slot indices.

    ``req_to_token`` is ``[size + pre_alloc_size + 1, max_context_len] int64``; row 0 is reserved.
    ``pre_alloc_size`` extra rows model ``DecodeReqToTokenPool`` (PD decode pre-allocation).
    ``alloc(n)`` returns ``n`` row ids or ``None``; ``free(rows)`` takes an int or a list.
    """

    def __init__(self, size: int, max_context_len: int, device: str = "cpu", pre_alloc_size: int = 0):
        self.size = size
        self.pre_alloc_size = pre_alloc_size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size + pre_alloc_size + 1, max_context_len), dtype=INDEX_DTYPE,
                                        device=self.device)
        self.clear()

    def clear(self) -> None:
        self.free_slots = list(range(1, self.size + self.pre_alloc_size + 1))

    def available_size(self) -> int:
        return len(self.free_slots)

    def alloc(self, need_size: int) -> list[int] | None:
        if need_size > len(self.free_slots):
            return None
        rows, self.free_slots = self.free_slots[:need_size], self.free_slots[need_size:]
        return rows

    def free(self, rows: int | list[int]) -> None:
        self.free_slots.extend([rows] if isinstance(rows, int) else rows)

    def write(self, row: int, start: int, indices: torch.Tensor) -> None:
        """Write slot ``indices`` (``[n] int64``) into positions ``[start, start+n)`` of ``row``."""
        self.req_to_token[row, start : start + indices.numel()] = indices

    def check_integrity(self) -> None:
        if len(set(self.free_slots)) != len(self.free_slots):
            raise PoolIntegrityError("[req_to_token_pool] duplicate rows in free_slots")
        if any(r < 1 or r > self.size + self.pre_alloc_size for r in self.free_slots):
            raise PoolIntegrityError("[req_to_token_pool] free_slots holds an out-of-range row")


class MHATokenToKVPool:
    """K and V tensors, ``[num_layers, num_slots, num_heads, head_dim]`` each, on ``device``."""

    def __init__(self, num_slots: int, num_layers: int, num_heads: int, head_dim: int, device: str = "cpu"):
        shape = (num_layers, num_slots, num_heads, head_dim)
        self.k_buffer = torch.zeros(shape, device=device)
        self.v_buffer = torch.zeros(shape, device=device)

    def set_kv(self, layer: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Write ``k``/``v`` (``[n, heads, head_dim]``) into slots ``loc`` (``[n] int64``)."""
        self.k_buffer[layer, loc] = k
        self.v_buffer[layer, loc] = v

    def get_kv(self, layer: int, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k_buffer[layer, loc], self.v_buffer[layer, loc]
