"""Engine configuration.

Modelled on the server arguments of SGLang 0.5.x (``srt/server_args.py``) that shape memory:
pool size, page size, batch limits, disaggregation mode and HiSparse.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from engine_under_test.bugs import BUGS, UnknownBugError


def _json(v) -> str:
    """``v`` as the replay file's JSON spells it (``true``, ``null``), for a config error. The engine never
    imports kvaudit, so this is its own copy of ``kvaudit.config.json_value``."""
    try:
        return json.dumps(v)
    except (TypeError, ValueError):
        return repr(v)


# Inclusive bounds of the integer fields: a typo in a replay file gets a clear error instead of a
# multi-GB allocation or a division by zero deep in the engine.
_INT_RANGES = {
    "num_slots": (2, 1 << 22),
    "page_size": (1, 256),
    "max_running_requests": (1, 4096),
    "max_req_rows": (1, 4096),
    "context_len": (2, 1 << 15),
    "pd_pre_alloc_rows": (0, 4096),
    "transfer_latency_steps": (0, 1000),
    "hisparse_device_buffer_size": (1, 1 << 16),
    "hisparse_host_ratio": (1, 16),
    "vocab_size": (3, 1 << 16),
    "hicache_ratio": (1, 16),
    "host_ack_latency_steps": (0, 1000),
    "priority_scheduling_preemption_threshold": (0, 1 << 20),
    "seed": (0, (1 << 63) - 1),  # (as SGLang's and vLLM's targets take it)
}


@dataclass(frozen=True)
class EngineConfig:
    """Everything that decides how the engine allocates and releases memory.

    Sizes are in tokens unless the name says otherwise. ``num_slots`` is the device KV pool
    (``max_total_num_tokens`` in SGLang); with ``page_size > 1`` it is rounded down to whole pages.

    PD decode (``disaggregation_mode="decode"``) runs without a tree unless
    ``disaggregation_decode_enable_radix_cache`` (SGLang 0.5.23 ``arg_groups/pd_disaggregation_hook.py``
    sets ``disable_radix_cache`` from it; here both are given and must agree). HiCache on a PD decode
    server is rejected: SGLang's decode HiCache (``disaggregation/decode_hicache_mixin.py``) promises the
    prefill side host hits, restores them after the transfer and keeps pending restores across
    retraction, a state machine this engine's line budget does not hold.

    Raises ``ValueError`` from ``__post_init__`` for inconsistent values and
    :class:`UnknownBugError` for a bug name that is not in the zoo.
    """

    num_slots: int = 512
    page_size: int = 1
    max_running_requests: int = 8
    max_req_rows: int = 16
    context_len: int = 128
    chunked_prefill_size: int | None = None  # tokens computed per prefill batch; None = unlimited
    enable_mixed_chunk: bool = False  # running requests decode in the same forward as a prefill
    new_token_ratio: float = 1.0  # share of remaining decode tokens admission reserves; < 1 may retract
    disaggregation_mode: str | None = None  # None | "decode"
    disaggregation_decode_enable_radix_cache: bool = False  # PD decode keeps a tree: a prefix hit is not transferred
    pd_pre_alloc_rows: int = 4
    transfer_latency_steps: int = 1
    enable_hisparse: bool = False
    hisparse_device_buffer_size: int = 16
    hisparse_host_ratio: int = 2
    disable_radix_cache: bool = False
    enable_overlap: bool = False  # overlap scheduling: a batch's result is processed one step later
    enable_streaming_session: bool = False  # streaming sessions hold a turn's KV for the next turn
    enable_hicache: bool = False  # a host tier under the radix tree
    hicache_ratio: int = 2  # host pool size as a multiple of the device pool
    hicache_write_policy: str = "write_through"  # "write_through" | "write_back"
    host_ack_latency_steps: int = 2  # steps until a device<->host copy is acknowledged
    # SGLang's --enable-priority-scheduling and its options (server_args.py; defaults are SGLang's)
    enable_priority_scheduling: bool = False  # order waiting requests by priority; preempt lower ones
    schedule_low_priority_values_first: bool = False  # default: larger priority values run first
    priority_scheduling_preemption_threshold: int = 10  # a preemptor's priority must exceed the victim's by more
    max_queued_requests: int | None = None  # waiting-queue limit; beyond it a request is aborted
    model: str = "none"  # "tiny" | "none"
    device: str = "cpu"
    vocab_size: int = 128
    bugs: frozenset[str] = field(default_factory=frozenset)
    seed: int = 0
    preset: str = "custom"

    def __post_init__(self) -> None:
        for name, (lo, hi) in _INT_RANGES.items():
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"{name} must be an integer, got {_json(v)}")
            if not lo <= v <= hi:
                raise ValueError(f"{name} must be in [{lo}, {hi}], got {v}")
        for name in ("enable_hisparse", "disable_radix_cache", "enable_mixed_chunk", "enable_overlap",
                     "enable_streaming_session", "enable_hicache", "disaggregation_decode_enable_radix_cache",
                     "enable_priority_scheduling", "schedule_low_priority_values_first"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {_json(getattr(self, name))}")
        for name in ("model", "device", "preset", "hicache_write_policy"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"{name} must be a string, got {_json(getattr(self, name))}")
        r = self.new_token_ratio
        if not isinstance(r, (int, float)) or isinstance(r, bool) or not 0 <= r <= 1:
            raise ValueError(f"new_token_ratio must be a number in [0, 1], got {_json(r)}")
        c = self.chunked_prefill_size
        if c is not None and (not isinstance(c, int) or isinstance(c, bool) or not self.page_size <= c <= 1 << 16):
            raise ValueError(f"chunked_prefill_size must be null or an integer in [page_size, 65536], got {_json(c)}")
        q = self.max_queued_requests
        if q is not None and (not isinstance(q, int) or isinstance(q, bool) or not 1 <= q <= 4096):
            raise ValueError(f"max_queued_requests must be null or an integer in [1, 4096], got {_json(q)}")
        if (self.enable_priority_scheduling or q is not None) and (self.is_pd_decode or self.enable_hisparse):
            raise ValueError("enable_priority_scheduling and max_queued_requests are modelled for aggregated serving "
                             "without HiSparse")
        object.__setattr__(self, "bugs", frozenset(self.bugs))
        unknown = sorted(self.bugs - set(BUGS))
        if unknown:
            raise UnknownBugError(unknown[0])
        if self.num_slots < self.page_size * 2:
            raise ValueError(f"num_slots={self.num_slots} is smaller than two pages of {self.page_size}")
        if self.disaggregation_mode not in (None, "decode"):
            raise ValueError(f'disaggregation_mode must be null or "decode", got {_json(self.disaggregation_mode)}')
        if self.disaggregation_decode_enable_radix_cache and (not self.is_pd_decode or self.disable_radix_cache):
            raise ValueError("disaggregation_decode_enable_radix_cache needs disaggregation_mode='decode' and "
                             "disable_radix_cache=false")
        if self.is_pd_decode and not (self.disable_radix_cache or self.disaggregation_decode_enable_radix_cache):
            raise ValueError("PD decode with the radix cache on needs disaggregation_decode_enable_radix_cache=true")
        if self.enable_hicache and self.is_pd_decode:
            raise ValueError("enable_hicache on a PD decode server is not modelled (see EngineConfig)")
        if self.enable_hisparse and not self.disable_radix_cache:
            raise ValueError("enable_hisparse needs disable_radix_cache=true (HiSparse requests bypass the tree here)")
        if self.enable_hisparse and self.chunked_prefill_size is not None:
            raise ValueError("enable_hisparse does not support chunked_prefill_size in this version")
        if self.enable_overlap and (self.is_pd_decode or self.enable_mixed_chunk or self.enable_hisparse):
            raise ValueError("enable_overlap is modelled for aggregated serving without mixed chunk or HiSparse")
        for name in ("enable_streaming_session", "enable_hicache"):
            if getattr(self, name) and (self.is_pd_decode or self.disable_radix_cache):
                raise ValueError(f"{name} needs aggregated serving with the radix cache on")
        if self.hicache_write_policy not in ("write_through", "write_back"):
            raise ValueError(f"hicache_write_policy must be write_through or write_back, got {_json(self.hicache_write_policy)}")
        if self.model not in ("tiny", "none"):
            raise ValueError(f'model must be "tiny" or "none", got {_json(self.model)}')
        if self.device.split(":")[0] not in ("cpu", "cuda"):
            raise ValueError(f"device must be cpu or cuda, got {_json(self.device)}")
        if self.max_running_requests < 1 or self.max_req_rows < 1:
            raise ValueError("max_running_requests and max_req_rows must be >= 1")
        if self.enable_hisparse and self.hisparse_device_buffer_size % self.page_size:
            raise ValueError("hisparse_device_buffer_size must be a multiple of page_size")
        if self.context_len < 2:
            raise ValueError("context_len must be >= 2")

    @property
    def is_pd_decode(self) -> bool:
        return self.disaggregation_mode == "decode"

    @property
    def num_pages(self) -> int:
        """Device KV pages, excluding the reserved page 0."""
        return self.num_slots // self.page_size

    @property
    def total_tokens(self) -> int:
        """Usable device KV slots (``max_total_num_tokens``), whole pages only."""
        return self.num_pages * self.page_size
