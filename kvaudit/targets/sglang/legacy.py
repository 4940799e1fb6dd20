"""The legacy era: SGLang's ``cache_finished_req`` releases (0.5.10.post1 and 0.5.11,
:mod:`~kvaudit.targets.sglang.compat`), core pools, the radix cache and sessions only, on the
0.5.23 driver's intake with that era's API where it differs: bootstrap, batches, submit, abort,
flush and the observer's reads (the KV fields sit on ``Req`` and ``SessionSlot``).

Design notes: docs/internals/sglang.md ("The legacy era")."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import torch

from kvaudit.program import Submit
from kvaudit.program.schema import pick
from kvaudit.targets.base import Accounting, PoolSpec, Root, records_roots
from kvaudit.targets.sglang import compat
from kvaudit.targets.sglang.boot import STUBS, SglangUnavailable, imported, prepare_import, probe_version, \
    quiet_loggers
from kvaudit.targets.sglang.driver import SglangDriver
from kvaudit.targets.sglang.hooks import SglangHooks, install_free_set
from kvaudit.targets.sglang.observer import SglangReads
from kvaudit.targets.sglang.standins import EOS, MAX_PREFILL_TOKENS, NoSampling, StepClock

LEGACY_STUBS = {**STUBS, "sgl_kernel": "0.0.0"}


_LOADED: SimpleNamespace | None = None


def load_legacy(version: str) -> SimpleNamespace:
    """Import the era's memory manager, once per process. Raises :class:`SglangUnavailable` when it does
    not import or its API is not the era's."""
    global _LOADED
    if _LOADED is None:
        _LOADED = _import_legacy(version)
    return _LOADED


def _import_legacy(version: str) -> SimpleNamespace:
    STUBS.update(LEGACY_STUBS)  # install_stubs reads the module's table
    stubbed = prepare_import()
    S = imported(lambda: _legacy_symbols(version), lambda exc: (
        f"SGLang {version} is installed but its memory manager does not import: {exc} (install it with: "
        f"python -c \"from kvaudit.history import releases; releases.ensure('sglang', '{version}', print)\")"))
    rel = inspect.signature(S.common.release_kv_cache).parameters
    if "is_insert" not in rel or not hasattr(S.SessionAwareCache, "release_session"):
        raise SglangUnavailable(f"SGLang {version}'s memory-manager API differs from the cache_finished_req era "
                                "(release_kv_cache(req, cache, is_insert), SessionAwareCache.release_session)")
    S.stubbed, S.SessionController = stubbed, S.session_module.SessionController
    quiet_loggers()
    _shim_tp_rank()
    return S


def _legacy_symbols(version: str) -> dict:
    """The symbols of the era's memory manager the target uses, by name (``version`` too)."""
    from sglang.srt.managers.io_struct import CloseSessionReqInput, OpenSessionReqInput, SessionParams
    from sglang.srt.managers.schedule_batch import FINISH_ABORT, Req, ScheduleBatch
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
    from sglang.srt.managers.utils import validate_input_length
    from sglang.srt.mem_cache import common
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.sampling.sampling_params import SamplingParams
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    if compat.has("session-package", version):
        import sglang.srt.session.session_controller as session_module
        from sglang.srt.session.streaming_session import StreamingSession as SessionAwareCache
    else:
        import sglang.srt.managers.session_controller as session_module
        from sglang.srt.mem_cache.session_aware_cache import SessionAwareCache
    return locals()


def _shim_tp_rank() -> str:
    """CPU shim: ``schedule_batch.get_tensor_model_parallel_rank`` -> 0 (``Req.set_finish_with_abort``
    asks it, and it asserts a tensor-parallel group a whole ``ModelRunner`` builds)."""
    import sglang.srt.managers.schedule_batch as schedule_batch

    def rank_zero() -> int:
        return 0

    schedule_batch.get_tensor_model_parallel_rank = rank_zero
    return "L1 schedule_batch.get_tensor_model_parallel_rank -> 0"


class _GenerateInput(SimpleNamespace):
    """The ``TokenizedGenerateReqInput`` ``Session.create_req`` reads: None for the fields kvaudit does not set."""

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return None


