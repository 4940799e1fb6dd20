"""The real-SGLang target runs SGLang's own result processing (issue 37): ``process_batch_result_prefill``
and ``process_batch_result_decode`` of ``SchedulerBatchResultProcessor`` over the driver's objects, its
output streamer a recorder; the output-after-abort oracle; a fault planted inside SGLang's processor is
found and minimized by ``kvaudit fuzz``."""

import pytest

from fault_helpers import fuzz_fault, minimized_fault_program
from kvaudit.audit.runner import AuditedRun
from kvaudit.program import Abort, Idle, Step, Submit
from kvaudit.targets.sglang.config import SGLANG_PRESETS

pytestmark = pytest.mark.sglang

# two requests decode; the first is aborted while running, the second runs to its length
ABORT_WHILE_DECODING = [Submit(), Submit(), Step(), Step(), Step(), Abort(handle=0), Step(), Step(), Idle()]


def run(ops, preset="sglang", **kw):
    r = AuditedRun(SGLANG_PRESETS[preset].config(**kw))
    for op in ops:
        if r.apply(op):
            break
    return r


@pytest.fixture
def calls(monkeypatch):
    """Counts of SGLang's processor methods the runs call."""
    from kvaudit.targets.sglang.boot import load

    load()  # (its import stubs first)
    from sglang.srt.managers.scheduler_components.batch_result_processor import SchedulerBatchResultProcessor as P

    seen = {"process_batch_result_prefill": 0, "process_batch_result_decode": 0}
    for name in seen:
        orig = getattr(P, name)

        def counted(self, batch, result, _orig=orig, _name=name):
            seen[_name] += 1
            return _orig(self, batch, result)

        monkeypatch.setattr(P, name, counted)
    return seen


@pytest.mark.parametrize("preset", ["sglang", "sglang-overlap", "sglang-mixed", "sglang-pd-decode"])
def test_batch_results_go_through_sglangs_own_processor_and_the_recorder(calls, preset):
    r = run(ABORT_WHILE_DECODING, preset)
    t = r.target
    assert r.findings == []
    assert calls["process_batch_result_decode"] > 0
    assert calls["process_batch_result_prefill"] > 0 or preset == "sglang-pd-decode"  # (prefill: the other server)
    # what went to the detokenizer: every request's finish, with the tokens the requests hold
    rec = t.output_recorder
    assert rec.batches == sum(calls.values()) == t.reach()["sglang_result_batches"]
    assert t.reach()["aborts_processed"] == 1
    assert set(rec.finishes) == set(t.submitted)
    (rid, (req, n, _)), = t._aborted.items()  # the aborted one: sent with the tokens it had at its release
    assert rec.finishes[rid] == "FINISH_ABORT" and rec.sent[rid] == n == len(req.output_ids)
    r.close()


def test_hisparse_runs_sglangs_processor_which_calls_the_coordinator(calls, monkeypatch):
    from sglang.srt.managers.hisparse_coordinator import HiSparseCoordinator

    finished = []
    orig = HiSparseCoordinator.request_finished
    monkeypatch.setattr(HiSparseCoordinator, "request_finished", lambda self, req: (finished.append(req.rid),
                                                                                     orig(self, req))[1])
    r = run([Submit(), Submit(), Step(), Step(), Idle()], "sglang-hisparse")
    assert r.findings == []
    assert calls["process_batch_result_prefill"] > 0 and calls["process_batch_result_decode"] > 0
    assert sorted(finished) == ["r0", "r1"]  # SGLang's processor called it, once a request
    r.close()


@pytest.mark.parametrize("preset", ["sglang", "sglang-overlap", "sglang-hisparse", "sglang-pd-decode"])
def test_output_after_abort_is_quiet_on_a_clean_run_and_fires_on_the_planted_fault(preset):
    clean = run(ABORT_WHILE_DECODING, preset)
    assert clean.findings == [] and clean.target._aborted  # the abort was processed by SGLang's decode result
    clean.close()
    faulty = run(ABORT_WHILE_DECODING, preset, bugs=frozenset({"decode-token-after-abort"}))
    (f,) = faulty.findings
    row = "_pre_alloc@decode.py" if preset == "sglang-pd-decode" else "request-kv"  # (PD decode's rows: prealloc)
    assert f.signature == f"use-after-free/req_to_token_pool/{row}/check:output-after-abort"
    assert "gained 1 output token(s) after its abort was processed" in f.message
    faulty.close()


@pytest.mark.parametrize("preset", ["sglang", "sglang-overlap", "sglang-hisparse"])
def test_a_release_lost_inside_sglangs_decode_finish_handling_is_a_leak(preset):
    ops = [Submit(), Step(), Step(), Step(), Step(), Step(), Step(), Step(), Idle()]
    assert run(ops, preset).findings == []
    r = run(ops, preset, bugs=frozenset({"decode-skip-release"}))
    assert ("leak", "req_to_token_pool") in {(f.kind, f.pool) for f in r.findings}
    assert not r.target._faults  # it fired
    r.close()


def test_the_oracle_reads_the_requests_tokens_not_the_fault():
    """A token appended to an aborted request by anything after its release is reported."""
    r = run(ABORT_WHILE_DECODING[:-2])
    t = r.target
    assert r.findings == [] and t.invariant_findings() == []
    (req, n, _), = t._aborted.values()
    req.output_ids.append(5)
    (f,) = t.invariant_findings()
    assert f.check == "output-after-abort" and f"with {n} tokens" in f.message
    r.close()


@pytest.mark.slow
def test_fuzz_finds_and_minimizes_the_fault_planted_in_sglangs_decode_result_processing(tmp_path):
    doc, path = fuzz_fault(tmp_path, "sglang", "sglang", "decode-token-after-abort", max_time="60")
    assert doc["findings"][0]["kind"] == "use-after-free"
    assert doc["findings"][0]["check"] == "output-after-abort"
    config, program = minimized_fault_program(path, max_ops=8)
    assert any(isinstance(op, Abort) for op in program)
