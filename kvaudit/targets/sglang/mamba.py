"""Mamba / hybrid linear attention (``config.enable_mamba``): SGLang 0.5.23's per-request state slots for a
hybrid SSM model (``HybridReqToTokenPool`` with its ``MambaPool`` and ``MambaSlotAllocator``) under the
``UnifiedRadixCache`` with its ``MAMBA`` component, built as ``kv_cache_configurator`` and
``registry.create_tree_cache`` build them for a model whose config carries mamba state (``is_hybrid_ssm``).

The model is a stand-in (no kernel runs; SGLang's own code allocates, copies, donates and frees the state
slots): docs/internals/sglang.md ("Mamba")."""

from __future__ import annotations

import sys
import warnings
from types import SimpleNamespace

import numpy as np
import torch

from kvaudit.targets.base import Accounting, PoolSpec, Root, TargetFinding
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.boot import SglangUnavailable, build, publish_server_args, row_width
from kvaudit.targets.sglang.feature import SglangFeature

# the stand-in model: one mamba layer (id 0) and one full-attention layer (id 1)
MAMBA_LAYERS, FULL_LAYERS = [0], [1]
# frames above a mamba-slot free that name its cause (the driver's and SGLang's functions)
ABORT_FRAMES = frozenset({"_abort", "_process_pending_chunked_abort", "_release_queued_mamba"})
RETRACT_FRAMES = frozenset({"release_req"})  # retract_decode, retract_all, preempt_to_schedule
# the extra buffer's counters: track snapshots the forward wrote (mixed steps apart), those of a mixed step,
# tracked states donated to the tree (checkpoint or finish), and those checked against their node's depth
TRACK_COUNTERS = ("mamba_track_writes", "mamba_track_writes_mixed", "mamba_track_donations")


def cache_params():
    """``Mamba2CacheParams`` of the stand-in model (``Mamba2StateShape.create`` of a Mamba2 mixer with 4
    channels, 2 heads of dim 2, state size 2, conv kernel 2)."""
    from sglang.srt.configs.mamba_utils import Mamba2CacheParams, Mamba2StateDType, Mamba2StateShape

    shape = Mamba2StateShape.create(tp_world_size=1, intermediate_size=4, n_groups=1, num_heads=2, head_dim=2,
                                    state_size=2, conv_kernel=2)
    return Mamba2CacheParams(shape=shape, layers=list(MAMBA_LAYERS),
                             dtype=Mamba2StateDType(conv=torch.float32, temporal=torch.float32))


