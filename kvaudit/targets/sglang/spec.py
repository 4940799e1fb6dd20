"""Speculative decoding, spec v2 (SGLang 0.5.23's EAGLE / n-gram path), its memory side on CPU.

SGLang's own code: ``ScheduleBatch.prepare_for_decode``'s spec branch, ``spec_utils.spec_prepare_for_decode`` ->
``eagle_utils.eagle_prepare_for_decode`` -> ``allocation.alloc_for_spec_decode`` (each decode step reserves up to
``kv_committed_len + get_alloc_reserve_per_decode()``, page-aligned, into ``kv_allocated_len``; at page > 1
``alloc_paged_token_slots_extend`` after ``get_last_loc_torch``, SGLang's torch variant of its triton dispatch); the
batch result through ``SchedulerBatchResultProcessor.process_batch_result_decode`` -> ``_resolve_spec_v2_tokens``
(commits each request's accepted run: ``kv_committed_len += accept_len``); ``check_decode_mem`` / ``retract_decode`` with
the spec estimate (``_new_tokens_required_next_decode_spec_v2``); ``release_kv_cache``, whose
``_release_overallocated_kv_indices`` frees the reserved-but-uncommitted tail ``[ceil(owned), kv_allocated_len)``.

The stand-in plays the draft and target forwards (:func:`accepted_drafts`, :func:`assign_rows`); the
``spec-row-width`` check and the ``spec-draft-kv`` oracle: docs/internals/sglang.md ("Speculative decoding
(spec v2)")."""

from __future__ import annotations

import functools
import weakref
import zlib
from unittest.mock import patch

import numpy as np
import torch

from kvaudit.targets.base import TargetFinding
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.feature import SglangFeature

FAULT = "spec-leak-rejected-draft"
# id(tree_cache) -> the SpecDecode feature of the target that owns it (the release wrapper's dispatch)
_FEATURES: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def accepted_drafts(seed: int, rid: str, n_out: int, most: int) -> int:
    """The stand-in verify's accepted draft tokens (0..``most``) for request ``rid`` at output length ``n_out``:
    a CRC of the three, so the same program accepts the same runs on every replay."""
    return zlib.crc32(f"{seed}:{rid}:{n_out}".encode()) % (most + 1)


