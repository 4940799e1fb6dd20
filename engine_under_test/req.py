"""Requests and their KV record.

Modelled on SGLang 0.5.x ``srt/managers/schedule_batch.py`` (``Req``, ``ReqKvInfo``).

Position ranges of one request's row (all in tokens)::

    [0, cache_protected_len)                 owned by the radix tree (matched or inserted prefix)
    [cache_protected_len, kv_allocated_len)  owned privately by the request (whole pages)
    [0, kv_committed_len)                    positions whose KV is written; committed <= allocated
    [prefix_len, extend_end)                 what the current prefill round computes
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"


class FinishReason(str, Enum):
    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"


@dataclass
class ReqKvInfo:
    """The request's KV record: its row and the lengths over it (see the module table)."""

    req_pool_idx: int | None = None
    kv_committed_len: int = 0
    kv_allocated_len: int = 0
    cache_protected_len: int = 0

    @property
    def holds_kv(self) -> bool:
        return self.req_pool_idx is not None

    def mark_kv_released(self) -> None:
        self.req_pool_idx = None
        self.kv_allocated_len = 0


@dataclass(eq=False)
class Req:
    """One generation request. ``origin_input_ids`` and ``output_ids`` are token ids."""

    rid: str
    origin_input_ids: list[int]
    max_new_tokens: int
    stop_at: int | None = None  # output position that samples EOS (models a stop token)
    ignore_eos: bool = False  # sampling_params.ignore_eos: the EOS at stop_at does not finish the request
    priority: int | None = None  # scheduling priority (only with enable_priority_scheduling)
    wait_queue_entry: int = 0  # serial of its latest entry into the waiting queue (wait_queue_entry_time)
    output_ids: list[int] = field(default_factory=list)
    kv: ReqKvInfo = field(default_factory=ReqKvInfo)
    prefix_indices: object = None  # [prefix_len] int64 slots matched in the tree at admission
    prefix_len: int = 0
    extend_end: int = 0
    last_node: object = None
    lock: object = None  # the tree node this request holds a lock on, or None
    finished_reason: FinishReason | None = None
    to_finish: FinishReason | None = None
    transfer_ready_step: int = -1  # PD decode: poll step at which the KV transfer completes
    hisparse_admitted: bool = False
    hisparse_staging: bool = False  # HiSparse: prefill done, host backup in flight (staging queue)
    inflight_middle_chunks: int = 0  # scheduled prefill chunks that sample no token
    future_ids: list[int] = field(default_factory=list)  # overlap: sampled, result not yet processed
    finished_len: int | None = None  # output tokens kept once finished (a stop token is not kept)
    session: object = None  # streaming session this turn belongs to
    borrowed_slot: object = None  # the session slot whose KV record this turn borrows (req.kv is slot.kv)
    retracted_in_session: bool = False  # retracted after writing into its session's record
    intake_aborted: bool = False  # set_finish_with_abort at intake: runs one 1-token prefill, then ends
    load_back: object = None  # HiCache: the load-back this waiting request waits for
    pd_rebootstrap_in_progress: bool = False  # PD decode: retracted by a pause, its KV is transferred again
    pd_rebootstrap_forced_output_id: int | None = None  # ... and this emitted token is its hand-off token

    @property
    def is_health_check(self) -> bool:
        return self.rid.startswith(HEALTH_CHECK_RID_PREFIX)

    @property
    def fill_ids(self) -> list[int]:
        return self.origin_input_ids + self.output_ids

    @property
    def seqlen(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    def finished(self) -> bool:
        return self.finished_reason is not None

    def owned_kv_len(self) -> int:
        """KV positions the request owns: ``kv_committed_len``, capped once finished at the prompt
        plus ``finished_len`` (SGLang ``Req.owned_kv_len``); the rest of the row is over-allocation."""
        if self.finished_len is None:
            return self.kv.kv_committed_len
        return min(self.kv.kv_committed_len, len(self.origin_input_ids) + self.finished_len)

    def detach_kv(self) -> ReqKvInfo:
        """Hand the KV record to another holder; the request gets a fresh, empty one."""
        kv, self.kv = self.kv, ReqKvInfo()
        self.borrowed_slot = None
        return kv

    def update_finish_state(self, eos_sampled: bool) -> None:
        """Set ``finished_reason`` (``to_finish`` wins, then EOS, then length), as SGLang does; with
        ``ignore_eos`` an EOS finishes nothing (SGLang ``Req._check_token_based_finish``)."""
        if self.finished():
            return
        if self.to_finish is not None:
            self.finished_reason = self.to_finish
        elif eos_sampled and not self.ignore_eos:
            self.finished_reason = FinishReason.STOP
            self.finished_len = len(self.output_ids) - 1  # the stop token itself is not kept
        elif len(self.output_ids) >= self.max_new_tokens:
            self.finished_reason = FinishReason.LENGTH
        if self.finished_len is None and self.finished():
            self.finished_len = len(self.output_ids)