class Mamba(SglangFeature):
    """Hybrid SSM (``config.enable_mamba``): the mamba slot pool as its own audited pool, SGLang's idle
    mamba check, a slot balance invariant and the path's counters."""

    name = "mamba"

    def build(self, config):
        """``HybridReqToTokenPool`` (``_build_hybrid_req_pool``), ``HybridLinearKVPool`` over its mamba pool
        with a ``TokenToKVPoolAllocator`` (``_build_token_to_kv_pool``), then ``create_tree_cache`` with
        ``is_hybrid_ssm``. Sets ``self.rows`` and ``self.slots`` (the ``MambaSlotAllocator``)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            try:
                from sglang.srt.mem_cache.memory_pool import HybridLinearKVPool, HybridReqToTokenPool
            except ImportError as exc:
                raise SglangUnavailable(f"SGLang {self.target.S.version}'s mamba pools do not import: {exc}") \
                    from None
        S, dev = self.target.S, config.device
        strategy = {"mamba_radix_cache_strategy": "extra_buffer"} if config.mamba_extra_buffer else {}
        sa = publish_server_args(config, max_mamba_cache_size=config.max_mamba_cache_size,
                                 disable_overlap_schedule=not config.enable_overlap, **strategy)
        # overrides.mamba_cache_chunk_size honours a pre-seeded value (what the model's hf config would give)
        sa._mamba_cache_chunk_size = config.mamba_chunk_size
        rows = HybridReqToTokenPool(size=config.max_req_rows, mamba_size=config.max_mamba_cache_size,
                                    mamba_spec_state_size=config.max_req_rows,
                                    max_context_len=row_width(config), device=dev, enable_memory_saver=False,
                                    cache_params=cache_params(), mamba_layer_ids=list(MAMBA_LAYERS),
                                    enable_mamba_extra_buffer=config.mamba_extra_buffer,
                                    enable_overlap_schedule=config.enable_overlap)

        def make_kv(dev):
            kv = HybridLinearKVPool(size=config.total_tokens, dtype=torch.bfloat16, page_size=1, head_num=1,
                                    head_dim=8, full_attention_layer_ids=list(FULL_LAYERS), device=dev,
                                    mamba_pool=rows.mamba_pool)
            return kv, S.TokenToKVPoolAllocator(config.total_tokens, torch.bfloat16, dev, kv, config.need_sort)

        self.rows, self.slots = rows, rows.mamba_allocator
        self.counts = dict.fromkeys(("mamba_slots_freed_on_abort", "mamba_slots_freed_on_retract",
                                     "mamba_tree_hits", "mamba_tree_evictions")
                                    + (TRACK_COUNTERS if config.mamba_extra_buffer else ()), 0)
        # the stand-in kernel's state tags: the token depth whose state each slot holds (-1: never written)
        self.written = np.full(config.max_mamba_cache_size + 2, -1, np.int64)
        self.stale: list[TargetFinding] = []
        out = build(config, server_args=sa, make_kv=make_kv, make_rows=lambda dev: rows,
                    hybrid={"is_hybrid_ssm": True, "enable_mamba_extra_buffer": config.mamba_extra_buffer})
        # what prepare_for_extend's track step reads of the model: its mamba_chunk_size (the state grid)
        out.model_config.hf_text_config = SimpleNamespace(mamba_chunk_size=config.mamba_chunk_size)
        return out

    def pools(self, pools: list) -> list:
        return pools + [PoolSpec("mamba_pool", self.slots, "mamba", 1, self.slots.size)]

    def attach(self) -> None:
        """The counters' wrappers (instances only), and the planted fault."""
        t = self.target
        self._wrap_counters()
        if "mamba-leak-on-release" in t._faults:
            self._plant_leak_on_release()
        if "mamba-free-donated" in t._faults:
            self._plant_free_donated()
        if t.config.mamba_extra_buffer:
            self._wrap_donations()

    # -- counters ------------------------------------------------------------------------------
    def _wrap_counters(self) -> None:
        cache, slots, counts = self.target.tree_cache, self.slots, self.counts
        free, abort = slots.free, self.target.S.FINISH_ABORT

        def free_counting(idx):
            n = int(idx.numel())
            if n:
                names, req = _callers(16)
                if names & RETRACT_FRAMES:
                    counts["mamba_slots_freed_on_retract"] += n
                elif names & ABORT_FRAMES or isinstance(getattr(req, "finished_reason", None), abort):
                    counts["mamba_slots_freed_on_abort"] += n
            return free(idx)

        slots.free = free_counting
        evict = cache._evict

        def evict_counting(*a, **k):
            out = evict(*a, **k)
            counts["mamba_tree_evictions"] += int(getattr(out, "mamba_num_evicted", 0) or 0)
            return out

        cache._evict = evict_counting
        comp = self.component
        finalize = comp.finalize_match_result_in_cache

        def finalize_counting(params, result):
            out = finalize(params, result)
            if params.cow_mamba and params.req is not None and params.req.kv.mamba_cow_src_index is not None:
                counts["mamba_tree_hits"] += 1
            return out

        comp.finalize_match_result_in_cache = finalize_counting

    @property
    def component(self):
        """The tree's ``MambaComponent``."""
        from sglang.srt.mem_cache.unified_cache.component_type import ComponentType
        return next(c for c in self.target.tree_cache._components_tuple if c.component_type == ComponentType.MAMBA)

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """Mamba slots freed by an abort's release (waiting, running, chunked) and by a retraction's
        ``release_req``; prefix hits whose state was copied from the tree; tree states evicted."""
        return {**out, **self.counts}

    # -- the extra buffer: track snapshots and what the tree is given ---------------------------
    def after_extend_alloc(self, batch) -> None:
        """``prepare_for_extend``'s extra-buffer step: SGLang's own
        ``ScheduleBatch._mamba_radix_cache_v2_req_prepare_for_extend`` per request (it picks the ping-pong
        slot, sets ``mamba_last_track_seqlen``, flips ``mamba_next_track_idx``), then the batch's track fields
        as ``prepare_for_extend`` builds them (``mamba_track_indices`` / ``_mask`` / ``_seqlens`` ``[bs]``, and
        their CPU lists)."""
        if not self.target.config.mamba_extra_buffer:
            return
        entries = [batch._mamba_radix_cache_v2_req_prepare_for_extend(r) for r in batch.reqs]
        mask, seqlens = [e.track_mask for e in entries], [e.track_seqlen for e in entries]
        if compat.has("mamba-track-position", self.target.S.version):
            mapping = self.rows.req_index_to_mamba_ping_pong_track_buffer_mapping
            positions = torch.tensor([e.track_position for e in entries], dtype=torch.int64)
            indices = mapping[batch.req_pool_indices.to(torch.int64), positions.to(mapping.device)]
        else:
            indices = torch.tensor([e.track_index for e in entries], dtype=torch.int64)
        batch.mamba_prefill_track_mask_cpu, batch.mamba_track_seqlens_cpu = mask, seqlens
        batch.mamba_track_indices = indices.to(batch.device)
        batch.mamba_track_mask = torch.tensor(mask, dtype=torch.bool, device=batch.device)
        batch.mamba_track_seqlens = torch.tensor(seqlens, dtype=torch.int64, device=batch.device)

    def forward(self, batch) -> None:
        """The stand-in kernel's track snapshots, from what the backend reads of the batch that runs
        (``HybridLinearAttnBackend._init_track_ssm_indices``): each row set in ``mamba_track_mask`` writes the
        state after ``prefix + (track_seqlen - prefix) // chunk * chunk`` tokens (the final state when the
        extend is chunk-aligned, the chunk-boundary ``h`` otherwise) into its ``mamba_track_indices`` slot;
        that depth becomes the slot's tag. A batch without track fields snapshots nothing."""
        if batch.mamba_track_indices is None or batch.mamba_track_mask is None:
            return
        mask = batch.mamba_track_mask.cpu().numpy()
        rows = np.flatnonzero(mask)
        if not rows.size:
            return
        chunk = self.target.config.mamba_chunk_size
        prefix = np.asarray(batch.prefix_lens, dtype=np.int64)[:mask.size][rows]
        track = batch.mamba_track_seqlens.cpu().numpy()[rows]
        slots = batch.mamba_track_indices.cpu().numpy()[rows]
        self.written[slots] = prefix + (track - prefix) // chunk * chunk
        mixed = batch.forward_mode == self.target.S.ForwardMode.MIXED
        self.counts["mamba_track_writes_mixed" if mixed else "mamba_track_writes"] += int(rows.size)

    def _wrap_donations(self) -> None:
        """The tracked-state check: a state the tree keeps (``prepare_for_caching_req``'s ``mamba_value`` at
        ``cache_len`` tokens, inserted when ``cleanup_after_caching_req`` sees no ``mamba_exist``) must hold
        the state of those ``cache_len`` tokens; else a ``stale-kv`` finding (check ``mamba-track-state``)."""
        comp, counts, pending = self.component, self.counts, {}
        prepare, cleanup = comp.prepare_for_caching_req, comp.cleanup_after_caching_req

        def prepare_noting(req, insert_params, token_ids_len, is_finished):
            cache_len = prepare(req, insert_params, token_ids_len, is_finished)
            if cache_len and insert_params.mamba_value is not None:
                pending[id(insert_params)] = (int(insert_params.mamba_value.reshape(-1)[0]), int(cache_len), req.rid)
            return cache_len

        def cleanup_checking(req, is_finished, insert_result=None, insert_params=None):
            noted = pending.pop(id(insert_params), None)
            if noted is not None and insert_result is not None and not insert_result.mamba_exist:
                counts["mamba_track_donations"] += 1
                self._check_donated(*noted, is_finished)
            return cleanup(req, is_finished, insert_result=insert_result, insert_params=insert_params)

        comp.prepare_for_caching_req = prepare_noting
        comp.cleanup_after_caching_req = cleanup_checking

    def _check_donated(self, slot: int, depth: int, rid: str, is_finished: bool) -> None:
        held = int(self.written[slot])
        if held != depth:
            state = "was never written" if held < 0 else f"holds the state after {held} tokens"
            self.stale.append(TargetFinding(
                "stale-kv", "mamba_pool", np.array([slot], np.int64),
                f"req:{rid}'s {'final insert' if is_finished else 'checkpoint'} gives the tree mamba slot {slot} "
                f"as the state after {depth} tokens, but the slot {state}", check="mamba-track-state"))

    # -- the planted fault ---------------------------------------------------------------------
    def _plant_leak_on_release(self) -> None:
        """``mamba-leak-on-release``: the first ``free_mamba_cache(req)`` (``cleanup_after_caching_req`` under
        ``release_kv_cache``) forgets the request's slot without giving it back to the allocator."""
        rows, faults = self.rows, self.target._faults
        free_mamba_cache = rows.free_mamba_cache

        def dropping_once(req, *a, **k):
            if "mamba-leak-on-release" in faults and req.kv.holds_mamba:
                faults.discard("mamba-leak-on-release")
                req.kv.mamba_pool_idx = None
                return None
            return free_mamba_cache(req, *a, **k)

        rows.free_mamba_cache = dropping_once

    def _plant_free_donated(self) -> None:
        """``mamba-free-donated``: after the first ``cleanup_after_caching_req`` of a finished request whose
        state the insert kept (``mamba_exist`` false), the donated slot goes to the allocator as well."""
        comp, slots, faults = self.component, self.slots, self.target._faults
        cleanup = comp.cleanup_after_caching_req

        def cleanup_freeing_donated(req, is_finished, insert_result=None, insert_params=None):
            out = cleanup(req, is_finished, insert_result=insert_result, insert_params=insert_params)
            if ("mamba-free-donated" in faults and is_finished and insert_result is not None
                    and not insert_result.mamba_exist and insert_params is not None
                    and insert_params.mamba_value is not None):
                faults.discard("mamba-free-donated")
                slots.free(insert_params.mamba_value.reshape(-1))
            return out

        comp.cleanup_after_caching_req = cleanup_freeing_donated

    # -- observer: hooks -----------------------------------------------------------------------
    def framework_files(self, files: list[str]) -> list[str]:
        """Also the mamba slot allocator's internals."""
        import sglang.srt.mem_cache.allocator.mamba as alloc_mamba
        return files + [alloc_mamba.__file__]

    def install_pool(self, spec, auditor, wrap) -> bool:
        """The slot allocator, as a row pool of slots: ``_do_alloc`` (a group's pre-allocation included) and
        ``free``, ``clear()`` as a free of everything."""
        if spec.kind != "mamba":
            return False
        auditor.wrap_clear(spec)
        auditor.wrap_rows(spec, alloc="_do_alloc", free="free")
        return True

    # -- observer: roots and counters ----------------------------------------------------------
    def _holders(self) -> list:
        """Every request the server holds that owns a mamba slot: one with its KV record, or an unfinished
        one without (a match's copy-on-write slot). A released request may keep ``mamba_pool_idx`` pointing
        at the state it donated to the tree (``cleanup_after_caching_req`` frees only what was not
        inserted): the tree owns that slot, not the request (under overlap it sits in the last batch)."""
        return [r for r in self.target._active() if r.kv.holds_mamba and (r.kv.holds_kv or not r.finished())]

    def _session_slots(self) -> list:
        """``(session id, slot)`` of the session records that hold a mamba slot."""
        return [(sid, s) for sid, s in self.target._slots() if s.kv.holds_mamba]

    def roots(self, out: list, aborting: bool) -> list:
        """Each holder's slot (private), each session record's, and the tree's states."""
        held = set()
        for sid, s in self._session_slots():
            out.append(Root("mamba_pool", f"session:{sid}", _slot(s.kv), role="session", where="session"))
            held.add(id(s.kv))
        places = self.target._places()
        for req in self._holders():
            if id(req.kv) not in held and (aborting or req.to_finish is None):
                out.append(Root("mamba_pool", f"req:{req.rid}", _slot(req.kv), where=places.get(id(req), "")))
        tree = self.target.tree_cache.all_mamba_values_flatten()
        if tree.numel():
            out.append(Root("mamba_pool", "tree", tree.to(torch.int64).cpu().numpy(), role="tree"))
        return out

    def accounting(self, out: dict) -> dict:
        """``_get_mamba_token_info``'s counters: available, the tree's evictable and protected states,
        ``session_held_mamba_slots`` (``kv_mamba_slots`` of each record: its state slot and, under the extra
        buffer, its ping-pong entries not empty)."""
        cache = self.target.tree_cache
        held = sum(len(_slot(s.kv)) for _, s in self._session_slots())
        return {**out, "mamba_pool": Accounting(self.slots.available_size(), cache.mamba_evictable_size(),
                                                cache.mamba_protected_size(), held, self.slots.size)}

    def free_lists(self, out: dict) -> dict:
        return {**out, "mamba_pool": self.slots.free_slots.cpu().numpy()}

    def engine_check(self, lines: list[str]) -> list[str]:
        """``SchedulerInvariantChecker._check_mamba_pool`` (idle only: its busy check has no mamba term):
        ``available + evictable + protected + session_held == size`` once no request holds a slot."""
        if self._holders():
            return lines
        a = self.accounting({})["mamba_pool"]
        lhs = a.available + a.evictable + a.protected + a.session_held
        if lhs != a.total:
            return lines + [f"[mamba_pool] available={a.available} + evictable={a.evictable} + protected={a.protected}"
                            f" + session_held={a.session_held} = {lhs} != total={a.total}"]
        return lines

    def invariant_findings(self, out: list) -> list:
        """The slot balance: every slot is free, held by exactly one request (or session record), or by
        one tree node; a slot free and held at once is a use-after-free, one held twice aliasing (a slot
        in none of them is the ledger's leak, through :meth:`roots`)."""
        if self.stale:
            out, self.stale = out + self.stale[:1], []
            return out
        n = self.slots.size + 1
        free = np.bincount(self.slots.free_slots.cpu().numpy(), minlength=n)
        records = [r.kv for r in self._holders()] + [s.kv for _, s in self._session_slots()]
        holders = [_slot(kv) for kv in {id(kv): kv for kv in records}.values()]  # (a record once)
        held = np.bincount(np.concatenate(holders + [np.empty(0, np.int64)]), minlength=n)
        held += np.bincount(self.target.tree_cache.all_mamba_values_flatten().to(torch.int64).cpu().numpy(),
                            minlength=n)
        both = np.flatnonzero((free > 0) & (held > 0))
        if both.size:
            return out + [TargetFinding("use-after-free", "mamba_pool", both,
                                        f"mamba slot(s) {both.tolist()} are on the allocator's free list while a "
                                        "request or tree node holds them", check="mamba-balance")]
        twice = np.flatnonzero((held > 1) | (free > 1))
        if twice.size:
            return out + [TargetFinding("aliasing", "mamba_pool", twice,
                                        f"mamba slot(s) {twice.tolist()} are held (or listed free) twice",
                                        check="mamba-balance")]
        return out

    def describe_busy(self, out: str) -> str:
        cache = self.target.tree_cache
        return (out + f" mamba_available={self.slots.available_size()} mamba_evictable={cache.mamba_evictable_size()}"
                f" mamba_protected={cache.mamba_protected_size()}")


def _slot(kv) -> np.ndarray:
    """A record's mamba slots as ``[n] int64``: its state slot, then the ping-pong track slots it holds under
    the extra buffer (entries not -1, the empty marker of both releases)."""
    own = kv.mamba_pool_idx.reshape(-1).to(torch.int64).cpu().numpy()
    buf = getattr(kv, "mamba_ping_pong_track_buffer", None)
    if buf is None:
        return own
    track = buf.reshape(-1).to(torch.int64).cpu().numpy()
    return np.concatenate([own, track[track != -1]])


def _callers(depth: int) -> tuple[set[str], object]:
    """The function names of up to ``depth`` frames above the caller's caller, and the nearest ``req``
    local among them (None if none)."""
    f, names, req = sys._getframe(2), set(), None
    while f is not None and depth:
        names.add(f.f_code.co_name)
        if req is None:
            req = f.f_locals.get("req")
        f, depth = f.f_back, depth - 1
    return names, req
