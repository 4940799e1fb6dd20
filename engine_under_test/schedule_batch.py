"""The scheduler's plain data: forward modes, the batch one step runs, and a finished request's output.

SGLang 0.5.23 ``srt/managers/schedule_batch.py`` (``ScheduleBatch``), ``model_executor/forward_batch_info.py``
(``ForwardMode``) and ``srt/managers/io_struct.py`` (the outputs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from engine_under_test.req import FinishReason, Req

EXTEND, DECODE, PREBUILT = "extend", "decode", "prebuilt"
EOS_TOKEN = 1
CLIP_MAX_NEW_TOKENS = 4096  # SGLang SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: admission caps output estimates here


@dataclass
class ScheduleBatch:
    reqs: list[Req]
    forward_mode: str
    out_cache_loc: torch.Tensor | None = None  # [n] int64 slots written into the rows
    decode_ids: frozenset = frozenset()  # mixed chunk: ids of the decoding rows of an extend batch
    sampled: list[bool] = field(default_factory=list)  # per row: did the forward sample a token
    model_loc: torch.Tensor | None = None  # HiSparse: [bs] physical buffer slots the model writes
    host_loc: torch.Tensor | None = None  # HiSparse: [bs] host slots that back the new tokens up


@dataclass
class FinishedOutput:
    rid: str
    reason: FinishReason
    output_ids: list[int] = field(default_factory=list)