class SglangLegacyTarget(SglangDriver, SglangReads):
    """Drives one set of the era's pools and one ``RadixCache`` (wrapped by ``SessionAwareCache`` with
    streaming sessions)."""

    name = "sglang"
    release_entries = ("release_kv_cache@common.py", "cache_finished_req")  # (the cache_finished_req era's release)

    def __init__(self, config):
        """Both families of the era: the family's objects (:meth:`_build`), then the scheduler state both
        drive. ``config`` is one the era drives: the kind's ``_make`` refused any other (``era_refusal``)."""
        self.S = load_legacy(probe_version())
        self.config = config
        self.clock = StepClock()
        self._build(config)
        self.model_config = SimpleNamespace(vocab_size=config.vocab_size, is_encoder_decoder=False,
                                            hf_eos_token_id=None, is_matryoshka=False, hidden_size=8,
                                            num_hidden_layers=1)
        self._init_state(config)
        self.grammar_manager = None  # (no grammars in this era: flush, idle and _active read it)
        # the row pool's ledger units: row + 1 before 0.5.11 (every row usable), the row itself from it
        self._row_base = 0 if compat.has("row-zero-padding", self.S.version) else 1

    def _build(self, config) -> None:
        """``Scheduler.__init__``'s pools, tree and sessions: one set of core pools, a ``RadixCache``."""
        S, size = self.S, config.total_tokens
        # Scheduler.__init__'s ServerArgs: page 1; torch_native picks the CPU index writer in this era
        self.server_args = S.ServerArgs(model_path="dummy", page_size=1, attention_backend="torch_native",
                                        max_running_requests=config.max_running_requests)
        S.set_global_server_args_for_scheduler(self.server_args)
        dev = config.device
        kv = S.MHATokenToKVPool(size, 1, torch.bfloat16, head_num=1, head_dim=8, layer_num=1, device=dev,
                                enable_memory_saver=False)
        self.allocator = S.TokenToKVPoolAllocator(size, torch.bfloat16, dev, kv, config.need_sort)
        self.req_to_token_pool = S.ReqToTokenPool(size=config.max_req_rows, max_context_len=config.context_len + 8,
                                                  device=dev, enable_memory_saver=False)
        inner = S.RadixCache(S.CacheInitParams(disable=False, req_to_token_pool=self.req_to_token_pool,
                                               token_to_kv_pool_allocator=self.allocator, page_size=1))
        self.tree_cache = S.SessionAwareCache(inner) if config.enable_streaming_session else inner
        self.session_controller = S.SessionController(self.tree_cache) if config.enable_streaming_session else None
        if self.session_controller is not None:
            self.clock.install(S.session_module)  # Session.is_timed_out: one second a step
        # the row pool first: of two findings of one kind the row's is reported first (a row released under a
        # running turn is the root cause; its KV goes with it)
        self._pools = [PoolSpec("req_to_token_pool", self.req_to_token_pool, "rows", 1, config.max_req_rows),
                       PoolSpec("token_to_kv_pool", self.allocator, "kv", 1, size)]

    # -- intake: SglangIntake.apply, less what the era does not drive ------------------------------
    def _pause_generation(self, mode: str) -> None:
        pass

    def _request_flush(self, timeout: float) -> None:
        """A flush runs only when idle (no deferral in this era)."""
        self._flush_cache()

    def _memory_pressure(self) -> None:
        """Evict what the tree can give (no forced retraction in this era)."""
        self.tree_cache.evict(self.S.EvictParams(num_tokens=self.tree_cache.evictable_size()))

    def _submit(self, prompt, max_new: int, stop_at, sid, rid_prefix: str = "r", op: Submit | None = None) -> None:
        """``handle_generate_request`` of the era: a gone (or, from 0.5.11, closing) session makes an aborted
        plain request; ``validate_input_length`` aborts a turn whose history no longer fits."""
        S, cfg = self.S, self.config
        op = op or Submit()
        rid = f"{rid_prefix}{self._n}"
        self._n += 1
        sp = S.SamplingParams(max_new_tokens=max_new, temperature=0.0, ignore_eos=bool(op.ignore_eos))
        sp.normalize(None)
        ids = list(prompt)
        sc = self.session_controller
        closing = sid is not None and sid in sc and compat.has("session-close-deferral", S.version) \
            and sc.get(sid).close_on_finish
        self.submitted.append(rid)
        if sid is not None and (sid not in sc or closing):
            req = S.Req(rid, "", ids, sp, vocab_size=cfg.vocab_size, eos_token_ids={EOS})
            req.set_finish_with_abort(f"Invalid request: session id {sid} does not exist")
            return self._queue(req, stop_at)
        if sid is not None:
            turns = self.session_turns.setdefault(sid, [])
            params = S.SessionParams(id=sid, rid=pick(op.parent, turns), offset=op.offset,
                                     replace=bool(op.replace), drop_previous_output=bool(op.drop_previous_output))
            turns.append(rid)
            recv = _GenerateInput(input_ids=ids, sampling_params=sp, rid=rid, session_params=params, stream=True,
                                  return_logprob=False, logprob_start_len=-1, top_logprobs_num=0,
                                  priority=op.priority)
            req = sc.get(sid).create_req(recv, None, cfg.vocab_size, eos_token_ids={EOS})
            if isinstance(req.finished_reason, S.FINISH_ABORT):
                return self._queue(req, stop_at)
        else:
            req = S.Req(rid, "", ids, sp, vocab_size=cfg.vocab_size, eos_token_ids={EOS})
        error = S.validate_input_length(req, self.max_req_input_len, False)
        if error:
            req.set_finish_with_abort(error)
        self._queue(req, stop_at)

    def _queue(self, req, stop_at) -> None:
        """``init_req_max_new_tokens``, then the waiting queue."""
        sp = req.sampling_params
        sp.max_new_tokens = max(0, min(sp.max_new_tokens, self.max_req_len - len(req.origin_input_ids) - 1))
        req.kvaudit_stop_at = stop_at
        self.waiting.append(req)

    def _abort(self, rid: str) -> None:
        """``abort_request``: a waiting request leaves the queue (it holds no row of its own); a running one
        gets ``to_finish``."""
        for i, req in enumerate(self.waiting):
            if req.rid == rid:
                del self.waiting[i]
                self.finished.add(rid)
                return
        for req in self.running:
            if req.rid == rid and not req.finished():
                req.to_finish = self.S.FINISH_ABORT()

    # -- batches (Scheduler.event_loop_normal) ---------------------------------------------------
    def step(self) -> None:
        """One iteration: ``maybe_reap`` (from 0.5.11 also deferred closes), a prefill batch if one can be
        admitted, else a decode step, then the batch's result."""
        self.steps += 1
        self.clock.now += 1.0
        if self.session_controller is not None:
            self.session_controller.maybe_reap(float(self.steps), interval=0.0)
        batch = self._prefill() or self._decode()
        if batch is not None:
            self._process(*batch)
        self._snapshot_held()

    def _allocatable(self, admitted: list) -> int:
        """``get_num_allocatable_reqs``, bounded (kvaudit's) by the free rows plus the admitted that reuse a
        borrowed row: this target's row pool is smaller than one rank's."""
        borrowed = sum(r.req_pool_idx is not None for r in admitted)
        return min(self.config.max_running_requests - len(self.running),
                   self.req_to_token_pool.available_size() + borrowed) - len(admitted)

    def _prefill(self):
        """``get_new_batch_prefill``: FCFS, ``add_one_req`` until it refuses, ``prepare_for_extend``."""
        S, cfg, cache = self.S, self.config, self.tree_cache
        if not self.waiting or self._allocatable([]) <= 0:
            return None
        running = self._running_batch(self.running)
        adder = S.PrefillAdder(1, cache, self.allocator, running, cfg.new_token_ratio, MAX_PREFILL_TOKENS, None, 0,
                               0, max_running_requests=cfg.max_running_requests)
        for req in self.waiting:
            if self._allocatable(adder.can_run_list) <= 0:
                break
            req.init_next_round_input(cache)
            if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != S.AddReqResult.CONTINUE:
                break
        admitted = list(adder.can_run_list)
        if not admitted:
            return None
        self.waiting = [r for r in self.waiting if not any(r is a for a in admitted)]
        batch = S.ScheduleBatch.init_new(admitted, self.req_to_token_pool, self.allocator, cache, self.model_config,
                                         False, S.SpeculativeAlgorithm.NONE)
        batch.sampling_info = NoSampling()
        batch.prepare_for_extend()
        return "extend", batch

    def _running_batch(self, reqs: list):
        S = self.S
        batch = S.ScheduleBatch.init_new(list(reqs), self.req_to_token_pool, self.allocator, self.tree_cache,
                                         self.model_config, False, S.SpeculativeAlgorithm.NONE)
        batch.sampling_info = NoSampling()
        batch.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        batch.seq_lens = torch.tensor([r.kv_committed_len for r in reqs], dtype=torch.int64)
        batch.seq_lens_cpu = batch.seq_lens.clone()
        batch.orig_seq_lens = batch.seq_lens.to(torch.int32)
        batch.seq_lens_sum = int(batch.seq_lens.sum())
        batch.output_ids = torch.tensor([r.output_ids[-1] if r.output_ids else 0 for r in reqs], dtype=torch.int64)
        return batch

    def _decode(self):
        """``update_running_batch``: ``retract_decode(server_args)`` when ``check_decode_mem`` fails."""
        self.running = [r for r in self.running if not r.finished()]
        if not self.running:
            return None
        batch = self._running_batch(self.running)
        if not batch.check_decode_mem():
            retracted, _, *rest = batch.retract_decode(self.server_args)
            aborted = rest[0] if rest else []
            self.retractions += len(retracted) + len(aborted)
            self.last_retraction = f"step {self.steps}: retracted {len(retracted)}, {len(batch.reqs)} kept"
            for req in retracted:
                self.waiting.append(req)
            for req in aborted:
                self.finished.add(req.rid)
            self.running = list(batch.reqs)
            if not batch.reqs:
                return None
        batch.prepare_for_decode()
        return "decode", batch

    def _process(self, kind: str, batch) -> None:
        """``process_batch_result_prefill`` / ``_decode``. Only the decode result runs inside a free group in
        this era: a prefill's ``cache_unfinished_req`` frees a view of the row it overwrites next, so a
        deferred free there would free the tree's slots instead."""
        group = kind == "decode"
        if group:
            self.allocator.free_group_begin()
        for req in batch.reqs:
            if kind == "extend" and (req.finished() or req.is_retracted):
                continue
            req.output_ids.append(self._sample(req))
            req.check_finished()
            if req.finished():
                self.finished.add(req.rid)
                self.S.common.release_kv_cache(req, self.tree_cache)
            elif kind == "extend":
                self.tree_cache.cache_unfinished_req(req)
                self.running.append(req)
        if group:
            self.allocator.free_group_end()
        self.running = [r for r in self.running if not r.finished()]

    # -- observer ---------------------------------------------------------------------------------
    def engine_files(self) -> list[str]:
        return [__file__]

    def framework_files(self) -> list[str]:
        import sglang.srt.mem_cache.allocator as allocator
        import sglang.srt.mem_cache.memory_pool as memory_pool
        return [allocator.__file__, memory_pool.__file__]

    def install_pool(self, spec: PoolSpec, auditor, wrap) -> None:
        """The KV pool as on 0.5.23; the row pool by its free list (``alloc(reqs)``, ``free(req)`` and
        ``SessionAwareCache.release_session``). Rows are units ``row + 1`` before 0.5.11
        (``row-zero-padding``), the row from it."""
        obj, base = spec.obj, self._row_base
        auditor.wrap_clear(spec)
        if spec.kind != "rows":  # the era's free group: is_not_in_free_group (free_group stays a list)
            return SglangHooks.install_kv(spec, auditor, wrap, False, lambda: not obj.is_not_in_free_group)

        def taken(before, after):
            return [r + base for r in sorted(set(before) - set(after))]

        def given(before, after):  # in the order the free list got them
            rows = after[len(before):] if after[: len(before)] == before else sorted(set(after) - set(before))
            return [r + base for r in rows]

        def rows():
            return list(obj.free_slots)

        install_free_set(auditor, wrap, spec.name, obj, "alloc", True, rows, taken)
        install_free_set(auditor, wrap, spec.name, obj, "free", False, rows, given)
        if self.session_controller is not None:
            install_free_set(auditor, wrap, spec.name, self.tree_cache, "release_session", False, rows, given)

    @staticmethod
    def _kv(holder):
        """The KV record's fields sit on ``Req`` and ``SessionSlot`` in this era."""
        return holder

    def _slots(self):
        return list(self.tree_cache.slots.items()) if self.session_controller is not None else []

    def _live(self) -> list:
        """Requests holding a row: the running batch, and waiting turns whose slot was restored."""
        return [r for r in self.running + self.waiting if r.req_pool_idx is not None]

    def _borrowed(self) -> set[int]:
        return {r.req_pool_idx for r in self._live()}

    def _session_held_tokens(self) -> int:
        """kvaudit's count: the KV of slots no live request borrowed."""
        borrowed = self._borrowed()
        return sum(s.kv_allocated_len - s.cache_protected_len for _, s in self._slots()
                   if s.req_pool_idx is not None and s.req_pool_idx not in borrowed)

    def _engine_session_held(self) -> int:
        """SGLang's own ``session_held_tokens`` as the scheduler calls it (``session-held-active``)."""
        if self.session_controller is None:
            return 0
        if compat.has("session-held-active", self.S.version):
            return self.tree_cache.session_held_tokens({r.req_pool_idx for r in self.running
                                                        if r.req_pool_idx is not None})
        return self.tree_cache.session_held_tokens()

    def accounting(self) -> dict[str, Accounting]:
        a, cache, rp = self.allocator, self.tree_cache, self.req_to_token_pool
        borrowed = self._borrowed()
        rows = sum(1 for _, s in self._slots() if s.req_pool_idx is not None and s.req_pool_idx not in borrowed)
        return {"token_to_kv_pool": Accounting(a.available_size(), cache.evictable_size(), cache.protected_size(),
                                               self._session_held_tokens(), a.size),
                "req_to_token_pool": Accounting(rp.available_size(), 0, 0, rows, rp.size)}

    def engine_check(self) -> list[str]:
        """SGLang's own memory checks of the era: idle always; busy (with ``uncached`` per running request)
        only with ``strict_mem_check_during_busy``."""
        busy = bool(self.running or self.waiting)
        if busy and not self.config.strict_mem_check_during_busy:
            return []
        a = self.allocator
        held = self._engine_session_held()
        uncached = sum(r.kv_allocated_len - r.cache_protected_len for r in self.running if r.req_pool_idx is not None)
        lhs = a.available_size() + self.tree_cache.evictable_size() + self.tree_cache.protected_size() + held + uncached
        if lhs != a.size:
            return [f"[token_to_kv_pool] available={a.available_size()} + evictable={self.tree_cache.evictable_size()}"
                    f" + protected={self.tree_cache.protected_size()} + session_held={held} + uncached={uncached} "
                    f"= {lhs} != total={a.size} ({'busy' if busy else 'idle'} check)"]
        return []

    def roots(self, aborting: bool = True) -> list[Root]:
        """The tree's values; each live request's row and KV; each session slot no live request
        borrowed."""
        borrowed = self._borrowed()
        records = [(s, f"session:{sid}", "session", "session") for sid, s in self._slots()
                   if s.req_pool_idx is not None and s.req_pool_idx not in borrowed]
        running = {id(r) for r in self.running}
        records += [(req, f"req:{req.rid}", "req", self._place(req, running)) for req in self._live()
                    if aborting or req.to_finish is None]
        out = records_roots(self.req_to_token_pool.req_to_token, records, 1, self._row_base)
        # (RadixCache.all_values_flatten of this era fails on an empty tree: torch.cat of no tensors)
        empty = self.tree_cache.evictable_size() + self.tree_cache.protected_size() == 0
        values = torch.empty(0, dtype=torch.int64) if empty else self.tree_cache.all_values_flatten()
        if values.numel():
            out.append(Root("token_to_kv_pool", "tree", values.to(torch.int64).cpu().numpy(), role="tree"))
        return out

    @staticmethod
    def _place(req, running: set) -> str:
        """``Root.where`` of a live request: ``running``; ``retracted`` for one back in the waiting queue after
        ``ScheduleBatch.retract_decode`` (SGLang's ``Req.is_retracted``, cleared by ``prepare_for_extend``
        when it runs again), so a leak its retry causes reads apart from one of a fresh request;
        else ``waiting``."""
        if id(req) in running:
            return "running"
        return "retracted" if getattr(req, "is_retracted", False) else "waiting"

    def metrics_check(self) -> list[str]:
        return [f"[req_to_token_pool] req:{r.rid} kv_committed_len={r.kv_committed_len} > "
                f"kv_allocated_len={r.kv_allocated_len}" for r in self._live()
                if not 0 <= r.kv_committed_len <= r.kv_allocated_len]

    def stalled(self) -> bool:
        return bool(self.waiting) and not self.running and self._session_held_tokens() > 0

    def transient(self) -> bool:
        """A turn running on its session slot's row (a borrowed record) while the engine's busy check is on
        (``strict_mem_check_during_busy``): the era's busy identity counts such a turn both in
        ``session_held`` and in ``uncached``, only while it runs (sglang#22213, a step or a few), so a
        search's sparse schedule checks after every step meanwhile, as a per-step run does."""
        if not (self.running and self.config.strict_mem_check_during_busy and self.session_controller is not None):
            return False
        rows = {s.req_pool_idx for _, s in self._slots() if s.req_pool_idx is not None}
        return any(r.req_pool_idx in rows for r in self.running)

    def reach(self) -> dict[str, int]:
        """The path counters: requests ``retract_decode`` took out (or aborted), session turns submitted."""
        return {"retractions": self.retractions, "session_turns": sum(map(len, self.session_turns.values()))}

    def stuck(self) -> str:
        """``running:decode``, ``waiting:memory-locked`` or ``waiting:memory``; ``""`` when idle."""
        if self.running:
            return "running:decode"
        if not self.waiting:
            return ""
        return "waiting:memory-locked" if self.tree_cache.protected_size() else "waiting:memory"