def assign_rows(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, batch_size,
                record=None) -> None:
    """Stand-in for the GPU kernel ``allocation.assign_req_to_token_pool`` (``assign_req_to_token_pool_func``):
    row ``req_pool_indices[i]`` gets ``out_cache_loc``'s next ``end_offset[i] - start_offset[i]`` slots at
    ``[start_offset[i], end_offset[i])``, requests in batch order. As the kernel does, a position is
    ``row * row_width + offset`` in the flat table, with no bound check on the row's width: an end past the
    row writes into the next row (past the table's end, memory outside it on a GPU: dropped here, the
    ``spec-row-width`` check reports the request). ``record`` (a :class:`RowWrites`, optional) records where
    the slots went, the ones past the table as such."""
    lens = (end_offset - start_offset).to(torch.int64).cpu()
    total = int(lens.sum())
    if total == 0:
        return
    rows = torch.repeat_interleave(req_pool_indices.to(torch.int64).cpu(), lens)
    base = torch.repeat_interleave(start_offset.to(torch.int64).cpu() - (torch.cumsum(lens, 0) - lens), lens)
    flat = rows * req_to_token.shape[1] + base + torch.arange(total)
    inside = flat < req_to_token.numel()
    req_to_token.view(-1)[flat[inside].to(req_to_token.device)] = \
        out_cache_loc[:total][inside.to(out_cache_loc.device)].to(req_to_token.dtype)
    if record is not None:
        record.put(flat // req_to_token.shape[1], out_cache_loc[:total], past=~inside)


def _install_release_wrapper() -> None:
    """Wraps ``common._release_overallocated_kv_indices`` once per process: a release on a spec target's tree goes
    through its feature (:meth:`SpecDecode.release_tail`), any other straight to SGLang's."""
    import sglang.srt.mem_cache.common as common

    if getattr(common._release_overallocated_kv_indices, "kvaudit_spec", False):
        return
    own = common._release_overallocated_kv_indices

    def release_overallocated(req, start_p, end_p, tree_cache):
        f = _FEATURES.get(id(tree_cache))
        if f is None or f.target.tree_cache is not tree_cache:
            return own(req, start_p, end_p, tree_cache)
        return f.release_tail(own, req, start_p, end_p, tree_cache)

    release_overallocated.kvaudit_spec = True
    common._release_overallocated_kv_indices = release_overallocated


class SpecDecode(SglangFeature):
    """Spec v2 on the shared driver: SGLang's decode preparation and result commit, the stand-in verify, the
    ``spec-draft-kv`` oracle and the ``spec-leak-rejected-draft`` fault."""

    name = "spec"

    def __init__(self, target):
        super().__init__(target)
        self.steps = 0  # decode results whose verify SGLang's processor committed
        self.accepted = 0  # draft tokens accepted (the bonus token not counted)
        self.rejected = 0  # draft tokens rejected
        self.reserved = 0  # slots spec_prepare_for_decode reserved
        self.tail_releases = 0  # releases that freed a reserved-but-uncommitted tail
        self.tail_slots = 0  # slots those releases gave back
        self._released: list[tuple[str, int, np.ndarray]] = []  # (rid, step, pages) tails released, to check
        self._overflows: list[tuple] = []  # (rid, row, kv_allocated_len, row width, step): reservations past the row
        self.session_tails = 0  # finished turns whose row went to their streaming session with a reserved tail

    # -- construction ------------------------------------------------------------------------------
    def attach(self) -> None:
        """The release wrapper's dispatch entry; with streaming sessions, a wrapper on the tree's
        ``claim_kv_row``: a finished turn whose row its session keeps with a reserved tail (sglang#22862's path;
        ``StreamingSession._trim_overshoot`` frees past the finished length) is counted, and the pages the
        record gave up are checked as a released tail."""
        _FEATURES[id(self.target.tree_cache)] = self
        _install_release_wrapper()
        if self.target.session_controller is None:
            return
        t = self.target
        cache, table = t.tree_cache, t.req_to_token_pool.req_to_token
        claim = cache.claim_kv_row

        def claim_kv_row(req):
            kv = req.kv  # the session record the turn ran on (claim_kv_row detaches it from the request)
            if not kv.holds_kv or kv.kv_allocated_len <= kv.kv_committed_len:
                return claim(req)
            before = t._pages(table[kv.req_pool_idx, :kv.kv_allocated_len])
            out = claim(req)
            if out:  # the record kept [0, allocated) as trimmed: what it gave up is a released tail
                self.session_tails += 1
                dropped = np.setdiff1d(before, t._pages(table[kv.req_pool_idx, :kv.kv_allocated_len]))
                if dropped.size:
                    self._released.append((req.rid, t.steps, dropped))
            return out

        cache.claim_kv_row = claim_kv_row

    def close(self) -> None:
        _FEATURES.pop(id(self.target.tree_cache), None)

    @property
    def draft_tokens(self) -> int:
        """The verify's tokens per request (``speculative_num_draft_tokens``): the bonus slot and the drafts."""
        return self.target.config.speculative_num_draft_tokens

    # -- driver ------------------------------------------------------------------------------------
    def spec_algorithm(self, algo):
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        return SpeculativeAlgorithm.from_string(self.target.config.speculative_algorithm.upper())

    def decode_alloc(self, batch) -> bool:
        """``prepare_for_decode``'s spec branch: SGLang's ``spec_prepare_for_decode`` (which counts
        ``decode_batch_idx`` itself), the row writes by :func:`assign_rows` and the last slots by SGLang's
        ``get_last_loc_torch`` (the GPU kernels' parts)."""
        import sglang.srt.mem_cache.allocation as allocation
        from sglang.srt.speculative.spec_utils import spec_prepare_for_decode

        before = sum(r.kv.kv_allocated_len for r in batch.reqs)
        # the two GPU kernels: the row writes, and (page > 1) get_last_loc's triton dispatch -> SGLang's torch variant
        assign = functools.partial(assign_rows, record=getattr(self.target, "row_writes", None))
        with patch.object(allocation, "assign_req_to_token_pool_func", assign), \
                patch.object(allocation, "get_last_loc", allocation.get_last_loc_torch):
            spec_prepare_for_decode(batch)
        self.reserved += sum(r.kv.kv_allocated_len for r in batch.reqs) - before
        width = batch.req_to_token_pool.req_to_token.shape[1]
        self._overflows += [(r.rid, r.kv.req_pool_idx, r.kv.kv_allocated_len, width, self.target.steps)
                            for r in batch.reqs if r.kv.kv_allocated_len > width]
        for req in batch.reqs:  # the verify's seq_len: the committed KV and the pending bonus token
            req.kvaudit_seq_len = req.kv.kv_committed_len + 1
        return True

    def model_result(self, kind: str, batch):
        """A decode batch's verify: per request ``accept_len`` = accepted drafts + the bonus token, its tokens
        padded to ``speculative_num_draft_tokens`` a row (``_resolve_spec_v2_tokens`` reads both). A prefill's
        result is the plain one (the draft's extend reserves no slot of its own)."""
        if kind != "decode":
            return None
        from sglang.srt.managers.utils import GenerationBatchResult

        t, d = self.target, self.draft_tokens
        tokens = torch.zeros(len(batch.reqs) * d, dtype=torch.int64)
        accept = []
        for i, req in enumerate(batch.reqs):
            n = len(req.output_ids)
            k = accepted_drafts(t.config.seed, req.rid, n, d - 1)
            tokens[i * d: i * d + k + 1] = torch.tensor([t._sample_at(req, n + j) for j in range(k + 1)])
            accept.append(k + 1)
            if not (req.finished() or req.is_retracted):  # (rows SGLang's resolve skips commit nothing)
                self.accepted += k
                self.rejected += d - 1 - k
        self.steps += 1
        return GenerationBatchResult(next_token_ids=tokens, accept_lens=torch.tensor(accept, dtype=torch.int64),
                                     speculative_num_draft_tokens=d, num_non_draft_tokens_per_req=1)

    def release_tail(self, own, req, start_p: int, end_p: int, tree_cache) -> None:
        """``_release_overallocated_kv_indices(req, owned, kv_allocated_len, tree)``: the reserved tail past the
        owned KV, recorded for the oracle (the fault drops its free once)."""
        t = self.target
        start = t._ceil(start_p)
        if start < end_p:
            self.tail_releases += 1
            self.tail_slots += end_p - start
            pages = t._pages(t.req_to_token_pool.req_to_token[req.kv.req_pool_idx, start:end_p])
            self._released.append((req.rid, t.steps, pages))
            if FAULT in t._faults:
                t._faults.discard(FAULT)
                return
        own(req, start_p, end_p, tree_cache)

    # -- observer ----------------------------------------------------------------------------------
    def invariant_findings(self, out: list) -> list:
        """``spec-row-width``: a reservation past its row since the last check (aliasing of the next row);
        ``spec-draft-kv``: a live request's reserved tail on the free list (use-after-free), a released tail
        neither free, in the tree, nor held by a live request or session (leak)."""
        t = self.target
        kv_pool = t._pools[0]  # the (full) KV pool: a hybrid's full_attn_allocator
        free = np.zeros(kv_pool.num_units + 1, dtype=bool)
        free[compat.free_pages(kv_pool.obj, t.S.version).cpu().numpy()] = True
        table = t.req_to_token_pool.req_to_token
        overflows, self._overflows = self._overflows, []
        for rid, row, allocated, width, step in overflows:  # SGLang's invariant: kv_allocated_len <= row_width
            out.append(TargetFinding(
                "aliasing", "req_to_token_pool", np.array([row], dtype=np.int64),
                f"request {rid}'s draft reservation ran to {allocated}, past its req_to_token row ({width} wide: "
                f"context_len + get_req_to_token_extra_context_len()): alloc_for_spec_decode's row write put "
                f"{allocated - width} slot(s) past the row's end, into the next row (past the table from the last "
                f"row) (step {step})", check="spec-row-width"))
        for req in t._live():
            kv = req.kv
            tail = t._pages(table[kv.req_pool_idx, kv.kv_committed_len:kv.kv_allocated_len])
            lost = tail[free[tail]]
            if lost.size:
                out.append(TargetFinding(
                    "use-after-free", "token_to_kv_pool", lost,
                    f"request {req.rid}'s {lost.size} reserved draft {self._unit} [{kv.kv_committed_len}, "
                    f"{kv.kv_allocated_len}) are on the free list while its row reserves them (step {t.steps})",
                    check="spec-draft-kv"))
        released, self._released = self._released, []
        if not released:
            return out
        held = free.copy()
        values = t.tree_cache.all_values_flatten()
        held[t._pages(values)] = True
        kvs = [r.kv for r in t._live()] + [s.kv for _, s in t._slots() if s.kv.holds_kv]
        for kv in kvs:
            held[t._pages(table[kv.req_pool_idx, :kv.kv_allocated_len])] = True
        for rid, step, pages in released:
            lost = pages[~held[pages]]
            if lost.size:
                out.append(TargetFinding(
                    "leak", "token_to_kv_pool", lost,
                    f"request {rid}'s {lost.size} reserved-but-uncommitted draft {self._unit} were neither committed "
                    f"nor freed at its release (step {step}): not free, in no tree node, held by no request",
                    check="spec-draft-kv"))
        return out

    @property
    def _unit(self) -> str:
        ps = self.target.config.page_size
        return "slot(s)" if ps == 1 else f"page(s) of {ps}"

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """``spec_steps`` (verify results committed), ``draft_tokens_accepted``, ``draft_tokens_rejected``,
        ``spec_slots_reserved`` (by spec_prepare_for_decode), ``spec_tail_releases`` / ``spec_tail_slots``
        (reserved-but-uncommitted tails freed at a release); with streaming sessions ``spec_session_tails``
        (finished turns whose row, reserved tail included, their session kept)."""
        out.update(spec_steps=self.steps, draft_tokens_accepted=self.accepted, draft_tokens_rejected=self.rejected,
                   spec_slots_reserved=self.reserved, spec_tail_releases=self.tail_releases,
                   spec_tail_slots=self.tail_slots)
        if self.target.session_controller is not None:
            out["spec_session_tails"] = self.session_tails
        return out
