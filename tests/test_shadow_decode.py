"""The eut shadow's decode rows (``install_shadow``'s batch wrapper, its decode-batch loop): a stale read in a
decode step is found, by the per-step audit and by a search's lean sparse run, which reports it as the per-step
run does -- also when the reader finished and released before that run's next full check; and a row marked to
finish writes nothing (the zoo's ``aborted-kv-inserted``). Stop 69 of docs/internals/performance.md measured a
lean run that defers these checks to its full checks: slower, not kept."""

from __future__ import annotations

import glob
import os

import pytest

import engine_under_test.scheduler as scheduler
from kvaudit import replay
from kvaudit.audit.runner import AuditedRun, execute
from kvaudit.program import Idle, Submit
from kvaudit.search.schedule import search_run
from kvaudit.targets.eut.presets import get_preset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _stale_kv_replay(path: str) -> bool:
    with open(path) as f:
        return '"stale-kv"' in f.read()


STALE = [p for p in sorted(glob.glob(os.path.join(ROOT, "corpora", "regressions", "*.json"))) if _stale_kv_replay(p)]


def _key(findings):
    return [(f.signature, f.op_index, f.step) for f in findings]


def _search(config, program) -> list:
    """The program as a search runs it (``search_run``: lean, the sparse schedule): its findings."""
    with search_run(config) as run:
        if not any(run.apply(op) for op in program):  # (up to the first finding)
            run.finish()
        return run.findings


@pytest.fixture
def swapped_decode_read(monkeypatch):
    """An engine defect for the test: at its 2nd decode batch the engine swaps the row entries of the first
    row's positions 0 and 1 (the same slots stay held: no leak, no free), so that decode step and every later
    one read position 0's KV from position 1's slot (and the reverse): a stale read in a decode step only."""
    update = scheduler.Scheduler.update_running_batch

    def swapping(self):
        batch = update(self)
        if batch is not None:
            self._ts_decodes = getattr(self, "_ts_decodes", 0) + 1
            if self._ts_decodes == 2:
                row = self.req_to_token_pool.req_to_token[batch.reqs[0].kv.req_pool_idx]
                row[0], row[1] = row[1].clone(), row[0].clone()
        return batch

    monkeypatch.setattr(scheduler.Scheduler, "update_running_batch", swapping)


def test_a_searchs_stale_decode_read_is_the_per_step_runs(swapped_decode_read):
    """The reader decodes a few steps more, finishes and releases its row before the program's end check (the
    search's run has no other full check here): the read is found at its step, and the search reports the
    per-step run's finding (signature, op, step)."""
    config = get_preset("default").config(model="none")
    program = [Submit(prompt_len=4, max_new_tokens=6), Idle()]
    want = execute(config, program, full_stacks=False).findings
    assert [f.kind for f in want] == ["stale-kv"] and "written for another token prefix" in want[0].message
    found = _search(config, program)
    assert _key(found) == _key(want)
    assert "did not reproduce" not in found[0].message


def test_a_stale_decode_read_among_other_rows_is_found(swapped_decode_read):
    """Several requests decode side by side: the swapped row's read is found at its step, among the other
    rows' clean reads, long before the drain ends."""
    config = get_preset("default").config(model="none")
    program = [Submit(prompt_len=4, max_new_tokens=40), Submit(prompt_len=6, max_new_tokens=40), Idle()]
    want = execute(config, program, full_stacks=False).findings
    assert [f.kind for f in want] == ["stale-kv"]
    with AuditedRun(config, full_stacks=False, check_every=4, lean=True) as run:
        found = run.apply(program[0]) or run.apply(program[1]) or run.apply(program[2])
        assert _key(found) == _key(want)
        assert run.target.steps < 12  # found soon after the swap, long before the drain ends


@pytest.mark.parametrize("path", STALE, ids=[os.path.basename(p) for p in STALE])
def test_the_zoos_stale_reads_are_found_by_a_lean_sparse_run(path):
    config, program, _, _ = replay.load(path)
    want = _key(execute(config, program, full_stacks=False).findings)
    assert want and _key(_search(config, program)) == want
