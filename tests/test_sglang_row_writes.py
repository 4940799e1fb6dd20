"""SGLang findings 3 and 14's secondary leak: two root causes whose leaks had one signature
(``leak/token_to_kv_pool/request-kv``, no second part); the target's row-write record tells them apart."""

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from kvaudit.audit.runner import execute
from kvaudit.replay import load
from kvaudit.targets.sglang.rowwrites import RowWrites

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
A2 = os.path.join(ROOT, "corpora/sglang/leak-a2-retracted-turn-finishes-session.json")
SPEC = os.path.join(ROOT, "corpora/sglang/aliasing-spec-row-overflow-ngram-deep.json")


def _leaks(path, full):
    config, program, _, _ = load(path)
    return {f.signature for f in execute(config, program, full_stacks=full).findings if f.kind == "leak"}


@pytest.mark.sglang
@pytest.mark.parametrize("full", [True, False])
def test_the_retracted_turn_leak_and_the_spec_row_overflow_leak_have_different_signatures(full):
    a2, spec = _leaks(A2, full), _leaks(SPEC, full)
    assert a2 and spec
    assert not a2 & spec, f"one signature, two root causes: {a2 & spec}"
    assert a2 == {"leak/token_to_kv_pool/request-kv/row:session"}
    assert spec == {"leak/token_to_kv_pool/request-kv/past-table"}


def _record(session_rows=(), page_size=1):
    ledger = SimpleNamespace(last_alloc=np.full(16, -1, dtype=np.int64))
    auditor = SimpleNamespace(ledgers={"token_to_kv_pool": ledger}, events=[None] * 3)
    return RowWrites(auditor, "token_to_kv_pool", page_size, lambda: list(session_rows)), auditor, ledger


def test_a_write_records_its_rows_place_and_a_write_past_the_table():
    rec, auditor, _ = _record(session_rows=[2])
    rec.put(torch.tensor(2), torch.tensor([4, 5]))  # one row (0-d)
    rec.put(1, torch.tensor([3]))  # one row (an int)
    rec.put(torch.tensor([1, 2, 9]), torch.tensor([6, 7, 8], dtype=torch.int32), past=torch.tensor([False, False, True]))
    got = rec.lost_by(np.array([4, 5, 3, 6, 7, 8, 9, 99], dtype=np.int64))
    assert got == ["row:session", "row:session", "row:request", "row:request", "row:session", "past-table", "", ""]


def test_a_write_before_the_units_latest_allocation_is_not_its_fact():
    rec, auditor, ledger = _record()
    rec.put(torch.tensor([1, 1]), torch.tensor([4, 5]))
    ledger.last_alloc[4] = len(auditor.events)  # unit 4 freed and allocated again since the write
    assert rec.lost_by(np.array([4, 5], dtype=np.int64)) == ["", "row:request"]


def test_pages_are_recorded_by_page():
    rec, _, _ = _record(session_rows=[3], page_size=4)
    rec.put(torch.tensor(3), torch.tensor([8, 9, 10, 11]))
    assert rec.lost_by(np.array([2, 1], dtype=np.int64)) == ["row:session", ""]
