"""The PD decode server's KV checksum after a retraction (kvaudit/targets/sglang/pd_checksum.py): SGLang 0.5.23
verifies a transfer's digest once; 0.5.22 verified it again at every join, and a request retracted and
restored (its last prompt page now holding decode's own tokens) was aborted while its KV was intact
(history row ``sglang-39500``; 0.5.22 itself runs in tests/test_sglang_releases.py).

Here, on the installed SGLang: the retracted request is verified once and finishes; with 0.5.22's
re-verification put back into the installed ``_verify_kv_checksums`` (the request keeps its expected digest),
the abort is the ``spurious-abort`` finding; a re-verification that fails over KV that really changed is not.
"""

import pytest
import torch

from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Idle, MemoryPressure, Step, Submit
from kvaudit.targets.sglang.config import SGLANG_PRESETS
from kvaudit.targets.sglang.pd_transfer import kv_tags, write_kv

pytestmark = pytest.mark.sglang

# prompts of 30 and 21 tokens (pages of 4: neither ends on a page), r0 retracted at the 4th step
RETRACT = [Submit(0, 30, 12), Submit(1, 21, 12), Step(3), MemoryPressure(), Step(1)]


def run_retraction(ops=RETRACT):
    run = AuditedRun(SGLANG_PRESETS["sglang-pd-decode"].config())
    found = [f for op in ops for f in run.apply(op)]
    return run, found


@pytest.fixture
def reverify(monkeypatch):
    """0.5.22's behaviour in the installed release: a request keeps its expected digest after a clean
    verification, so every later join checks it again."""
    from kvaudit.targets.sglang.pd import load_pd

    mixin = load_pd().decode.SchedulerDisaggregationDecodeMixin
    real = mixin._verify_kv_checksums

    def every_join(self, batch):
        kept = {id(r): r.expected_kv_checksum for r in batch.reqs}
        real(self, batch)
        for r in batch.reqs:
            if not r.finished():
                r.expected_kv_checksum = kept[id(r)]

    monkeypatch.setattr(mixin, "_verify_kv_checksums", every_join)


def test_a_retracted_request_is_verified_once_and_finishes():
    run, found = run_retraction()
    t = run.target
    assert t.retractions == 1 and found == []
    found += run.apply(Idle())
    reach = t.feature("pd-decode").reach({})
    assert found == [] and reach["kv_checksums_verified"] == 2 and reach["kv_checksums_reverified"] == 0
    run.close()


def test_a_digest_verified_again_after_the_retraction_aborts_an_intact_request(reverify):
    run, found = run_retraction()
    found += run.apply(Idle())
    t = run.target
    assert t.feature("pd-decode").reach({})["kv_checksums_reverified"] == 1
    spurious = [f for f in found if f.check == "spurious-abort"]
    assert len(spurious) == 1, [f.signature for f in found]
    f = spurious[0]
    assert f.signature == "accounting-drift/token_to_kv_pool/spurious-abort" and "request r0 " in f.message
    run.close()


def test_a_reverification_over_kv_that_really_changed_is_not_blamed_on_the_check(reverify):
    """The same program, but r0's first prompt token's KV is overwritten while it runs (before its backup):
    the restored row differs from what prefill sent, so the abort at the re-verification is right."""
    run, found = run_retraction(RETRACT[:3])
    t = run.target
    r0 = next(r for r in t.feature("pd-decode").sched.running_batch.reqs if r.rid.startswith("r0"))
    slot = t.req_to_token_pool.req_to_token[r0.kv.req_pool_idx, :1].to(torch.int64)
    write_kv(t.allocator.get_kvcache(), slot, kv_tags(r0.bootstrap_room, [7]))  # position 0 now holds position 7's KV
    for op in RETRACT[3:] + [Idle()]:
        found += run.apply(op)
    assert t.feature("pd-decode").reach({})["kv_checksums_reverified"] == 1
    assert type(r0.finished_reason).__name__ == "FINISH_ABORT" and r0.finished_reason.message == "KV checksum mismatch"
    assert [f for f in found if f.check == "spurious-abort"] == []
    run.close()
