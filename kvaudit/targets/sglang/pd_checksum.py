"""The PD decode server's KV checksum, watched (:class:`ChecksumWatch`): the oracle for a request that SGLang's
own integrity check aborts while the KV kvaudit wrote for it is intact (``spurious-abort``).

It watches SGLang's ``_verify_kv_checksums`` and ``_handle_kv_checksum_mismatch`` (``disaggregation/decode.py``)
over the tags kvaudit writes per token (:func:`~kvaudit.targets.sglang.pd_transfer.write_kv`); when a mismatch
is blamed on the check: docs/internals/sglang.md ("PD decode: the checksum re-verified after a retraction")."""

from __future__ import annotations

import numpy as np
import torch

from kvaudit.targets.base import TargetFinding
from kvaudit.targets.sglang.pd_transfer import kv_tags, read_kv


class ChecksumWatch:
    """Wraps the decode scheduler's ``_verify_kv_checksums(batch)`` and ``_handle_kv_checksum_mismatch(req,
    msg)`` (``disaggregation/decode.py``, ``SchedulerDisaggregationDecodeMixin``) on ``sched``, observing
    only. ``network`` is the transfer stand-in (its ``sent``: room -> (transfers, last digest)),
    ``rows`` the ``req_to_token`` table ``[rows, context]`` int32, ``page_size`` in tokens."""

    def __init__(self, sched, network, rows: torch.Tensor, page_size: int):
        self.network, self.rows, self.page_size = network, rows, page_size
        self.verified: set[tuple[str, int]] = set()  # (rid, transfer number) verified clean once
        self.again: dict[int, int] = {}  # id(req) -> expected digest, for this batch's re-verifications
        self.verifications = self.reverified = 0
        self.findings: list[TargetFinding] = []
        verify, handle = sched._verify_kv_checksums, sched._handle_kv_checksum_mismatch

        def verifying(batch):
            before = [(r, self._key(r), r.expected_kv_checksum) for r in batch.reqs if r.expected_kv_checksum]
            self.again = {id(r): exp for r, key, exp in before if key in self.verified}
            self.verifications += len(before)
            self.reverified += len(self.again)
            verify(batch)
            self.verified.update(key for r, key, _ in before if not r.finished())

        def mismatched(req, msg):
            if id(req) in self.again:
                self._judge(req, self.again[id(req)], msg)
            return handle(req, msg)

        sched._verify_kv_checksums, sched._handle_kv_checksum_mismatch = verifying, mismatched

    def _key(self, req) -> tuple[str, int]:
        return req.rid, self.network.sent.get(req.bootstrap_room, (0, 0))[0]

    def _judge(self, req, expected: int, msg: str) -> None:
        """Before SGLang releases ``req``: its prompt slots against the tags prefill sent."""
        n, room = len(req.origin_input_ids), req.bootstrap_room
        slots = self.rows[req.kv.req_pool_idx, :n].to(torch.int64)
        kv = self.network.checksums.kv
        intact = bool(torch.equal(read_kv(kv, slots), kv_tags(room, torch.arange(n))))
        sent = self.network.sent.get(room, (0, 0))[1]
        if not intact or expected != sent:
            return  # a real corruption, or a digest kvaudit itself altered (TransferFail): SGLang is right
        pages = np.unique(slots.numpy() // self.page_size)
        self.findings.append(TargetFinding(
            "accounting-drift", "token_to_kv_pool", pages,
            f"request {req.rid} was aborted by the decode server's KV checksum ({msg.split(' req=')[0]}) when its "
            f"transfer's digest, verified clean at its first join, was checked again: its {n} prompt tokens' KV "
            f"is intact (every slot holds what prefill sent; pages {pages.tolist()}), the digest expected is the "
            f"one prefill sent; the pages digested now also hold what decode wrote since (its own tokens past "
            f"the prompt in the last prompt page, or a restored row's new pages)",
            check="spurious-abort"))

    def reach(self, out: dict[str, int]) -> dict[str, int]:
        """``kv_checksums_verified``: digests the check compared; ``kv_checksums_reverified``: of those, a
        transfer's digest compared again after it had passed (0 on 0.5.23, which verifies once)."""
        out["kv_checksums_verified"] = self.verifications
        out["kv_checksums_reverified"] = self.reverified
        return out
